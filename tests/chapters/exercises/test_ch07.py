"""Chapter 7's exercise checkers: right answers pass; planted bugs (greedy filling, cut positions
instead of counts, empty stages, no ValueError, brute force too slow for 60 layers on 8 stages; no
overlap, no fill, every stage as slow as the slowest, mean stage, one slowest-stage time too many,
one micro-batch's samples, a layer's cost or the largest layer's as the stage's, seconds,
micro-batches per second, and hints that never state the formula; first-stage ticks, end instead
of end - 1, off by one either way, per micro-batch, requests padded to their own micro-batches,
the first sample's micro-batch, requests placed as if alone) are caught with a message that says
so; an answer that calls the
library is told to write the mechanism (``DELEGATING_ANSWERS``, run by
``test_back_doors.py``)."""

import functools
import itertools

import pytest

from dmlbook.exercises import ExerciseFailed, ch07
from dmlbook.model_parallel import pipeline_serving
from dmlbook.model_parallel import stage_balancing as sb


def unanswered(*args):
    raise NotImplementedError


# ---- 1. linear partition -----------------------------------------------------------------------


def partition(costs, stages):
    """A memoised recursion: the first stage takes layers[:k], the rest is the same problem."""
    if not 1 <= stages <= len(costs):
        raise ValueError(f"cannot split {len(costs)} layers into {stages} stages")

    @functools.cache
    def best(start, stages_left):  # -> (bottleneck, counts) for costs[start:]
        if stages_left == 1:
            return sum(costs[start:]), (len(costs) - start,)
        options = []
        for k in range(1, len(costs) - start - stages_left + 2):
            rest, counts = best(start + k, stages_left - 1)
            options.append((max(sum(costs[start : start + k]), rest), (k, *counts)))
        return min(options)

    return list(best(0, stages)[1])


def partition_greedy(costs, stages):
    if stages > len(costs):
        raise ValueError("too many stages")
    target, counts, load = sum(costs) / stages, [0], 0.0
    for i, cost in enumerate(costs):
        to_open = stages - len(counts)
        if counts[-1] and to_open and (load + cost > target or len(costs) - i == to_open):
            counts.append(0)
            load = 0.0
        counts[-1] += 1
        load += cost
    return counts


def partition_cut_positions(costs, stages):
    return list(itertools.accumulate(partition(costs, stages)))


def partition_allowing_empty_stages(costs, stages):
    best = min(
        (
            (max(sb.stage_costs(costs, [c for c in counts if c]) or [0]), counts)
            for cuts in itertools.combinations_with_replacement(range(len(costs) + 1), stages - 1)
            for counts in [[b - a for a, b in itertools.pairwise((0, *cuts, len(costs)))]]
        ),
    )
    return best[1]


def partition_without_valueerror(costs, stages):
    return partition(costs, min(stages, len(costs))) + [0] * max(0, stages - len(costs))


def partition_brute_force(costs, stages):
    """Every way to cut: C(n - 1, P - 1) of them, too many for 60 layers on 8 stages."""
    if not 1 <= stages <= len(costs):
        raise ValueError(f"cannot split {len(costs)} layers into {stages} stages")
    splits = (
        [b - a for a, b in itertools.pairwise((0, *cuts, len(costs)))]
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    return min(splits, key=lambda counts: max(sb.stage_costs(costs, counts)))


def test_linear_partition_passes_right_answers():
    assert ch07.check_linear_partition(partition).status == "passed"


def test_linear_partition_stops_brute_force_and_names_the_cost(monkeypatch):
    monkeypatch.setattr(ch07, "TIME_LIMIT_S", 2.0)
    with pytest.raises(ExerciseFailed, match=r"still running after 2 s\. There are C\(59, 7\)"):
        ch07.check_linear_partition(partition_brute_force)


@pytest.mark.parametrize(
    "answer, message",
    [
        (partition_greedy, "greedy filling up to total / stages"),
        (partition_cut_positions, "cut positions"),
        (partition_allowing_empty_stages, "at least one layer"),
        (partition_without_valueerror, r"instead of raising ValueError"),
    ],
)
def test_linear_partition_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch07.check_linear_partition(answer)


# ---- 2. pipeline throughput ------------------------------------------------------------------


def stage_sums(costs, counts):
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start : start + c]))
        start += c
    return out


def throughput(costs, counts, microbatches, size):
    per_stage = stage_sums(costs, counts)
    return microbatches * size / (sum(per_stage) + (microbatches - 1) * max(per_stage))


def throughput_no_overlap(costs, counts, microbatches, size):
    return size / sum(costs)


def throughput_steady_state(costs, counts, microbatches, size):
    return size / max(stage_sums(costs, counts))


def throughput_balanced_formula(costs, counts, microbatches, size):
    per_stage = stage_sums(costs, counts)
    return microbatches * size / ((microbatches + len(counts) - 1) * max(per_stage))


def throughput_mean_stage(costs, counts, microbatches, size):
    per_stage = stage_sums(costs, counts)
    mean = sum(per_stage) / len(per_stage)
    return microbatches * size / (sum(per_stage) + (microbatches - 1) * mean)


def throughput_in_seconds(costs, counts, microbatches, size):
    return 1 / throughput(costs, counts, microbatches, size)


def throughput_per_microbatch(costs, counts, microbatches, size):
    return throughput(costs, counts, microbatches, size) / size


def throughput_one_slowest_too_many(costs, counts, microbatches, size):
    per_stage = stage_sums(costs, counts)
    return microbatches * size / (sum(per_stage) + microbatches * max(per_stage))


def throughput_one_microbatch_of_samples(costs, counts, microbatches, size):
    return throughput(costs, counts, microbatches, size) / microbatches


