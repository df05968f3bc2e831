"""``python -m dmlbook.bench tp-check``: what the shape check of tensor and sequence parallelism
costs a training step (chapters 9 and 13).

Every collective of :mod:`dmlbook.advanced.tensor_parallel.comm`, forward and backward, first
checks that every rank brought the same shape and dtype, so that mismatched inputs are one
ValueError on every rank instead of a gloo abort. Here one TP + SP char-GPT
(:func:`~dmlbook.advanced.tensor_parallel.sequence_parallel.sequence_parallel_char_gpt`) runs
forward and backward with the checks and without them, alternating step by step in the same
run, and the slowest rank's step time is reported per way: median, 10th-90th percentile, and the
difference per step and per checked collective. A measurement, never an assertion.

"Without" is the same code with the module's collectives called with ``check=False`` and the
reduce-scatter's whole-shape check skipped, patched in for the timed step only: a switch for this
measurement, not an option a learner should use.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

from dmlbook.bench.common import load_average, write_json
from dmlbook.launch import run

__all__ = ["bench_tp_check"]

# a char-GPT of chapter 13's size, and one 4x wider on a 4x longer sequence (sizes that divide
# by 2 and 3 ranks)
MODELS = {
    "small (C=48, T=24, B=4)": (dict(n_layer=2, n_head=6, n_embd=48, block_size=24), 4),
    "wider (C=192, T=96, B=8)": (dict(n_layer=2, n_head=6, n_embd=192, block_size=96), 8),
}
VOCAB = 96


@contextmanager
def unchecked(calls: list[int]) -> Iterator[None]:
    """The tensor-parallel module's collectives with ``check=False``, its reduce-scatter's
    whole-shape check skipped; ``calls[0]`` counts the collectives that ran unchecked."""
    from dmlbook.advanced.tensor_parallel import comm as tp_comm
    from dmlbook.comm import collectives

    def off(collective):
        def call(*args, **kwargs):
            calls[0] += 1
            return collective(*args, **{**kwargs, "check": False})

        return functools.update_wrapper(call, collective)

    bare = SimpleNamespace(
        all_reduce=off(collectives.all_reduce),
        all_gather=off(collectives.all_gather),
        reduce_scatter=off(collectives.reduce_scatter),
    )
    with (
        mock.patch.object(tp_comm, "collectives", bare),
        mock.patch.object(tp_comm, "check_same_sequence_split", lambda *args: None),
    ):
        yield


@contextmanager
def _counting_checks() -> Iterator[dict[str, int]]:
    """How each check of a step travels, counted where it is sent: inside a collective's first
    message (``carried``: the ring all-reduce, all-gather and reduce-scatter, recursive
    doubling), in a header round of its own (``header_alone``:
    :meth:`~dmlbook.comm.shapecheck.ShapeCheck.exchange`), or as a whole-shape check, an
    all-gather of its own (``check_same_sequence_split``)."""
    from dmlbook.advanced.tensor_parallel import comm as tp_comm
    from dmlbook.comm.shapecheck import ShapeCheck

    counts = {"carried": 0, "header_alone": 0, "check_same_sequence_split": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    whole = counted("check_same_sequence_split", tp_comm.check_same_sequence_split)
    with (
        mock.patch.object(ShapeCheck, "ring_start", counted("carried", ShapeCheck.ring_start)),
        mock.patch.object(ShapeCheck, "pair_start", counted("carried", ShapeCheck.pair_start)),
        mock.patch.object(ShapeCheck, "exchange", counted("header_alone", ShapeCheck.exchange)),
        mock.patch.object(tp_comm, "check_same_sequence_split", whole),
    ):
        yield counts


def _steps(config: dict, batch: int, repeats: int, warmup: int) -> dict:
    """Rank function: ``warmup + repeats`` pairs of steps, checked and unchecked in turn (which
    goes first alternates); the slowest rank's seconds per step, per way."""
    from dmlbook.advanced import tensor_parallel as tp
    from dmlbook.advanced.tensor_parallel.sequence_parallel import sequence_parallel_char_gpt
    from dmlbook.models import char_gpt

    torch.set_num_threads(1)  # ranks share the cores
    shard = sequence_parallel_char_gpt(char_gpt(VOCAB, seed=0, **config))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (batch, config["block_size"] + 1), generator=g)
    idx, targets = data[:, :-1], data[:, 1:]

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        _, loss = shard(idx, targets)
        loss.backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        shard.zero_grad(set_to_none=True)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        return elapsed.item()

    with tp.counting() as comms, _counting_checks() as checks:
        step()
    calls = [0]
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for i in range(warmup + repeats):
        order = ("checked", "unchecked") if i % 2 else ("unchecked", "checked")
        for way in order:
            with unchecked(calls) if way == "unchecked" else nullcontext():
                seconds = step()
            if i >= warmup:
                times[way].append(seconds)
    if calls[0] != len(comms) * (warmup + repeats):  # the switch reached every collective
        raise RuntimeError(f"{calls[0]} unchecked calls for {len(comms)} collectives a step")
    return {"times": times, "collectives": len(comms), "checks": checks}


def _p10_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return tuple(ordered[round(q * (len(ordered) - 1))] for q in (0.1, 0.9))


def _print(r: dict) -> None:
    def ms(key: str) -> str:
        low, high = r[f"{key}_p10_p90_s"]
        return f"{1e3 * r[f'{key}_median_s']:.2f} ms [{1e3 * low:.2f} to {1e3 * high:.2f}]"

    checks = r["checks_per_step"]
    apart = checks["header_alone"] + checks["check_same_sequence_split"]
    print(
        f"world {r['world_size']}, {r['model']}: {r['collectives_per_step']} collectives a step; "
        f"checks: {checks['carried']} in a collective's first message, {apart} in messages of "
        f"their own ({checks['check_same_sequence_split']} of them whole-shape checks)\n"
        f"  checked {ms('checked')}, fastest {1e3 * r['checked_min_s']:.2f} ms\n"
        f"  unchecked {ms('unchecked')}, fastest {1e3 * r['unchecked_min_s']:.2f} ms\n"
        f"  the check, pair by pair: {ms('extra')}, {100 * r['extra_fraction']:+.1f}% a step"
    )


def bench_tp_check(
    world_sizes: tuple[int, ...] = (2, 3), repeats: int = 60, json_path: str | None = None
) -> list[dict]:
    """A TP + SP step with and without the shape checks, per model and world size."""
    print(f"TP + SP step, forward + backward, with and without the shape check; {load_average()}")
    print(f"slowest rank's step: median [10th to 90th percentile] of {repeats} steps each way")
    records = []
    for world in world_sizes:
        for name, (config, batch) in MODELS.items():
            result = run(_steps, world, config, batch, repeats, 5, timeout=600)[0]
            times = result["times"]
            # steps ran in pairs, one of each way: the pair's difference cancels slow drift
            pairs = [a - b for a, b in zip(times["checked"], times["unchecked"], strict=True)]
            record = dict(
                world_size=world,
                model=name,
                steps=repeats,
                collectives_per_step=result["collectives"],
                checks_per_step=result["checks"],
                **{f"{way}_median_s": statistics.median(t) for way, t in times.items()},
                **{f"{way}_p10_p90_s": _p10_p90(t) for way, t in times.items()},
                **{f"{way}_min_s": min(t) for way, t in times.items()},
                extra_median_s=statistics.median(pairs),
                extra_p10_p90_s=_p10_p90(pairs),
            )
            record["extra_fraction"] = record["extra_median_s"] / record["unchecked_median_s"]
            _print(record)
            records.append(record)
    write_json(records, json_path)
    return records
