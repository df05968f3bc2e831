"""Checkers for chapter 6's exercises ("Pipeline input and layer split").

1. ``check_one_f_one_b_order``: write ``order(stage, stages, microbatches) -> [(op, microbatch),
   ...]``, the order in which stage ``stage`` of a 1F1B pipeline runs its ops: ``min(P - s - 1,
   M)`` warm-up forwards, then one forward and one backward in turn, then the backwards left
   (:func:`dmlbook.model_parallel.pipeline.one_f_one_b_schedule` builds it for every stage).
2. ``check_bubble``: write ``bubble(timelines) -> float``, the idle fraction of a real pipelined
   step from its per-stage timelines of :class:`dmlbook.model_parallel.pipeline.OpRecord`: one
   minus the busy time of all stages over (stages x the span from the first start to the last end)
   (:func:`dmlbook.model_parallel.pipeline.measured_bubble`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dmlbook.exercises import ExerciseFailed, checker, learner_code
from dmlbook.model_parallel import pipeline as pp

__all__ = ["check_bubble", "check_one_f_one_b_order"]

# (stages, micro-batches): a short and a long pipe, M < P, M = 1, and a single stage
_ORDER_CASES = [(2, 4), (3, 6), (4, 8), (4, 2), (3, 1), (1, 3)]


def _ops(actions: Sequence[pp.Action]) -> list[tuple[str, int]]:
    return [(a.op, a.microbatch) for a in actions]


def _peak_live(ops: Sequence[tuple[str, int]]) -> int:
    live = peak = 0
    for op, _ in ops:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


@checker("one_f_one_b_order", writes=("dmlbook.model_parallel.pipeline.one_f_one_b_schedule",))
def check_one_f_one_b_order(fn: Callable[[int, int, int], Sequence[tuple[str, int]]]) -> str:
    """Check ``fn(stage, stages, microbatches)`` against the 1F1B order of every stage of
    pipelines of 1 to 4 stages and 1 to 8 micro-batches, including fewer micro-batches than
    stages; a wrong order is explained (GPipe's order, too long or short a warm-up, ...)."""
    for stages, microbatches in _ORDER_CASES:
        for stage in range(stages):
            case = f"stage {stage} of P = {stages} stages with M = {microbatches} micro-batches"
            with learner_code(f"your order for {case}"):
                got = fn(stage, stages, microbatches)
            try:
                got = [(str(op), int(mb)) for op, mb in got]
            except (TypeError, ValueError) as error:
                raise ExerciseFailed(
                    f"for {case}: return a list of (op, microbatch) pairs such as ('F', 0), "
                    f"got {got!r}"
                ) from error
            want = _ops(pp.stage_actions(pp.one_f_one_b_schedule(stages, microbatches), stage))
            if got == want:
                continue
            raise ExerciseFailed(f"for {case}: {_diagnose(got, want, stage, stages, microbatches)}")
    return f"the 1F1B order of every stage, for {len(_ORDER_CASES)} pipeline shapes"


def _diagnose(got, want, stage: int, stages: int, microbatches: int) -> str:
    """Say what is wrong with a 1F1B order, most telling mistake first."""
    shown = f"expected {' '.join(f'{o}{m}' for o, m in want)}, got "
    shown += " ".join(f"{o}{m}" for o, m in got)
    every = sorted((op, mb) for op in "FB" for mb in range(microbatches))
    if microbatches < stages - stage - 1 and any(mb >= microbatches for _, mb in got):
        return (
            f"with fewer micro-batches than the pipe is deep, the warm-up is cut short: "
            f"min(P - s - 1, M) = {microbatches} forwards, not P - s - 1 ({shown})"
        )
    if sorted(got) != every:
        return (
            f"each of micro-batches 0..{microbatches - 1} needs exactly one F and one B ({shown})"
        )
    forward_at = {mb: i for i, (op, mb) in enumerate(got) if op == "F"}
    if any(op == "B" and i < forward_at[mb] for i, (op, mb) in enumerate(got)):
        return f"a micro-batch's B must come after its F ({shown})"
    gpipe = [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]
    warmup = min(stages - stage - 1, microbatches)
    if got == gpipe:
        return (
            "that is GPipe's order (all forwards, then all backwards), which holds all "
            f"{microbatches} micro-batches at once. 1F1B warms up with min(P - s - 1, M) = "
            f"{warmup} forwards and then alternates F and B ({shown})"
        )
    got_warmup = next(i for i, (op, _) in enumerate(got) if op == "B") - 1
    if _peak_live(got) > stages - stage:
        return (
            f"stage {stage} holds {_peak_live(got)} micro-batches' activations at once; 1F1B "
            f"holds at most P - s = {stages - stage}: warm up with P - s - 1 forwards, not "
            f"{got_warmup} ({shown})"
        )
    if got_warmup != warmup:
        return (
            f"stage {stage} should run min(P - s - 1, M) = {warmup} warm-up forwards (the "
            f"micro-batches still in the stages below it) before its first F-B pair, not "
            f"{got_warmup} ({shown})"
        )
    return f"after the warm-up, alternate one F and one B, then drain the B's left ({shown})"


def _timeline_cases() -> list[tuple[str, list[list[pp.OpRecord]]]]:
    R = pp.OpRecord
    two_stages = [  # GPipe, P = 2, M = 2, B twice as long as F, starting at t = 0
        [R("F", 0, 0, 1), R("F", 1, 1, 2), R("B", 0, 5, 7), R("B", 1, 7, 9)],
        [R("F", 0, 1, 2), R("F", 1, 2, 3), R("B", 0, 3, 5), R("B", 1, 5, 7)],
    ]
    late_start = [  # the clock did not start at the first op, and stage 1 starts after stage 0
        [R("F", 0, 2.0, 2.5), R("B", 0, 4.0, 5.0)],
        [R("F", 0, 2.6, 3.1), R("B", 0, 3.1, 4.0)],
    ]
    three_stages = [  # 1F1B, P = 3, M = 3, with uneven op times
        [R("F", 0, 0.1, 0.3), R("F", 1, 0.3, 0.5), R("F", 2, 0.5, 0.7), R("B", 0, 1.6, 2.0)]
        + [R("B", 1, 2.1, 2.5), R("B", 2, 2.6, 3.0)],
        [R("F", 0, 0.3, 0.6), R("F", 1, 0.6, 0.9), R("B", 0, 1.2, 1.6), R("F", 2, 1.6, 1.9)]
        + [R("B", 1, 1.9, 2.1), R("B", 2, 2.2, 2.6)],
        [R("F", 0, 0.6, 0.8), R("B", 0, 0.8, 1.2), R("F", 1, 1.2, 1.4), R("B", 1, 1.4, 1.9)]
        + [R("F", 2, 1.9, 2.0), R("B", 2, 2.0, 2.2)],
    ]
    forward_only = [  # serving: no backward, so the LAST stage is the last to finish
        [R("F", 0, 0, 1), R("F", 1, 1, 2)],
        [R("F", 0, 1, 3), R("F", 1, 3, 5)],
    ]
    return [
        ("2 stages, GPipe, M = 2", two_stages),
        ("2 stages whose first op starts at t = 2.0 s", late_start),
        ("3 stages, 1F1B, M = 3", three_stages),
        ("2 stages, forward only, the last stage finishing last", forward_only),
    ]


@checker("bubble")
def check_bubble(fn: Callable[[Sequence[Sequence[pp.OpRecord]]], float]) -> str:
    """Check ``fn(timelines)`` on four step timelines: it must return the idle fraction,
    1 - (busy time of all stages) / (stages x (last end - first start))."""
    for name, timelines in _timeline_cases():
        copies = [list(t) for t in timelines]
        with learner_code(f"your bubble on {name}"):
            got = fn(copies)
        want = pp.measured_bubble(timelines)
        try:
            got = float(got)
        except (TypeError, ValueError) as error:
            raise ExerciseFailed(f"on {name}: return a number, got {got!r}") from error
        if abs(got - want) <= 1e-9:
            continue
        raise ExerciseFailed(
            f"on {name}: the bubble is {want:.4f}, got {got:.4f}{_hint(got, timelines)}"
        )
    return "the idle fraction of 4 timelines (2 and 3 stages, one late, one forward only)"


def _hint(got: float, timelines) -> str:
    records = [r for t in timelines for r in t]
    busy = sum(r.end - r.start for r in records)
    first, last = min(r.start for r in records), max(r.end for r in records)
    stages = len(timelines)
    spans = [max(r.end for r in t) - min(r.start for r in t) for t in timelines]
    busy_of = [sum(r.end - r.start for r in t) for t in timelines]
    own_idle = [1 - b / span for b, span in zip(busy_of, spans, strict=True)]
    near = lambda x: abs(got - x) <= 1e-9  # noqa: E731
    same_span = (
        "measure every stage over the same span, from the first start to the last end over ALL "
        "stages: a stage that starts late, or finishes early, is idle for the rest of the step"
    )
    if near(busy / (stages * (last - first))):
        return ": that is the BUSY fraction; the bubble is the idle one, 1 - busy fraction"
    if near(1 - busy / sum(spans)):
        return f": you measured each stage over its own span; {same_span}"
    if near(sum(own_idle) / stages):
        return (
            ": you averaged each stage's idle fraction over that stage's own span, which leaves "
            f"out the time before its first op and after its last; {same_span}"
        )
    stage0 = spans[0]
    if near(1 - busy / (stages * stage0)):
        return (
            ": you took stage 0's span for the whole step, but the last op to end can be on "
            "another stage (here, forward only, it is the last stage's); take the last end "
            "over ALL stages"
        )
    if near(1 - busy / (stages * last)):
        return ": the span starts at the earliest start over all stages, not at t = 0"
    if near(1 - busy / (last - first)):
        return ": divide the busy time by stages x span: every stage could have been busy"
    return ""
