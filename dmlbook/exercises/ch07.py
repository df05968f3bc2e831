"""Checkers for chapter 7's exercises ("Model-parallel training and serving workflows").

1. ``check_linear_partition``: write ``partition(costs, stages) -> counts``, the layers per stage
   (contiguous, at least one each) that make the slowest stage as fast as it can be: the
   linear-partition dynamic program of :mod:`dmlbook.model_parallel.stage_balancing`.
2. ``check_pipeline_throughput``: write ``throughput(layer_costs, counts, microbatches,
   microbatch_size) -> samples per second`` of a forward-only pipeline (serving) whose stage s
   takes the summed cost of its layers per micro-batch: the first micro-batch crosses every stage,
   each later one leaves one slowest-stage time after the previous.
3. ``check_completion_ticks``: write ``completion_ticks(request_sizes, microbatch_size, stages)``:
   requests queue in order, their samples are cut into micro-batches of ``microbatch_size``
   (the last may be short), micro-batch k is on stage s during tick k + s (one tick per stage),
   and a request is answered when the micro-batch holding its last sample leaves the last stage;
   return each request's tick, counting ticks from 1
   (:func:`dmlbook.model_parallel.pipeline_serving.completion_ticks`).

Each checker switches off, while the learner's code runs, the library functions that do the job
(``writes=``), so an answer that only calls them is told to write the mechanism.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code
from dmlbook.model_parallel import pipeline_serving, stage_balancing

__all__ = ["check_completion_ticks", "check_linear_partition", "check_pipeline_throughput"]


# --------------------------------------------------------------------------- 1. the DP


def _partition_cases() -> list[tuple[list[float], int]]:
    rng = random.Random(7)
    cases = [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
        ([100, 1, 1, 1, 1], 2),  # one heavy layer: it gets a stage to itself
        ([1, 1, 1, 1, 100], 2),
        ([4, 4, 4, 4], 4),  # stages == layers
        ([3, 1, 2], 1),  # one stage takes everything
        ([0, 0, 5, 0, 0], 3),  # zero-cost layers
        ([2, 2, 2, 2, 2, 2], 4),  # ties everywhere
        ([5, 5, 6], 2),  # filling stages up to total / P is not optimal: 5 | 11, not 10 | 6
    ]
    for n in (6, 9, 12):
        cases.append(([round(rng.uniform(0, 10), 2) for _ in range(n)], rng.randint(2, 4)))
    return cases


def _greedy_average(costs: Sequence[float], stages: int) -> list[int]:
    """The tempting wrong answer: start a new stage when the next layer would take this one past
    total / stages (keeping a layer for every stage still to fill)."""
    target, counts, load = sum(costs) / stages, [0], 0.0
    for i, cost in enumerate(costs):
        stages_to_open = stages - len(counts)
        must_open = len(costs) - i == stages_to_open  # one layer left per remaining stage
        if counts[-1] and stages_to_open and (load + cost > target or must_open):
            counts.append(0)
            load = 0.0
        counts[-1] += 1
        load += cost
    return counts


@checker(
    "linear_partition",
    writes=(
        "dmlbook.model_parallel.stage_balancing.linear_partition",
        "dmlbook.model_parallel.stage_balancing.partition_by_bisection",
    ),
)
def check_linear_partition(fn: Callable[[list[float], int], list[int]]) -> str:
    """Check ``fn(costs, stages)`` returns layers per stage, each >= 1, summing to len(costs),
    whose largest stage cost is the smallest possible; and raises ValueError for more stages
    than layers."""
    cases = _partition_cases()
    for costs, stages in cases:
        call = f"your partition({costs}, {stages})"
        with learner_code(call):
            counts = list(fn(list(costs), stages))
        if len(counts) != stages:
            raise ExerciseFailed(f"{call} returned {counts}: one count per stage, {stages} of them")
        if any(c < 1 for c in counts):
            raise ExerciseFailed(
                f"{call} returned {counts}: every stage needs at least one layer (an empty "
                "stage is a rank with nothing to do)"
            )
        if sum(counts) != len(costs):
            hint = ""
            if counts == sorted(counts) and counts[-1] <= len(costs):
                hint = ". Are these cut positions? Return how many layers each stage holds"
            raise ExerciseFailed(
                f"{call} returned {counts}, which sums to {sum(counts)}, not to the "
                f"{len(costs)} layers{hint}"
            )
        got = max(stage_balancing.stage_costs(costs, counts))
        want = max(
            stage_balancing.stage_costs(costs, stage_balancing.linear_partition(costs, stages))
        )
        if got > want + 1e-9:
            hint = ""
            if counts == _greedy_average(costs, stages):
                hint = (
                    ". That is greedy filling up to total / stages, which can strand a heavy "
                    "layer; try every place for the last stage's start (the DP)"
                )
            raise ExerciseFailed(
                f"{call} returned {counts}: its slowest stage costs {got:g}, but a split with "
                f"slowest stage {want:g} exists{hint}"
            )
    expect_value_error(
        "partition([1.0, 2.0], 3)",
        lambda: fn([1.0, 2.0], 3),
        "3 stages cannot each get one of 2 layers",
    )
    return f"optimal on all {len(cases)} cost vectors (ties, zeros, stages = 1 and = layers)"


# --------------------------------------------------------------------------- 2. throughput


def _throughput_cases() -> list[tuple[list[float], list[int], int, int]]:
    return [
        ([0.004, 0.001, 0.001, 0.001, 0.001], [1, 4], 8, 16),  # balanced by cost, not by count
        ([0.004, 0.001, 0.001, 0.001, 0.001], [3, 2], 8, 16),  # uneven: stage 0 is the bottleneck
        ([0.002, 0.003, 0.001], [1, 1, 1], 1, 32),  # one micro-batch: no overlap at all
        ([0.002, 0.003, 0.001, 0.005], [2, 1, 1], 50, 4),
        ([0.01], [1], 4, 8),  # one stage
    ]


@checker("pipeline_throughput", writes=("dmlbook.model_parallel.stage_balancing.pipeline_time",))
def check_pipeline_throughput(fn: Callable[[list[float], list[int], int, int], float]) -> str:
    """Check ``fn(layer_costs, counts, microbatches, microbatch_size)`` is the samples per second
    of a forward-only pipeline of M micro-batches: M * size / (sum + (M - 1) * max) over stages."""
    for costs, counts, microbatches, size in _throughput_cases():
        call = f"your throughput({costs}, {counts}, microbatches={microbatches}, size={size})"
        with learner_code(call):
            got = float(fn(list(costs), list(counts), microbatches, size))
        per_stage = stage_balancing.stage_costs(costs, counts)
        samples = microbatches * size
        want = samples / stage_balancing.pipeline_time(per_stage, microbatches)
        if abs(got - want) <= 1e-6 * want:
            continue
        stages, slowest, total = len(per_stage), max(per_stage), sum(per_stage)
        wrong = {
            "the throughput with no overlap (every micro-batch crosses all stages before the "
            "next starts); in a pipeline the next micro-batch follows one slowest stage later": (
                samples / (microbatches * total)
            ),
            "the steady-state bound size / slowest stage, which forgets the fill: the first "
            "micro-batch needs the sum of ALL stage costs": size / slowest,
            "(M + P - 1) x the slowest stage, which holds only when the stages are balanced; the "
            "first micro-batch needs the sum of the stage costs": (
                samples / ((microbatches + stages - 1) * slowest)
            ),
            "built from the mean stage cost; the slowest stage sets the pace": (
                samples / (total + (microbatches - 1) * total / stages)
            ),
            "a time in seconds; return samples per second": 1 / want if want else None,
            "micro-batches per second; each carries microbatch_size samples": want / size,
        }
        hint = next(
            (
                f": that is {why}"
                for why, value in wrong.items()
                if value and abs(got - value) <= 1e-6 * abs(value)
            ),
            ". Stage s costs the sum of its counts[s] layers; the first micro-batch takes the sum "
            "over stages, each later one the slowest stage's cost",
        )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g} samples/s{hint}")
    return f"throughput right for {len(_throughput_cases())} pipelines (balanced, uneven, M = 1)"


# --------------------------------------------------------------------------- 3. completion ticks


def _tick_cases() -> list[tuple[list[int], int, int]]:
    return [
        ([4, 4, 4, 4], 4, 2),  # one request per micro-batch
        ([3, 5, 2, 6], 4, 2),  # requests straddle micro-batch boundaries
        ([1, 1, 1, 1, 1], 2, 3),  # several requests share a micro-batch
        ([10], 3, 2),  # one request over four micro-batches, the last one short
        ([2, 6, 1], 8, 4),  # everything fits one micro-batch
        ([8, 8], 4, 1),  # one stage: no pipeline fill
    ]


def _tick_mistakes(sizes: Sequence[int], size: int, stages: int) -> dict[str, list[int]]:
    """What common slips give on one case, keyed by the hint that explains them."""
    ends = list(itertools.accumulate(sizes))
    return {
        "you counted when each micro-batch leaves the FIRST stage; it crosses every stage, one "
        "tick each": [(e - 1) // size + 1 for e in ends],
        "a request whose last sample is the last of a micro-batch finishes with THAT "
        "micro-batch. Index the last sample, end - 1, not end": [e // size + stages for e in ends],
        "off by one tick. Micro-batch 0 leaves the last stage at tick P": [
            (e - 1) // size + stages + 1 for e in ends
        ],
        "one tick early: ticks count from 1, so micro-batch 0 leaves the last stage at tick P, "
        "not P - 1": [(e - 1) // size + stages - 1 for e in ends],
    }


@checker("completion_ticks", writes=("dmlbook.model_parallel.pipeline_serving.completion_ticks",))
def check_completion_ticks(fn: Callable[[list[int], int, int], list[int]]) -> str:
    """Check ``fn(request_sizes, microbatch_size, stages)`` gives, for each request, the tick
    (from 1) at which the micro-batch holding its last sample leaves the last stage."""
    answers = []
    for sizes, size, stages in _tick_cases():
        call = f"your completion_ticks({sizes}, microbatch_size={size}, stages={stages})"
        with learner_code(call):
            answers.append([int(t) for t in fn(list(sizes), size, stages)])
    for (sizes, size, stages), got in zip(_tick_cases(), answers, strict=True):
        want = pipeline_serving.completion_ticks(sizes, size, stages)
        if got == want:
            continue
        # A slip explains the answer only if it gives the learner's ticks on EVERY case.
        hint = next(
            (
                f": {why}"
                for why in _tick_mistakes(sizes, size, stages)
                if all(
                    _tick_mistakes(*case)[why] == answer
                    for case, answer in zip(_tick_cases(), answers, strict=True)
                )
            ),
            ": return one tick per request, not per micro-batch" if len(got) != len(sizes) else "",
        )
        call = f"your completion_ticks({sizes}, microbatch_size={size}, stages={stages})"
        raise ExerciseFailed(f"{call} returned {got}, expected {want}{hint}")
    return f"completion ticks right for {len(_tick_cases())} request streams"
