"""``python -m dmlbook.bench allreduce``: chapter 2's all-reduce algorithms against torch's.

Every algorithm of :func:`dmlbook.comm.collectives.all_reduce` and ``torch.distributed``'s
``all_reduce`` (gloo, or NCCL on GPUs), timed at each message size. Chapter 2 fits the alpha-beta
model of :mod:`dmlbook.comm.costmodel` to what :func:`time_all_reduces` measures.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dmlbook.bench.common import write_json
from dmlbook.comm import collectives
from dmlbook.comm.groups import balanced_blocks, device
from dmlbook.launch import run
from dmlbook.runtime import gloo_thread

_UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6}


def parse_size(text: str) -> int:
    """'64KiB' -> 65536, '1MiB' -> 1048576, '1000' -> 1000 (bytes)."""
    t = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit) and t[: -len(unit)].strip():
            return int(float(t[: -len(unit)]) * _UNITS[unit])
    return int(t)


# Sizes below this are timed SMALL_FACTOR times as often (a 64 KiB all-reduce takes a fraction
# of a millisecond, and one scheduling hiccup on a shared 2-core machine takes several).
MANY_REPEATS_BELOW = 4 << 20
SMALL_FACTOR = 4


def repeats_for(nbytes: int, repeats: int) -> int:
    """Timed runs of each contender at ``nbytes``: ``repeats``, more below MANY_REPEATS_BELOW."""
    return repeats * SMALL_FACTOR if nbytes < MANY_REPEATS_BELOW else repeats


def bare_ring(chunks: list[torch.Tensor], scratch: list[torch.Tensor]) -> None:
    """The ring all-reduce's messages and nothing else: ``torch.distributed``'s isend and irecv
    on views made in advance (``chunks`` of the tensor, ``scratch`` of a buffer alike, one per
    rank), one message per chunk and step, no slices, no checks, no trace. What a ring written
    in Python over point-to-point pays at the least; the bench shows it beside ours.

    Reduce-scatter, step s: send chunk (r - s - 1) to the right, add chunk (r - s - 2) from the
    left; all-gather, step s: send chunk (r - s), receive chunk (r - s - 1) in place."""
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    sends = []
    for s in range(p - 1):
        into = (r - s - 2) % p
        arriving = dist.irecv(scratch[into], left, tag=s)
        sends.append(dist.isend(chunks[(r - s - 1) % p], right, tag=s))
        arriving.wait()
        chunks[into].add_(scratch[into])
    for s in range(p - 1):
        arriving = dist.irecv(chunks[(r - s - 1) % p], left, tag=p - 1 + s)
        sends.append(dist.isend(chunks[(r - s) % p], right, tag=p - 1 + s))
        arriving.wait()
    for work in sends:
        work.wait()


def time_all_reduces(
    sizes: list[int],
    repeats: int,
    warmup: int,
    check: bool,
    bare: bool = False,
    summary=statistics.median,
) -> list[dict]:
    """On every rank: for each size, time each algorithm and torch's all_reduce, interleaved
    repeat by repeat. Every run starts after a barrier; the slowest rank's time is the run's.
    ``bare`` adds :func:`bare_ring` ("bare ring"), the ring's messages alone. Per size, a dict
    of ``summary(runs)`` per contender (the median by default; ``None``: the runs themselves).

    The order of the contenders turns by one every repeat, so that none always runs first (or
    always after the same neighbour). Below :data:`MANY_REPEATS_BELOW` a run costs little and
    the machine's noise a lot: those sizes get :data:`SMALL_FACTOR` times the repeats."""
    dev = device()
    # On the CPU, chapter 4's shared-memory transport, and one core's copy of the same bytes:
    # what memory alone allows, a ceiling for any transport between ranks on one host.
    extra = ["shm", "memcpy"] if dev.type == "cpu" else []
    contenders = [*collectives.ALGORITHMS, "auto", *(["bare ring"] if bare else []), *extra]
    contenders.append("torch")
    records = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
        copy = torch.empty_like(tensor)
        if bare:  # the bare ring's views, made once per size, outside the timings
            blocks = balanced_blocks(tensor.numel(), dist.get_world_size())
            chunks = [tensor[a:b] for a, b in blocks]
            scratch = [copy[a:b] for a, b in blocks]
        times = {name: [] for name in contenders}
        for i in range(warmup + repeats_for(nbytes, repeats)):
            turn = i % len(contenders)
            for name in contenders[turn:] + contenders[:turn]:
                dist.barrier()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if name == "torch":
                    dist.all_reduce(tensor)
                elif name == "memcpy":
                    copy.copy_(tensor)
                elif name == "bare ring":
                    bare_ring(chunks, scratch)
                else:
                    collectives.all_reduce(tensor, algorithm=name, check=check)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if i >= warmup:
                    times[name].append(elapsed.item())
                tensor.fill_(1.0)  # keep the values bounded across repeats
        records.append({name: summary(t) if summary else t for name, t in times.items()})
    return records


