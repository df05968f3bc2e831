"""Chapter 2's collectives, built from send/recv, against torch's built-ins and a float64 reference.

One launch per world size (1 to 5) runs every collective, algorithm, op, dtype and a range of
lengths (shorter than the world size, not divisible by it, long enough for the ring to slice).
Integers must match exactly. Floats must agree with torch's result and with a float64 reference
computed on every rank from all ranks' inputs, within the rounding bound of a reduction over p
terms: |error| <= p * eps(dtype) * sum_i |x_i| (PRODUCT: p * eps * |product|).
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dmlbook.comm import algorithms, costmodel
from dmlbook.comm import collectives as C
from dmlbook.launch import RankError, run

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)
OPS = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,
    "PRODUCT": ReduceOp.PRODUCT,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
}


def _input(rank: int, n: int, dtype: torch.dtype, op: str, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: the same on every rank that asks, so each can build the reference."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == torch.int64:
        low, high = (1, 4) if op == "PRODUCT" else (-50, 50)
        return torch.randint(low, high, (n,), generator=g)
    if op == "PRODUCT":
        x = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(n, generator=g, dtype=torch.float64)
    return x.to(dtype)


def _reference(inputs: list[torch.Tensor], op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 result of reducing ``inputs``, and the scale its rounding error is measured on."""
    xs = torch.stack([x.double() for x in inputs])
    p = len(inputs)
    if op in ("SUM", "AVG"):
        result, scale = xs.sum(0), xs.abs().sum(0)
        if op == "AVG":
            result, scale = result / p, scale / p
    elif op == "PRODUCT":
        result = xs.prod(0)
        scale = result.abs()
    else:
        result = xs.max(0).values if op == "MAX" else xs.min(0).values
        scale = torch.zeros_like(result)
    return result, scale


def _close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, p: int, slack: int = 1):
    """Exact for integers; within ``slack`` x p x eps x scale (plus one rounding) for floats."""
    if not got.dtype.is_floating_point:
        return torch.equal(got, want.to(got.dtype))
    eps = torch.finfo(got.dtype).eps
    bound = slack * p * eps * scale + eps * want.double().abs()
    return bool(((got.double() - want.double()).abs() <= bound).all())


def _lengths(p: int) -> list[int]:
    return sorted({1, max(1, p - 1), 7, 1000 + p})