def throughput_layer_as_stage(costs, counts, microbatches, size):
    per_stage = list(costs[: len(counts)])
    return microbatches * size / (sum(per_stage) + (microbatches - 1) * max(per_stage))


def throughput_largest_layer(costs, counts, microbatches, size):
    per_stage, start = [], 0
    for c in counts:
        per_stage.append(max(costs[start : start + c]))
        start += c
    return microbatches * size / (sum(per_stage) + (microbatches - 1) * max(per_stage))


def throughput_unrecognised(costs, counts, microbatches, size):
    return 1.5 * throughput(costs, counts, microbatches, size)


def test_pipeline_throughput_hints_do_not_state_the_formula():
    for answer in (throughput_unrecognised, throughput_balanced_formula, throughput_steady_state):
        with pytest.raises(ExerciseFailed) as failed:
            ch07.check_pipeline_throughput(answer)
        assert "M - 1" not in str(failed.value) and "sum +" not in str(failed.value)


def test_pipeline_throughput_passes_the_right_answer():
    assert ch07.check_pipeline_throughput(throughput).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (throughput_no_overlap, "no overlap"),
        (throughput_steady_state, "forgets the fill"),
        (throughput_balanced_formula, "as if every stage cost as much as the slowest"),
        (throughput_mean_stage, "paced by the mean stage"),
        (throughput_one_slowest_too_many, "one slowest-stage time too many"),
        (throughput_one_microbatch_of_samples, "the samples of one micro-batch"),
        (throughput_layer_as_stage, r"taken as layer_costs\[s\]"),
        (throughput_largest_layer, "taken as its largest layer"),
        (throughput_unrecognised, "Draw this case on a time axis"),
        (throughput_in_seconds, "return samples per second"),
        (throughput_per_microbatch, "each carries microbatch_size samples"),
    ],
)
def test_pipeline_throughput_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch07.check_pipeline_throughput(answer)


# ---- 3. completion ticks -------------------------------------------------------------------


def completion_ticks(sizes, microbatch_size, stages):
    ticks, end = [], 0
    for size in sizes:
        end += size
        last_microbatch = (end - 1) // microbatch_size
        ticks.append(last_microbatch + stages)
    return ticks


def ticks_first_stage(sizes, microbatch_size, stages):
    return completion_ticks(sizes, microbatch_size, 1)


def ticks_end_not_last_sample(sizes, microbatch_size, stages):
    return [e // microbatch_size + stages for e in itertools.accumulate(sizes)]


def ticks_off_by_one(sizes, microbatch_size, stages):
    return [t + 1 for t in completion_ticks(sizes, microbatch_size, stages)]


def ticks_from_zero(sizes, microbatch_size, stages):
    return [t - 1 for t in completion_ticks(sizes, microbatch_size, stages)]


def ticks_per_microbatch(sizes, microbatch_size, stages):
    n = -(-sum(sizes) // microbatch_size)
    return [k + stages for k in range(n)]


def ticks_padded(sizes, microbatch_size, stages):
    ticks, used = [], 0
    for n in sizes:
        used += -(-n // microbatch_size)
        ticks.append(used - 1 + stages)
    return ticks


def ticks_first_sample(sizes, microbatch_size, stages):
    starts = [e - n for e, n in zip(itertools.accumulate(sizes), sizes, strict=True)]
    return [s // microbatch_size + stages for s in starts]


def ticks_alone(sizes, microbatch_size, stages):
    return [(n - 1) // microbatch_size + stages for n in sizes]


def test_completion_ticks_passes_the_right_answer():
    assert ch07.check_completion_ticks(completion_ticks).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (ticks_first_stage, "FIRST stage"),
        (ticks_end_not_last_sample, "end - 1, not end"),
        (ticks_off_by_one, "off by one tick"),
        (ticks_from_zero, "ticks count from 1"),
        (ticks_per_microbatch, "one tick per request"),
        (ticks_padded, "in a micro-batch of its own"),
        (ticks_first_sample, "FIRST sample"),
        (ticks_alone, "as if it were alone"),
    ],
)
def test_completion_ticks_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch07.check_completion_ticks(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch07.check_linear_partition(unanswered).status == "not attempted"
    assert ch07.check_pipeline_throughput(unanswered).status == "not attempted"
    assert ch07.check_completion_ticks(unanswered).status == "not attempted"


DELEGATING_ANSWERS = {
    "linear_partition": lambda costs, stages: sb.linear_partition(costs, stages),
    "pipeline_throughput": lambda costs, counts, microbatches, size: (
        microbatches * size / sb.pipeline_time(sb.stage_costs(costs, counts), microbatches)
    ),
    "completion_ticks": lambda sizes, size, stages: pipeline_serving.completion_ticks(
        sizes, size, stages
    ),
}


def test_bisection_is_switched_off_too():
    with pytest.raises(ExerciseFailed, match="called the library instead"):
        ch07.check_linear_partition(lambda costs, stages: sb.partition_by_bisection(costs, stages))


def test_a_pipeline_paced_by_its_first_stage_is_rejected():
    """The pace is the slowest stage's, wherever it sits (a learner's read: stage 0 paced every
    case with M > 1 before the middle stage was the bottleneck in one)."""

    def paced_by_stage_0(layer_costs, counts, microbatches, microbatch_size):
        stages, start = [], 0
        for n in counts:
            stages.append(sum(layer_costs[start : start + n]))
            start += n
        return microbatches * microbatch_size / (sum(stages) + (microbatches - 1) * stages[0])

    with pytest.raises(ExerciseFailed):
        ch07.check_pipeline_throughput(paced_by_stage_0)