def bench_allreduce(
    world_size: int = 2,
    sizes: tuple[int, ...] = (64 << 10, 1 << 20, 16 << 20, 64 << 20),
    repeats: int = 15,
    warmup: int = 3,
    check: bool = False,
    json_path: str | None = None,
) -> list[dict]:
    """Median time of each dmlbook all-reduce algorithm against torch's, at each message size.

    ``busbw_GBps`` follows nccl-tests: bytes x 2(p-1)/p / time, the rate each rank's link moved.
    The shape check (in the ring's first message; a message of its own for the others) is off
    unless ``check``; torch's all_reduce has none. The rows include ``bare ring``
    (:func:`bare_ring`: the ring's messages with nothing around them) and, on the CPU, ``shm``
    (:mod:`dmlbook.comm.shm`) and ``memcpy``, one core copying the same bytes (its "busbw" is
    simply bytes / time).
    """
    measured = run(
        time_all_reduces, world_size, list(sizes), repeats, warmup, check, True, timeout=600
    )[0]
    records = []
    # gloo's transport threads, as ranks launched the same way find them (DMLBOOK_GLOO_LOOP)
    policies = set(run(gloo_thread.current_policy, world_size))
    loop = policies.pop() if len(policies) == 1 else "mixed"  # None: no gloo thread (NCCL)
    print(
        f"all_reduce, float32, world size {world_size}, median of {repeats} runs "
        f"({repeats * SMALL_FACTOR} below {_human(MANY_REPEATS_BELOW)}; slowest rank; "
        f"contenders interleaved), baseline torch.distributed.all_reduce; "
        f"gloo's transport threads {loop or 'none'} ({gloo_thread.ENV})"
    )
    print(
        f"{'algorithm':>20s} {'bytes':>10s} {'median':>10s} {'torch':>10s} {'ratio':>6s} "
        f"{'busbw GB/s':>10s}"
    )
    for nbytes, times in zip(sizes, measured, strict=True):
        for algorithm in [name for name in times if name != "torch"]:
            median_s, baseline = times[algorithm], times["torch"]
            factor = 1 if algorithm == "memcpy" else 2 * (world_size - 1) / world_size
            busbw = nbytes * factor / median_s / 1e9
            records.append(
                {
                    "algorithm": algorithm,
                    "world_size": world_size,
                    "bytes": nbytes,
                    "median_s": median_s,
                    "baseline_median_s": baseline,
                    "ratio": median_s / baseline,
                    "busbw_GBps": busbw,
                    "gloo_loop": loop,
                }
            )
            print(
                f"{algorithm:>20s} {_human(nbytes):>10s} {1e3 * median_s:8.3f}ms "
                f"{1e3 * baseline:8.3f}ms {median_s / baseline:5.2f}x {busbw:10.2f}"
            )
    write_json(records, json_path)
    return records


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"