def _check_everything(world: int) -> dict:
    """Run every collective on this rank; return the failures and how many checks ran."""
    rank, p = dist.get_rank(), dist.get_world_size()
    failures, checks = [], 0

    def expect(ok: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(f"rank {rank}: {what}")

    def same_on_all_ranks(t: torch.Tensor) -> bool:
        everyone = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(everyone, t)
        return all(torch.equal(e, everyone[0]) for e in everyone)

    for dtype in DTYPES:
        for op_name, op in OPS.items():
            if op_name == "AVG" and dtype == torch.int64:
                continue
            for n in _lengths(p):
                inputs = [_input(r, n, dtype, op_name) for r in range(p)]
                want, scale = _reference(inputs, op_name)
                theirs = inputs[rank].clone()
                dist.all_reduce(theirs, op=op)
                tag = f"{dtype} {op_name} n={n}"
                for algorithm in C.ALGORITHMS:
                    ours = inputs[rank].clone()
                    C.all_reduce(ours, op=op, algorithm=algorithm)
                    expect(_close(ours, want, scale, p), f"all_reduce {algorithm} {tag} vs float64")
                    expect(_close(ours, theirs, scale, p, slack=2), f"{algorithm} {tag} vs torch")
                    expect(same_on_all_ranks(ours), f"all_reduce {algorithm} {tag}: ranks differ")
                for dst in range(p):
                    ours = inputs[rank].clone()
                    C.reduce(ours, dst=dst, op=op)
                    if rank == dst:
                        expect(_close(ours, want, scale, p), f"reduce dst={dst} {tag}")
                    else:
                        expect(torch.equal(ours, inputs[rank]), f"reduce {tag}: input changed")
                outs = [_input(r, n * p, dtype, op_name, salt=1) for r in range(p)]
                want_rs, scale_rs = _reference(outs, op_name)
                mine = slice(rank * n, (rank + 1) * n)
                ours = torch.empty(n, dtype=dtype)
                C.reduce_scatter(ours, list(outs[rank].split(n)), op=op)
                theirs = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(theirs, list(outs[rank].split(n)), op=op)
                expect(_close(ours, want_rs[mine], scale_rs[mine], p), f"reduce_scatter {tag}")
                expect(_close(ours, theirs, scale_rs[mine], p, slack=2), f"rs {tag} vs torch")
        for n in _lengths(p):
            x = [_input(r, n, dtype, "SUM", salt=2).view(-1, 1) for r in range(p)]  # 2-d
            for root in range(p):
                ours = x[rank].clone()
                C.broadcast(ours, src=root)
                expect(torch.equal(ours, x[root]), f"broadcast src={root} {dtype} n={n}")
                got = [torch.empty_like(x[0]) for _ in range(p)] if rank == root else None
                C.gather(x[rank], got, dst=root)
                if rank == root:
                    expect(
                        all(torch.equal(g, w) for g, w in zip(got, x, strict=True)),
                        f"gather {dtype} {n}",
                    )
                ours = torch.empty_like(x[0])
                C.scatter(ours, list(x) if rank == root else None, src=root)
                expect(torch.equal(ours, x[rank]), f"scatter src={root} {dtype} n={n}")
            got = [torch.empty_like(x[0]) for _ in range(p)]
            C.all_gather(got, x[rank])
            theirs = [torch.empty_like(x[0]) for _ in range(p)]
            dist.all_gather(theirs, x[rank])
            expect(
                all(torch.equal(g, w) for g, w in zip(got, x, strict=True)),
                f"all_gather {dtype} n={n}",
            )
            expect(
                all(torch.equal(g, w) for g, w in zip(got, theirs, strict=True)),
                f"all_gather vs torch {n}",
            )

    # Long enough that every ring chunk travels as several slices; non-contiguous input too.
    n = 3 * C.RING_SLICE_BYTES // 4 * p + 5
    inputs = [_input(r, n, torch.float32, "SUM", salt=3) for r in range(p)]
    want, scale = _reference(inputs, "SUM")
    for algorithm in C.ALGORITHMS:
        ours = inputs[rank].clone()
        C.all_reduce(ours, algorithm=algorithm)
        expect(_close(ours, want, scale, p), f"all_reduce {algorithm} sliced n={n}")
    # Chapter 2's teaching ring (one chunk per step) gives the optimised ring's bits: same schedule.
    for dtype in (torch.float32, torch.int64):
        for n in _lengths(p):
            chunks = list(_input(rank, n * p, dtype, "SUM", salt=4).split(n))
            ours = torch.empty(n, dtype=dtype)
            C.reduce_scatter(ours, [c.clone() for c in chunks])
            algorithms.ring_reduce_scatter(chunks)
            expect(torch.equal(chunks[rank], ours), f"teaching ring reduce-scatter {dtype} n={n}")
    base = torch.stack([inputs[rank][:1000], inputs[rank][1000:2000]], dim=1)  # (1000, 2)
    ours = base.t()  # non-contiguous view: the result must land in the caller's tensor
    C.all_reduce(ours)
    expect(_close(ours.t()[:, 0], want[:1000], scale[:1000], p), "non-contiguous all_reduce")
    return {"failures": failures, "checks": checks}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_matches_torch_and_float64(world):
    results = run(_check_everything, world, world, timeout=200)
    assert [f for r in results for f in r["failures"]] == []
    combos = len(DTYPES) * len(OPS) - 1  # AVG of integers is refused
    all_reduce_checks = combos * len(_lengths(world)) * len(C.ALGORITHMS) * 3
    assert all(r["checks"] > all_reduce_checks for r in results)  # the checks really ran


def _subgroups():
    """Subgroups of 3 and 2 ranks out of 5; ranks outside a group call and get no change."""
    rank = dist.get_rank()
    odd_one_out = dist.new_group([0, 2, 4])
    pair = dist.new_group([3, 1])
    out = {}
    for name, group, members in (("trio", odd_one_out, [0, 2, 4]), ("pair", pair, [1, 3])):
        x = torch.tensor([float(rank + 1), 2.0**rank])
        for algorithm in C.ALGORITHMS:
            ours = x.clone()
            C.all_reduce(
                ours,
                op=ReduceOp.MAX if algorithm == "tree" else ReduceOp.SUM,
                group=group,
                algorithm=algorithm,
            )
            theirs = x.clone()
            if rank in members:
                dist.all_reduce(
                    theirs, op=ReduceOp.MAX if algorithm == "tree" else ReduceOp.SUM, group=group
                )
            out[(name, algorithm)] = torch.equal(ours, theirs)
        root = members[-1]
        ours = x.clone()
        C.broadcast(ours, src=root, group=group)
        out[(name, "broadcast")] = torch.equal(ours, torch.tensor([root + 1.0, 2.0**root])) or (
            rank not in members and torch.equal(ours, x)
        )
        got = [torch.empty(2) for _ in members]
        C.all_gather(got, x, group=group)
        if rank in members:
            out[(name, "all_gather")] = torch.equal(
                torch.stack(got), torch.tensor([[m + 1.0, 2.0**m] for m in members])
            )
    return out


@pytest.mark.timeout(60)
def test_subgroups_match_torch():
    results = run(_subgroups, 5, timeout=40)
    for rank, res in enumerate(results):
        assert res and all(res.values()), (rank, res)


def _trace(n: int, algorithm: str):
    with C.recording_sends() as sends:
        C.all_reduce(torch.ones(n), algorithm=algorithm)
    return sends


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [3, 4])
def test_trace_counts_the_bytes_the_cost_model_counts(world):
    """Bytes recorded by every rank add up to what each algorithm must move; the ring replay ends
    with every rank holding every chunk summed over all ranks."""
    n = 1001

    def everything():
        return {a: _trace(n, a) for a in C.ALGORITHMS}

    traces = run(everything, world, timeout=40)
    sent = {a: sum(s.nbytes for t in traces for s in t[a]) for a in C.ALGORITHMS}
    pow2 = 1 << (world.bit_length() - 1)
    extra = world - pow2
    assert sent["ring"] == 2 * (world - 1) * n * 4
    assert sent["tree"] == 2 * (world - 1) * n * 4
    assert sent["naive"] == 2 * (world - 1) * n * 4
    assert sent["recursive_doubling"] == (2 * extra + pow2 * int(math.log2(pow2))) * n * 4
    # The busiest rank of the ring sends what the cost model charges the critical path, to within
    # one element per chunk (the chunks differ by one element when n does not divide).
    busiest = max(sum(s.nbytes for s in t["ring"]) for t in traces)
    _, model_bytes, _ = costmodel.terms("ring", world, n * 4)
    assert abs(busiest - model_bytes) <= 2 * (world - 1) * 4
    states = C.chunk_holdings([s for t in traces for s in t["ring"]], world)
    assert len(states) == 2 * (world - 1) + 1
    everyone = frozenset(range(world))
    assert all(chunk == everyone for row in states[-1] for chunk in row)
    # After the reduce-scatter half, rank r (and only it) holds chunk r complete.
    half = states[world - 1]
    assert all((half[r][c] == everyone) == (r == c) for r in range(world) for c in range(world))


