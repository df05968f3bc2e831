"""Chapter 6's exercise checkers: right answers pass; planted bugs (GPipe's order, a warm-up one
too long or too short, no min() for M < P, a B before its F; the busy fraction, per-stage spans,
the mean of per-stage idle fractions, stage 0's span alone, a span from t = 0, no division by
the stage count) are caught with a message that says so."""

import pytest

from dmlbook.exercises import ExerciseFailed, ch06


def unanswered(*args):
    raise NotImplementedError


def order(stage, stages, microbatches):
    warmup = min(stages - stage - 1, microbatches)
    ops = [("F", mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", mb) for mb in range(microbatches - warmup, microbatches)]


def order_gpipe(stage, stages, microbatches):
    return [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]


def _with_warmup(warmup, microbatches):
    ops = [("F", mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", mb) for mb in range(microbatches - warmup, microbatches)]


def order_warmup_too_long(stage, stages, microbatches):
    return _with_warmup(min(stages - stage, microbatches), microbatches)


def order_no_warmup(stage, stages, microbatches):
    return _with_warmup(0, microbatches)


def order_without_min(stage, stages, microbatches):
    return _with_warmup(stages - stage - 1, microbatches)


def order_backward_first(stage, stages, microbatches):
    return [("B", 0)] + [op for op in order(stage, stages, microbatches) if op != ("B", 0)]


def order_unpaired(stage, stages, microbatches):
    return [("F", 0), ("B", 0)]


def test_one_f_one_b_order_passes_the_right_answer():
    assert ch06.check_one_f_one_b_order(order).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (order_gpipe, "that is GPipe's order"),
        (order_warmup_too_long, "holds at most P - s = 2: warm up with P - s - 1 forwards, not 2"),
        (order_no_warmup, r"should run min\(P - s - 1, M\) = 1 warm-up forwards"),
        (order_without_min, r"the warm-up is cut short: min\(P - s - 1, M\) = 2 forwards"),
        (order_backward_first, "B must come after its F"),
        (order_unpaired, "needs exactly one F and one B"),
        (lambda s, p, m: 42, r"return a list of \(op, microbatch\) pairs"),
    ],
)
def test_one_f_one_b_order_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_one_f_one_b_order(answer)


def bubble(timelines):
    records = [r for t in timelines for r in t]
    span = max(r.end for r in records) - min(r.start for r in records)
    return 1 - sum(r.end - r.start for r in records) / (len(timelines) * span)


def bubble_busy(timelines):
    return 1 - bubble(timelines)


def bubble_per_stage_span(timelines):
    busy = sum(r.end - r.start for t in timelines for r in t)
    return 1 - busy / sum(t[-1].end - t[0].start for t in timelines)


def bubble_from_zero(timelines):
    records = [r for t in timelines for r in t]
    return 1 - sum(r.end - r.start for r in records) / (
        len(timelines) * max(r.end for r in records)
    )


def bubble_one_stage(timelines):
    records = [r for t in timelines for r in t]
    span = max(r.end for r in records) - min(r.start for r in records)
    return 1 - sum(r.end - r.start for r in records) / span


def bubble_mean_of_stages(timelines):
    spans = [t[-1].end - t[0].start for t in timelines]
    busy = [sum(r.end - r.start for r in t) for t in timelines]
    idle = [1 - b / span for b, span in zip(busy, spans, strict=True)]
    return sum(idle) / len(timelines)


def bubble_stage0_span(timelines):
    busy = sum(r.end - r.start for t in timelines for r in t)
    return 1 - busy / (len(timelines) * (timelines[0][-1].end - timelines[0][0].start))


def test_bubble_passes_the_right_answer():
    assert ch06.check_bubble(bubble).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (bubble_busy, "that is the BUSY fraction"),
        (bubble_per_stage_span, "each stage over its own span; measure every stage over the same"),
        (bubble_mean_of_stages, "you averaged each stage's idle fraction over that stage's own"),
        (bubble_stage0_span, "you took stage 0's span for the whole step"),
        (bubble_from_zero, "not at t = 0"),
        (bubble_one_stage, "divide the busy time by stages x span"),
        (lambda timelines: None, "return a number"),
    ],
)
def test_bubble_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_bubble(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch06.check_one_f_one_b_order(unanswered).status == "not attempted"
    assert ch06.check_bubble(unanswered).status == "not attempted"
