"""Checkers for chapter 7's exercises ("Model-parallel training and serving workflows").

1. ``check_linear_partition``: write ``partition(costs, stages) -> counts``, the layers per stage
   (contiguous, at least one each) that make the slowest stage as fast as it can be: the
   linear-partition dynamic program of :mod:`dmlbook.model_parallel.stage_balancing`. One case,
   60 layers on 8 stages, is too big for trying every cut: a call is stopped after
   ``TIME_LIMIT_S`` with a hint that names the number of cuts.
2. ``check_pipeline_throughput``: write ``throughput(layer_costs, counts, microbatches,
   microbatch_size) -> samples per second`` of a forward-only pipeline (serving) whose stage s
   takes the summed cost of its layers per micro-batch, fill included.
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
import math
import random
import signal
import threading
import time
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
    # a real model's size: trying every cut (C(59, 7), about 3.4e8 splits) cannot finish in time
    cases.append(([round(rng.uniform(0, 10), 2) for _ in range(60)], 8))
    return cases


TIME_LIMIT_S = 20.0  # per call; a DP needs well under a second for 60 layers on 8 stages


class _TimeLimit:
    """Stop the learner's call after ``seconds`` with ExerciseFailed(``message``): a SIGALRM in
    the main thread (elsewhere, where signals cannot be set, the call runs to its end)."""

    def __init__(self, seconds: float, message: str) -> None:
        self.seconds, self.message = seconds, message
        self.armed = threading.current_thread() is threading.main_thread() and hasattr(
            signal, "setitimer"
        )

    def _expired(self, signum, frame):
        raise ExerciseFailed(self.message)

    def __enter__(self):
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            # An outer alarm (a test runner's time limit) is put back, less the time spent here.
            self.outer, _ = signal.setitimer(signal.ITIMER_REAL, self.seconds)
            self.started = time.monotonic()
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            if self.outer:
                left = self.outer - (time.monotonic() - self.started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
        return False


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
        call = (
            f"your partition({costs}, {stages})"
            if len(costs) <= 12
            else f"your partition(<{len(costs)} layer costs>, {stages})"
        )
        ways = math.comb(len(costs) - 1, stages - 1)
        too_slow = (
            f"{call} was still running after {TIME_LIMIT_S:g} s. There are C({len(costs) - 1}, "
            f"{stages - 1}) = {ways:.2g} ways to cut {len(costs)} layers into {stages} stages: "
            "trying them all is too slow. Build the answer from smaller problems (the best "
            "bottleneck for the first j layers on s stages), each solved once"
        )
        started = time.perf_counter()
        with _TimeLimit(TIME_LIMIT_S, too_slow), learner_code(call):
            counts = list(fn(list(costs), stages))
        if time.perf_counter() - started > TIME_LIMIT_S:
            raise ExerciseFailed(too_slow)
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
    return (
        f"optimal on all {len(cases)} cost vectors (ties, zeros, stages = 1 and = layers, "
        "60 layers on 8 stages)"
    )


# --------------------------------------------------------------------------- 2. throughput


def _throughput_cases() -> list[tuple[list[float], list[int], int, int]]:
    return [
        ([0.004, 0.001, 0.001, 0.001, 0.001], [1, 4], 8, 16),  # balanced by cost, not by count
        ([0.004, 0.001, 0.001, 0.001, 0.001], [3, 2], 8, 16),  # uneven: stage 0 is the bottleneck
        ([0.002, 0.003, 0.001], [1, 1, 1], 1, 32),  # one micro-batch: no overlap at all
        ([0.002, 0.003, 0.001, 0.005], [2, 1, 1], 50, 4),
        ([0.01], [1], 4, 8),  # one stage
        ([0.001, 0.003, 0.001], [1, 1, 1], 4, 8),  # the middle stage is the bottleneck
    ]


def _time_with(per_stage: Sequence[float], microbatches: int) -> float:
    """The checker's own forward-only pipeline, simulated micro-batch by micro-batch: each
    starts on a stage when the stage is free and the micro-batch has left the stage before."""
    free = [0.0] * len(per_stage)
    for _ in range(microbatches):
        ready = 0.0
        for s, cost in enumerate(per_stage):
            ready = free[s] = max(free[s], ready) + cost
    return free[-1]


def _throughput_mistakes(
    costs: Sequence[float], counts: Sequence[int], microbatches: int, size: int
) -> dict[str, float | None]:
    """What common slips return on one case, keyed by the cause a learner should look at."""
    per_stage = stage_balancing.stage_costs(costs, counts)
    stages, slowest, total = len(per_stage), max(per_stage), sum(per_stage)
    samples = microbatches * size
    want = samples / _time_with(per_stage, microbatches)
    first_layers = list(costs[:stages])  # a layer's cost taken as its stage's
    largest_layer = []  # a stage's largest layer taken as its cost
    start = 0
    for count in counts:
        largest_layer.append(max(costs[start : start + count]))
        start += count
    return {
        "no overlap: each micro-batch crosses every stage before the next one enters. In a "
        "pipeline the next micro-batch enters stage 0 as soon as stage 0 is free": (
            samples / (microbatches * total)
        ),
        "the steady state alone: it forgets the fill, the time micro-batch 0 takes to reach "
        "the end of the pipeline before anything leaves it": size / slowest,
        "as if every stage cost as much as the slowest one: true only for balanced stages. "
        "Micro-batch 0 crosses the stages as they are": (
            samples / ((microbatches + stages - 1) * slowest)
        ),
        "paced by the mean stage; the stage that holds the later micro-batches up longest sets "
        "their pace": samples / (total + (microbatches - 1) * total / stages),
        "one slowest-stage time too many: micro-batch 0's trip through the stages already "
        "includes its own pass through the slowest one": (
            samples / (total + microbatches * slowest)
        ),
        "the samples of one micro-batch; M micro-batches carry M x microbatch_size samples": (
            want / microbatches
        ),
        "a time in seconds; return samples per second": 1 / want if want else None,
        "micro-batches per second; each carries microbatch_size samples": want / size,
        "stage s's cost taken as layer_costs[s]; stage s holds counts[s] consecutive layers, "
        "and costs their sum": (
            samples / _time_with(first_layers, microbatches) if len(costs) != stages else None
        ),
        "a stage's cost taken as its largest layer; a stage runs all its layers, one after "
        "another: their sum": (
            samples / _time_with(largest_layer, microbatches)
            if largest_layer != per_stage
            else None
        ),
    }


@checker("pipeline_throughput", writes=("dmlbook.model_parallel.stage_balancing.pipeline_time",))
def check_pipeline_throughput(fn: Callable[[list[float], list[int], int, int], float]) -> str:
    """Check ``fn(layer_costs, counts, microbatches, microbatch_size)`` against the checker's
    own simulation of the forward-only pipeline, micro-batch by micro-batch, on several cases;
    a wrong value is matched against common slips to name the cause."""
    cases = _throughput_cases()
    answers = []
    for costs, counts, microbatches, size in cases:
        call = f"your throughput({costs}, {counts}, microbatches={microbatches}, size={size})"
        with learner_code(call):
            answers.append(float(fn(list(costs), list(counts), microbatches, size)))

    def close(got: float, value: float | None) -> bool:
        return value is not None and abs(got - value) <= 1e-6 * abs(value)

    for (costs, counts, microbatches, size), got in zip(cases, answers, strict=True):
        per_stage = stage_balancing.stage_costs(costs, counts)
        want = microbatches * size / _time_with(per_stage, microbatches)
        if close(got, want):
            continue
        # A slip explains the answer only if it gives the learner's value wherever it applies.
        mistakes = [_throughput_mistakes(*case) for case in cases]
        hint = next(
            (
                f": that is {why}"
                for why, value in mistakes[cases.index((costs, counts, microbatches, size))].items()
                if close(got, value)
                and all(
                    m[why] is None or close(answer, m[why])
                    for m, answer in zip(mistakes, answers, strict=True)
                )
            ),
            ". Draw this case on a time axis, one row per stage, one box per micro-batch "
            "(a micro-batch enters a stage when the stage is free and the micro-batch has left "
            "the stage before), and read off when the last micro-batch leaves the last stage",
        )
        call = f"your throughput({costs}, {counts}, microbatches={microbatches}, size={size})"
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
        "you started every request in a micro-batch of its own (padding the one before). The "
        "samples queue back to back: a micro-batch holds the end of one request and the start of "
        "the next": [k - 1 + stages for k in itertools.accumulate(-(-n // size) for n in sizes)],
        "you used the micro-batch of each request's FIRST sample; a request is answered only "
        "when its last sample is out": [
            (e - n) // size + stages for e, n in zip(ends, sizes, strict=True)
        ],
        "you placed every request at the front of the queue, as if it were alone. The requests "
        "before it fill the micro-batches first": [(n - 1) // size + stages for n in sizes],
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
