"""Checkers for the exercises of chapter 9b ("Beyond the book: ZeRO and FSDP").

1. ``check_max_parameters``: write ``max_parameters(memory_bytes, world_size, stage,
   param_bytes, grad_bytes, state_bytes)``, the largest number of parameters whose model states
   fit in ``memory_bytes`` per rank at ZeRO stage 0 (plain data parallelism), 1, 2 or 3, no
   padding; ValueError for any other stage. Mixed precision (2, 2, 12) and bf16 parameters with
   fp32 gradients (2, 4, 12) tell a stage 2 that shards the parameters from one that shards the
   gradients.
2. ``check_fsdp_linear``: write ``fsdp_linear(x, weight_shard, out_features, in_features,
   group)``, stage 3 for one linear layer: each rank keeps only its flat, padded shard of the
   weight; forward gathers the whole weight, backward gathers it again and reduce-scatters the
   weight's gradient (averaged over the ranks) to the shards. Checked on 3 ranks with torch's
   differentiable collectives and FSDP switched off; the collectives each rank calls are
   counted, and what autograd saves for backward is seen, so that keeping the whole weight for
   backward, or an all-reduce in place of the reduce-scatter, is rejected.
3. ``check_comm_bytes``: write ``comm_bytes(psi, world_size, stage, param_bytes, grad_bytes)``,
   the bytes one rank sends per step over ring collectives: an all-reduce moves 2(N-1)/N of the
   tensor, a reduce-scatter or an all-gather (N-1)/N; gradients at ``grad_bytes`` per element,
   parameters at ``param_bytes``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from fractions import Fraction

import torch

from dmlbook.exercises import (
    ExerciseFailed,
    checker,
    expect_value_error,
    learner_code,
    run_answer,
)

__all__ = ["check_comm_bytes", "check_fsdp_linear", "check_max_parameters"]


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def _expects_valueerror(fn: Callable, args: tuple, why: str) -> None:
    expect_value_error(f"{fn.__name__}{args}", lambda: fn(*args), why)


# --------------------------------------------------------------------------- 1. the largest model


MIXED, FP32, BF16_FP32_GRADS = (2, 2, 12), (4, 4, 8), (2, 4, 12)
GB = 10**9
_CASES = [(32 * GB, 64, s, *MIXED) for s in range(4)] + [
    (80 * GB, 8, 2, *BF16_FP32_GRADS), (80 * GB, 8, 1, *BF16_FP32_GRADS),
    (80 * GB, 64, 3, *BF16_FP32_GRADS), (80 * GB, 8, 0, *BF16_FP32_GRADS),
    (16 * GB, 3, 1, *FP32), (16 * GB, 3, 2, *FP32), (16 * GB, 3, 3, *FP32),
    (24 * GB, 1, 3, *MIXED), (40 * GB, 5, 2, *MIXED),
]  # fmt: skip


def _per_parameter(n: int, stage: int, p: int, g: int, k: int) -> Fraction:
    """Bytes of model states per parameter on one rank, exactly (the paper's formula)."""
    return (
        Fraction(p, n if stage >= 3 else 1)
        + Fraction(g, n if stage >= 2 else 1)
        + Fraction(k, n if stage >= 1 else 1)
    )


def _fits(memory: int, n: int, stage: int, p: int, g: int, k: int) -> Fraction:
    return Fraction(memory) / _per_parameter(n, stage, p, g, k)


def _wrong_max(memory, n, stage, p, g, k) -> dict[str, float]:
    """The typical wrong answers, each with what it got wrong."""
    exact = _fits(memory, n, stage, p, g, k)
    wrong = {
        "rounded up: a model of that many parameters does not fit. Round down (floor)": (
            math.ceil(exact)
        ),
        "the bytes per parameter; the number of parameters is the memory divided by it": float(
            _per_parameter(n, stage, p, g, k)
        ),
        "in billions (or the memory in GB): return a count of parameters, from bytes": float(
            exact / GB
        ),
        "the mixed-precision figure (2 + 2 + 12 bytes) whatever the sizes you are given": (
            math.floor(_fits(memory, n, stage, *MIXED))
        ),
        "the fp32 figure (4 + 4 + 8 bytes); use the byte sizes you are given": math.floor(
            _fits(memory, n, stage, *FP32)
        ),
        "stage 2 sharding the parameters and keeping the gradients whole: stage 2 shards the "
        "gradients (each rank keeps only the reduce-scattered average of its shard); the "
        "parameters stay whole until stage 3 (or you swapped param_bytes and grad_bytes)": (
            math.floor(Fraction(memory) / (Fraction(p, n) + g + Fraction(k, n)))
            if stage == 2 and p != g
            else -1
        ),
        "the next stage's figure: stage 1 shards only the optimizer state, stage 2 adds the "
        "gradients, stage 3 the parameters": math.floor(
            _fits(memory, n, min(stage + 1, 3), p, g, k)
        ),
        "the previous stage's figure: stage 1 shards the optimizer state, stage 2 adds the "
        "gradients, stage 3 the parameters": math.floor(
            _fits(memory, n, max(stage - 1, 0), p, g, k)
        ),
        "stage 3 counting a whole gathered copy of the parameters besides the shards. The model "
        "states are the shards; a unit gathered for its forward is a temporary buffer the "
        "formula leaves out": (
            math.floor(Fraction(memory) / (_per_parameter(n, 3, p, g, k) + p)) if stage == 3 else -1
        ),
        "the whole memory of all N ranks over 2 + 2 + ... bytes, which only stage 3 reaches": (
            math.floor(Fraction(memory * n, p + g + k))
        ),
    }
    if n == 1:
        wrong = {why: v for why, v in wrong.items() if not why.startswith(("the next", "the prev"))}
    return wrong


@checker(
    "max_parameters",
    writes=("dmlbook.advanced.zero.accounting.paper_bytes",),
)
def check_max_parameters(fn: Callable[..., int]) -> str:
    """Check ``fn(memory_bytes, world_size, stage, param_bytes, grad_bytes, state_bytes)`` is the
    largest number of parameters whose model states fit in ``memory_bytes`` on each rank at that
    ZeRO stage: floor(memory / bytes per parameter), with p + g + k; p + g + k/N; p + (g + k)/N;
    (p + g + k)/N bytes per parameter at stages 0-3; ValueError for any other stage."""
    for memory, n, stage, p, g, k in _CASES:
        call = (
            f"your max_parameters(memory_bytes={memory}, world_size={n}, stage={stage}, "
            f"param_bytes={p}, grad_bytes={g}, state_bytes={k})"
        )
        with learner_code(call):
            got = fn(memory, n, stage, p, g, k)
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(f"{call} returned {got!r}, not a number of parameters")
        exact = _fits(memory, n, stage, p, g, k)
        want = math.floor(exact)
        # a float division may land just under an exact whole answer: accept one less then
        if got == want or (exact == want and got == want - 1):
            continue
        hint = None
        if isinstance(got, float) and got != int(got) and abs(got - float(exact)) < 1:
            hint = ": a number of parameters is a whole number; round down (floor) to one that fits"
        if hint is None:
            hint = next(
                (
                    f": that is {why}"
                    for why, value in _wrong_max(memory, n, stage, p, g, k).items()
                    if abs(float(got) - float(value)) <= max(0.5, 1e-12 * abs(float(value)))
                ),
                None,
            )
        if hint is None:
            hint = (
                ". Divide the memory by the bytes one parameter costs on a rank: param_bytes + "
                "grad_bytes + state_bytes, with each part the stage shards divided by N"
            )
        raise ExerciseFailed(f"{call} returned {got!r}, expected {want:,}{hint}")
    for stage in (4, -1):
        _expects_valueerror(fn, (GB, 4, stage, *MIXED), f"ZeRO has stages 0-3, not {stage}")
    stage3 = math.floor(_fits(32 * GB, 64, 3, *MIXED)) / GB
    return (
        f"right for {len(_CASES)} memories, world sizes, stages and precisions (32 GB on 64 "
        f"ranks holds {stage3:g}B parameters at stage 3 in mixed precision), and ValueError "
        "for stage 4"
    )


# --------------------------------------------------------------------------- 2. a stage-3 linear

_OUT, _IN, _ROWS, _WORLD = 4, 5, 2, 3  # 20 weights, padded to 21 on 3 ranks: shards of 7


def _full_weight() -> torch.Tensor:
    return (torch.arange(_OUT * _IN, dtype=torch.float64).view(_OUT, _IN) - 9.5) / 10


def _rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows x and the weights of its loss, sum(y * g): different on every rank."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(_ROWS, _IN, generator=g, dtype=torch.float64)
    upstream = torch.randn(_ROWS, _OUT, generator=g, dtype=torch.float64)
    return x, upstream


# the names a collective goes by in torch.distributed, and the kind it is
_COLLECTIVE_NAMES = {
    "all_gather_single": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "all_gather": "all-gather",
    "reduce_scatter_single": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
}


def _counting(dist, counts: dict, phase: list) -> dict:
    """Wrap torch.distributed's collectives so that each call is counted, by kind and by the
    phase (forward or backward) it ran in; returns the originals to put back."""
    originals = {}
    for name, kind in _COLLECTIVE_NAMES.items():
        original = getattr(dist, name, None)
        if original is None:
            continue
        originals[name] = original

        def counted(*args, _original=original, _kind=kind, **kwargs):
            counts[phase[0], _kind] = counts.get((phase[0], _kind), 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return originals


def _fsdp_linear_on_rank(fn: Callable) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    size = -(-_OUT * _IN // world)
    padded = torch.zeros(size * world, dtype=torch.float64)
    padded[: _OUT * _IN] = _full_weight().reshape(-1)
    shard = padded[rank * size : (rank + 1) * size].clone().requires_grad_()
    x, upstream = _rank_inputs(rank)
    x.requires_grad_()
    counts: dict = {}
    phase = ["forward"]
    saved: list[tuple[int, ...]] = []  # the shapes autograd keeps for backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    originals = _counting(dist, counts, phase)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(x, shard, _OUT, _IN, dist.group.WORLD)
        if not isinstance(y, torch.Tensor):
            return {"type": type(y).__name__}
        out = {"y": y.detach().clone(), "connected": y.requires_grad}
        phase[0] = "backward"
        if y.requires_grad and y.shape == upstream.shape:
            (y * upstream).sum().backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    out["x_grad"] = None if x.grad is None else x.grad.clone()
    out["shard_grad"] = None if shard.grad is None else shard.grad.clone()
    out["counts"], out["saved"] = counts, saved
    return out


def _size_hint(message: str) -> str:
    """What a shape error in a stage-3 linear usually means: the padding left out."""
    n, s = _OUT * _IN, -(-_OUT * _IN // _WORLD)
    if "is invalid for input of size" in message:
        return (
            f". W has out_features x in_features = {n} elements, but the gathered buffer has "
            f"N x S = {_WORLD * s} (the shards carry the padding): view only its first {n} "
            "elements as (out_features, in_features)"
        )
    if "Check failed" in message or "size" in message:
        return (
            f". A collective's buffers must be N x S = {_WORLD * s} elements for shards of "
            f"S = {s}, padding included: pad W's flat gradient with zeros to {_WORLD * s} "
            "before the reduce-scatter, and gather into a buffer of that size"
        )
    return ""


def _shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = -(-full.numel() // world)
    padded = torch.zeros(size * world, dtype=full.dtype)
    padded[: full.numel()] = full.reshape(-1)
    return padded[rank * size : (rank + 1) * size]


@checker(
    "fsdp_linear",
    writes=(
        "torch.distributed.nn.functional.all_gather",
        "torch.distributed.nn.functional.reduce_scatter",
        "torch.distributed.fsdp.fully_shard",
        "dmlbook.advanced.zero.stages.zero_data_parallel",
    ),
)
def check_fsdp_linear(fn: Callable) -> str:
    """Check ``fn(x, weight_shard, out_features, in_features, group)`` on 3 ranks: ``y = x W^T``
    with W gathered from every rank's flat shard; backward gives ``x`` its gradient and the shard
    this rank's part of W's gradient averaged over the ranks (each rank had its own rows)."""
    call = f"your fsdp_linear(x of shape ({_ROWS}, {_IN}), weight_shard, {_OUT}, {_IN}, group)"
    try:
        with learner_code(f"{call} on {_WORLD} ranks"):
            ranks = run_answer(_fsdp_linear_on_rank, _WORLD, fn)
    except ExerciseFailed as failed:
        hint = "" if "called the library instead" in str(failed) else _size_hint(str(failed))
        if not hint:
            raise
        raise ExerciseFailed(f"{failed}{hint}") from failed.__cause__
    W = _full_weight()
    local_grads = []
    for rank in range(_WORLD):
        x, upstream = _rank_inputs(rank)
        local_grads.append(upstream.T @ x)  # (out, in): this rank's gradient of W
    mean_grad = sum(local_grads) / _WORLD
    for rank, r in enumerate(ranks):
        where = f"{call} on rank {rank}"
        if "type" in r:
            raise ExerciseFailed(f"{where} returned {r['type']}, not a tensor")
        x, upstream = _rank_inputs(rank)
        want_y = x @ W.T
        if r["y"].shape != want_y.shape or not torch.allclose(r["y"], want_y, atol=1e-12):
            hint = (
                "the gathered weight is the first out_features * in_features elements of the "
                "padded buffer (every rank's shard, in rank order), viewed as (out_features, "
                "in_features) as nn.Linear stores it; y = x @ W.T"
            )
            raise ExerciseFailed(f"{where} returned\n{r['y']}\nexpected\n{want_y}: {hint}")
        if not r["connected"] or r["shard_grad"] is None:
            raise ExerciseFailed(
                f"{where}: no gradient reached weight_shard. A gather with dist's collectives is "
                "outside autograd: write a torch.autograd.Function whose backward returns the "
                "shard's gradient (and x's)"
            )
        if r["x_grad"] is None or not torch.allclose(r["x_grad"], upstream @ W, atol=1e-12):
            raise ExerciseFailed(
                f"{where}: x's gradient was\n{r['x_grad']}\nexpected grad_y @ W\n{upstream @ W}"
                " (backward needs the whole W again: gather it)"
            )
        got = r["shard_grad"]
        want = _shard_of(mean_grad, rank, _WORLD)
        if got.shape == want.shape and torch.allclose(got, want, atol=1e-12):
            _check_stage3_traffic(where, r["counts"], r["saved"])
            continue
        mine = _shard_of(local_grads[rank], rank, _WORLD)
        if got.shape != want.shape:
            hint = (
                f"shape {tuple(got.shape)}, not the shard's {tuple(want.shape)}: return the "
                "gradient of weight_shard only (reduce-scatter the padded flat gradient)"
            )
        elif torch.allclose(got, mine, atol=1e-12):
            hint = (
                "that is your own rank's gradient of your shard. Each rank trained on its own "
                "rows, so the shard's gradient is the average over the ranks: reduce-scatter "
                "W's padded flat gradient (ReduceOp.AVG)"
            )
        elif torch.allclose(got, _WORLD * want, atol=1e-12):
            hint = f"that is the sum over the {_WORLD} ranks; data parallelism averages"
        elif any(
            torch.allclose(got, _shard_of(mean_grad, k, _WORLD), atol=1e-12) for k in range(_WORLD)
        ):
            hint = "that is another rank's shard of the averaged gradient: keep your own"
        else:
            hint = "expected your shard of W's gradient, averaged over the ranks"
        raise ExerciseFailed(
            f"{where}: weight_shard's gradient was\n{got}\nexpected\n{want}: {hint}"
        )
    return f"forward, x's gradient and the shard's averaged gradient right on {_WORLD} ranks"


def _check_stage3_traffic(where: str, counts: dict, saved: list[tuple[int, ...]]) -> None:
    """Right numbers, but is it stage 3? No full weight kept for backward, a second gather in
    backward, and a reduce-scatter rather than an all-reduce."""
    if any(counts.get((phase, "all-reduce"), 0) for phase in ("forward", "backward")):
        raise ExerciseFailed(
            f"{where}: the numbers are right, but you all-reduced the weight's gradient and kept "
            "your chunk. A ring all-reduce sends 2(N-1)/N of the tensor from each rank, twice "
            "what a reduce-scatter sends, and leaves every rank the whole gradient it then "
            "throws away: reduce-scatter it (ReduceOp.AVG) straight into your shard"
        )
    whole = [shape for shape in saved if math.prod(shape) >= _OUT * _IN]
    if whole:
        raise ExerciseFailed(
            f"{where}: the numbers are right, but autograd kept a tensor of shape {whole[0]} for "
            "backward: the whole weight (or its padded buffer). Stage 3 keeps only its shard "
            "between forward and backward, so that no rank holds the whole layer while other "
            "layers run: save x and weight_shard (ctx.save_for_backward), and gather W again "
            "in backward"
        )
    if not counts.get(("backward", "all-gather"), 0):
        raise ExerciseFailed(
            f"{where}: the numbers are right, but backward gathered nothing, so the whole W was "
            "kept from forward (on ctx, or in a closure). Stage 3 frees it after forward and "
            "all-gathers it again in backward, where grad_y @ W needs it"
        )
    if not counts.get(("backward", "reduce-scatter"), 0):
        raise ExerciseFailed(
            f"{where}: the numbers are right, but backward called no reduce-scatter: sum W's "
            "padded flat gradient over the ranks with one, each rank keeping its shard"
        )


# --------------------------------------------------------------------------- 3. comm bytes


def _comm(psi: int, n: int, stage: int, p: int, g: int) -> float:
    ring = (n - 1) / n  # a reduce-scatter or an all-gather sends (N-1)/N of its tensor
    if stage == 0:
        return 2 * ring * g * psi  # all-reduce of the gradients
    if stage in (1, 2):
        return ring * (g + p) * psi  # reduce-scatter the gradients, all-gather the parameters
    return ring * (g + 2 * p) * psi  # and the parameters gathered twice: forward, backward


# gradients and parameters of different sizes first, so that each wrong answer differs
_COMM_CASES = [(10**9, 8, s, 2, 4) for s in range(4)] + [
    (7_500_000_000, 64, s, 2, 2) for s in range(4)
] + [(1000, 3, 1, 4, 4), (1000, 3, 3, 4, 4), (153, 1, 3, 2, 2), (12_345, 5, 2, 4, 2)]  # fmt: skip


@checker("comm_bytes", writes=("dmlbook.advanced.zero.accounting.comm_bytes_per_step",))
def check_comm_bytes(fn: Callable[..., float]) -> str:
    """Check ``fn(psi, world_size, stage, param_bytes, grad_bytes)``: the bytes one rank sends
    per step over ring collectives, gradients moving at ``grad_bytes`` and parameters at
    ``param_bytes`` per element."""
    for psi, n, stage, p, g in _COMM_CASES:
        call = (
            f"your comm_bytes(psi={psi}, world_size={n}, stage={stage}, param_bytes={p}, "
            f"grad_bytes={g})"
        )
        with learner_code(call):
            got = float(fn(psi, n, stage, p, g))
        want = _comm(psi, n, stage, p, g)
        if _close(got, want):
            continue
        ring = (n - 1) / n
        wrong = {
            "stage 3 with one all-gather: stage 3 gathers each unit twice, before its forward "
            "and again before its backward, and reduce-scatters once": ring * (g + p) * psi,
            "without the ring's (N-1)/N: each rank sends N-1 of the N chunks": want / ring
            if ring
            else -1.0,
            "stage 0 without the all-reduce's factor 2: a ring all-reduce is a reduce-scatter "
            "then an all-gather, 2(N-1)/N of the tensor": (ring * g * psi if stage == 0 else -1.0),
            "in elements, not bytes": (3 if stage == 3 else 2) * ring * psi,
            "the all-gather moving gradients: it moves the updated parameters "
            "(param_bytes), the reduce-scatter the gradients (grad_bytes)": (
                2 * ring * g * psi if stage in (1, 2) else ring * 3 * g * psi
            ),
            "the all-reduce moving parameters: stage 0 all-reduces the gradients (grad_bytes)": (
                2 * ring * p * psi
            ),
            "one collective too few: stages 1 and 2 reduce-scatter the gradients AND all-gather "
            "the parameters": ring * g * psi,
        }
        hint = next(
            (f": that is {why}" for why, value in wrong.items() if value and _close(got, value)),
            ". A ring all-reduce sends 2(N-1)/N of the tensor; reduce-scatter and all-gather "
            "(N-1)/N each; gradients at grad_bytes, parameters at param_bytes",
        )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g}{hint}")
    return f"right for {len(_COMM_CASES)} models, world sizes, stages and precisions"