def _mismatched_shapes():
    rank = dist.get_rank()
    C.all_reduce(torch.ones(4 + (rank == 2)))


def _avg_of_integers():
    C.all_reduce(torch.ones(3, dtype=torch.int64), op=ReduceOp.AVG)


def _bad_root():
    C.broadcast(torch.ones(3), src=dist.get_world_size())


def _wrong_list():
    C.all_gather([torch.empty(3)], torch.ones(3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "fn, message",
    [
        (_mismatched_shapes, r"different tensor shapes .*rank 2: \(5,\)"),
        (_avg_of_integers, "AVG needs a floating dtype"),
        (_bad_root, "src=3 is not a rank"),
        (_wrong_list, "list of 3 tensors"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_hang(fn, message):
    with pytest.raises(RankError, match=message):
        run(fn, 3, timeout=20)


def test_unknown_algorithm_and_dtype_are_refused_before_any_message():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        C.all_reduce(torch.ones(2), algorithm="butterfly")
    with pytest.raises(TypeError, match="dtype torch.int8"):
        C.all_reduce(torch.ones(2, dtype=torch.int8))


# --------------------------------------------------------------------------- reduced-precision ring

WIRES = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # dtype -> unit roundoff


def _transfer_dtype_errors() -> dict:
    """The ring with chunks sent in bf16 / fp16 against float64, fp32 and torch's own bf16 / fp16
    all-reduce, with the bytes each sends."""
    rank, p = dist.get_rank(), dist.get_world_size()
    failures, errors = [], {}
    n = 3 * C.RING_SLICE_BYTES // 4 * p + 5  # several slices per chunk
    inputs = [_input(r, n, torch.float32, "SUM", salt=4) for r in range(p)]
    want, scale = _reference(inputs, "SUM")
    for wire, u in WIRES.items():
        for op_name in ("SUM", "AVG"):
            op = OPS[op_name]
            div = p if op_name == "AVG" else 1
            ours = inputs[rank].clone()
            with C.recording_sends() as sends:
                C.all_reduce(ours, op=op, transfer_dtype=wire)
            err = (ours.double() - want / div).abs()
            # p - 1 roundings of partial sums on the way round, one of the result, fp32 sums
            bound = (p * u + p * torch.finfo(torch.float32).eps) * scale / div
            if not bool((err <= bound).all()):
                failures.append(f"rank {rank}: {wire} {op_name} beyond p*u*sum|x|")
            everyone = [torch.empty_like(ours) for _ in range(p)]
            dist.all_gather(everyone, ours)
            if not all(torch.equal(e, ours) for e in everyone):
                failures.append(f"rank {rank}: {wire} {op_name}: ranks differ")
            if ours.dtype != torch.float32:
                failures.append(f"rank {rank}: result is {ours.dtype}")
            theirs = inputs[rank].to(wire)  # torch's way: the whole tensor cast, summed in it
            dist.all_reduce(theirs, op=op)
            errors[wire, op_name] = {
                "ours": (err / (scale / div)).mean().item(),
                "torch": ((theirs.double() - want / div).abs() / (scale / div)).mean().item(),
                "bytes": sum(s.nbytes for s in sends),
            }
    fp32 = inputs[rank].clone()
    with C.recording_sends() as sends:
        C.all_reduce(fp32)
    errors["fp32"] = {
        "ours": ((fp32.double() - want).abs() / scale).mean().item(),
        "bytes": sum(s.nbytes for s in sends),
    }
    return {"failures": failures, "errors": errors}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_with_reduced_precision_transfer(world):
    results = run(_transfer_dtype_errors, world, timeout=100)
    assert [f for r in results for f in r["failures"]] == []
    errors = results[0]["errors"]
    for wire in WIRES:
        for op_name in ("SUM", "AVG"):
            e = errors[wire, op_name]
            if world == 1:  # nothing is sent, nothing is rounded
                assert e["ours"] == 0 and e["bytes"] == 0
                continue
            # exactly half the bytes of the fp32 ring, and really rounded on the way
            assert 2 * e["bytes"] == errors["fp32"]["bytes"]
            assert e["ours"] > 10 * errors["fp32"]["ours"]
            # summing in fp32 beats summing in the wire dtype, as torch's cast-then-reduce does
            assert e["ours"] < e["torch"], (wire, op_name, e)


def _transfer_dtype_misuse(case):
    x = torch.ones(8) if case != "int" else torch.ones(8, dtype=torch.int64)
    kwargs = {"transfer_dtype": torch.bfloat16}
    if case == "tree":
        kwargs["algorithm"] = "tree"
    if case == "max":
        kwargs["op"] = ReduceOp.MAX
    C.all_reduce(x, **kwargs)


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("tree", ValueError, "transfer_dtype is a ring option"),
        ("int", TypeError, "both must be floating"),
        ("max", ValueError, "op must be SUM or AVG"),
    ],
)
def test_transfer_dtype_misuse_is_refused_before_any_message(case, error, message):
    with pytest.raises(error, match=message):
        _transfer_dtype_misuse(case)


# ---------------------------------------------------------------- the check in the first message


def _mismatch_then_recover():
    """Equal calls, then calls where one rank's tensor differs (the first message carries the
    check), each caught; then an equal call must give the right sum: nothing left on the wire."""
    from dmlbook.comm import shapecheck

    rank, world = dist.get_rank(), dist.get_world_size()
    errors = []
    big = C.AUTO_RING_FROM_BYTES // 4
    cases = [  # (the equal length, this rank's length, transfer dtype, inline limit in bytes)
        (10, 10 + (rank == world - 1), None, 1 << 20),  # the first slice behind the header
        (3000, 3000 - (rank == 0), None, 1024),  # 3-6 KiB slices: sent apart from the header
        (7, 0 if rank == 1 else 7, None, 1 << 20),  # an empty tensor on one rank
        (9, 9, torch.bfloat16 if rank == 0 else None, 1 << 20),  # transfer dtype on one rank
        # at auto's threshold: from 3 ranks, rank 0 starts recursive doubling, the others the
        # ring; its whole tensor (2 MiB) goes apart from the header
        (big, big - (rank == 0), None, 1 << 20),
    ]
    # each case under the ring, recursive doubling, and auto (ranks may then start differently)
    for algorithm in ("ring", "recursive_doubling", "auto"):
        for same, n, wire, limit in cases:
            shapecheck.INLINE_BYTES = limit
            ok = torch.full((same,), float(rank))
            C.all_reduce(ok, algorithm=algorithm)  # an equal call first
            chosen = "ring" if wire is not None else algorithm
            try:
                C.all_reduce(torch.ones(n), transfer_dtype=wire, algorithm=chosen)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
            after = torch.full((same,), float(rank + 1))
            C.all_reduce(after, algorithm=algorithm)
            errors.append(after.tolist() == [world * (world + 1) / 2] * same)
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_shape_that_changes_between_calls_is_an_error_on_every_rank(world):
    for rank, errors in enumerate(run(_mismatch_then_recover, world, timeout=90)):
        messages, recovered = errors[0::2], errors[1::2]
        assert recovered == [True] * 15, (rank, errors)
        assert all(m is not None and "ranks passed different" in m for m in messages), messages
        assert all(f"rank {world - 1}: (11,)" in m for m in messages[0::5])
        assert all("(wire torch.bfloat16)" in m for m in messages[3::5])


def _gather_scatter_against_torch() -> list[str]:
    """The ring all-gather and reduce-scatter, whose check rides in their first message, against
    torch's own, with the first slice behind the header and (a small inline limit) apart."""
    from dmlbook.comm import shapecheck

    rank, p = dist.get_rank(), dist.get_world_size()
    failures = []
    try:
        for limit in (1 << 20, 16):  # 16 bytes: only the smallest first slices fit inline
            shapecheck.INLINE_BYTES = limit
            # 3/4 of the ring's slice size times p: each chunk travels as several slices
            for n in (1, 3, 1000 + p, 3 * C.RING_SLICE_BYTES // 4 * p + 5):
                dtypes = (torch.float32, torch.float64, torch.int64) if n < 10_000 else DTYPES[:1]
                for dtype in dtypes:
                    x = _input(rank, n, dtype, "SUM", salt=5).view(1, -1)  # 2-d
                    ours = [torch.empty_like(x) for _ in range(p)]
                    C.all_gather(ours, x)
                    theirs = [torch.empty_like(x) for _ in range(p)]
                    dist.all_gather(theirs, x)
                    if not all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)):
                        failures.append(f"rank {rank}: all_gather {dtype} n={n} limit={limit}")
                    inputs = list(_input(rank, n * p, dtype, "SUM", salt=6).split(n))
                    ours = torch.empty(n, dtype=dtype)
                    C.reduce_scatter(ours, inputs)
                    theirs = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(theirs, inputs)
                    outs = [_input(r, n * p, dtype, "SUM", salt=6) for r in range(p)]
                    want, scale = _reference(outs, "SUM")
                    mine = slice(rank * n, (rank + 1) * n)
                    if not (
                        _close(ours, want[mine], scale[mine], p)
                        and _close(ours, theirs, scale[mine], p, slack=2)
                    ):
                        failures.append(f"rank {rank}: reduce_scatter {dtype} n={n} limit={limit}")
    finally:
        shapecheck.INLINE_BYTES = 1 << 20
    return failures


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_gather_and_reduce_scatter_carrying_the_check_match_torch(world):
    assert [f for r in run(_gather_scatter_against_torch, world, timeout=200) for f in r] == []


def _gather_scatter_mismatches() -> list:
    """Mismatched all-gathers and reduce-scatters, each caught on every rank (with how long it
    took), each followed by an equal call that must give torch's answer: nothing left on the
    wire. Returns [(message or None, seconds, recovered)] per case."""
    import time

    from dmlbook.comm import shapecheck

    rank, p = dist.get_rank(), dist.get_world_size()
    big = 3 * C.RING_SLICE_BYTES // 4  # 3 MiB of fp32: three 1 MiB slices
    cases = [  # (this rank's shape, its dtype, inline limit in bytes)
        ((2, 3) if rank == 0 else (3, 2), torch.float32, 1 << 20),  # same numel, other shape
        ((6,), torch.float64 if rank == p - 1 else torch.float32, 1 << 20),  # dtype
        ((7 + (rank == 1),), torch.float32, 1 << 20),  # numel
        ((2 + (rank == 1), 5, 4), torch.float32, 1 << 20),  # a batch of 2 on rank 0, 3 on 1
        ((2 + (rank == 1), 5, 4), torch.float32, 32),  # first slices too big to go inline
        ((big + (rank == 0),), torch.float32, 1 << 20),  # mixed: rank 0's first apart, 1's inline
        ((big - (rank == 1),), torch.float32, 1 << 19),  # several slices, none inline
        ((0 if rank == 1 else 5,), torch.float32, 1 << 20),  # an empty tensor on one rank
    ]
    results = []
    try:
        for collective in ("all_gather", "reduce_scatter"):
            for shape, dtype, limit in cases:
                shapecheck.INLINE_BYTES = limit
                x = torch.ones(shape, dtype=dtype)
                start = time.perf_counter()
                try:
                    if collective == "all_gather":
                        C.all_gather([torch.empty_like(x) for _ in range(p)], x)
                    else:
                        C.reduce_scatter(torch.empty_like(x), [x.clone() for _ in range(p)])
                    message = None
                except ValueError as e:
                    message = str(e)
                seconds = time.perf_counter() - start
                y = torch.full((5, 3), float(rank + 1))  # an equal call after the mismatch
                if collective == "all_gather":
                    got = [torch.empty_like(y) for _ in range(p)]
                    C.all_gather(got, y)
                    ok = all(torch.equal(g, torch.full((5, 3), r + 1.0)) for r, g in enumerate(got))
                else:
                    got = torch.empty_like(y)
                    C.reduce_scatter(got, [y.clone() for _ in range(p)])
                    ok = torch.equal(got, torch.full((5, 3), p * (p + 1) / 2))
                results.append((message, seconds, ok))
    finally:
        shapecheck.INLINE_BYTES = 1 << 20
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_and_reduce_scatter_mismatch_is_an_error_on_every_rank(world):
    results = run(_gather_scatter_mismatches, world, timeout=90)
    for rank, cases in enumerate(results):
        assert len(cases) == 16, (rank, cases)
        for i, (message, seconds, recovered) in enumerate(cases):
            what = "tensor shapes" if i < 8 else "output shapes"
            assert message is not None and f"ranks passed different {what}" in message, (i, rank)
            assert seconds < 10, (i, rank, seconds)  # an error, not a hang
            assert recovered, (i, rank, message)
        messages = [m for m, _, _ in cases]
        assert "rank 0: (2, 3) torch.float32, rank 1: (3, 2)" in messages[0]
        assert f"rank {world - 1}: (6,) torch.float64" in messages[1]
        assert "rank 0: (2, 5, 4) torch.float32, rank 1: (3, 5, 4)" in messages[3]
        shapes = [m[m.index("(") :] for m in messages]  # each rank's shape, the same both ways
        assert shapes[0:8] == shapes[8:16]
    # the same message on every rank
    assert all([m for m, _, _ in r] == [m for m, _, _ in results[0]] for r in results)


def _all_gather_header_messages() -> dict:
    """The messages a checked and an unchecked all-gather and reduce-scatter send, counted at
    the process group, where every message goes (``dist.isend`` and the shape check's header
    alike; recording_sends leaves header messages out)."""
    from unittest import mock

    pg = dist.group.WORLD
    counts = {}
    for name, fn in (
        ("all_gather", lambda x, **k: C.all_gather([torch.empty_like(x)] * 2, x, **k)),
        ("reduce_scatter", lambda x, **k: C.reduce_scatter(torch.empty_like(x), [x, x], **k)),
    ):
        for check in (True, False):
            sent = []
            real_send = type(pg).send

            def send(self, tensors, dst, tag, _real=real_send, _sent=sent):
                _sent.append(tag)
                return _real(self, tensors, dst, tag)

            with mock.patch.object(type(pg), "send", send):
                fn(torch.ones(10), check=check)
            counts[name, check] = len(sent)
    return counts


def test_the_check_of_all_gather_and_reduce_scatter_sends_no_message_of_its_own():
    """At world size 2, a 40-byte all-gather or reduce-scatter sends one message each way,
    checked or not: the header travels in it."""
    for counts in run(_all_gather_header_messages, 2, timeout=30):
        assert counts == {
            ("all_gather", True): 1,
            ("all_gather", False): 1,
            ("reduce_scatter", True): 1,
            ("reduce_scatter", False): 1,
        }, counts


# --------------------------------------------------------------------------- algorithm="auto"


def _auto_against_its_choice():
    """auto's result is bit for bit that of the algorithm it names, on both sides of the
    threshold, with lengths the world size does not divide."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in (5, 1001, C.AUTO_RING_FROM_BYTES // 4 + 3):
        inputs = [_input(r, numel, torch.float32, "SUM") for r in range(world)]
        _, scale = _reference(inputs, "SUM")
        ours, named, theirs = (inputs[rank].clone() for _ in range(3))
        C.all_reduce(ours, algorithm="auto")
        chosen = C.choose_all_reduce(numel * 4, world) if world > 1 else "ring"
        C.all_reduce(named, algorithm=chosen)
        dist.all_reduce(theirs)
        out.append((chosen, torch.equal(ours, named), _close(ours, theirs, scale, world, slack=2)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_auto_is_the_algorithm_it_chooses_and_agrees_with_torch(world):
    for rank_result in run(_auto_against_its_choice, world, timeout=120):
        assert all(same and close for _, same, close in rank_result), rank_result


def test_auto_chooses_by_size_at_every_world_size():
    big, small = C.AUTO_RING_FROM_BYTES, C.AUTO_RING_FROM_BYTES - 1
    assert [C.choose_all_reduce(n, 4) for n in (small, big)] == ["recursive_doubling", "ring"]
    assert C.choose_all_reduce(big, 3) == "ring"
    # p = 2: the same bytes, but recursive doubling adds the whole tensor where the ring adds half
    assert [C.choose_all_reduce(n, 2) for n in (small, big)] == ["recursive_doubling", "ring"]


def _checked_where_nothing_rides_inline() -> list[list[float]]:
    """Every checked collective whose first message may carry data, on a device that cannot
    carry it (NCCL needs equal message sizes: the header then travels alone): the slice must
    still be sent on its own, or the receiver waits for it for ever."""
    from unittest import mock

    from dmlbook.comm import shapecheck

    rank, p = dist.get_rank(), dist.get_world_size()
    real_init = shapecheck.ShapeCheck.__init__

    def like_nccl(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.can_inline = False

    with mock.patch.object(shapecheck.ShapeCheck, "__init__", like_nccl):
        x = torch.arange(6.0) + rank
        gathered = [torch.empty(6) for _ in range(p)]
        C.all_gather(gathered, x)
        out = torch.empty(6)
        C.reduce_scatter(out, [x.clone() for _ in range(p)])
        ring, doubling = x.clone(), x.clone()
        C.all_reduce(ring, algorithm="ring")
        C.all_reduce(doubling, algorithm="recursive_doubling")
    return [t.tolist() for t in (*gathered, out, ring, doubling)]


@pytest.mark.timeout(60)
def test_a_slice_the_device_cannot_carry_behind_the_header_is_sent_on_its_own():
    for got in run(_checked_where_nothing_rides_inline, 2, timeout=30):
        x0, x1 = torch.arange(6.0), torch.arange(6.0) + 1
        assert got[:2] == [x0.tolist(), x1.tolist()]
        assert got[2] == (x0 + x1).tolist() == got[3] == got[4]
