"""Pipeline schedules as data, and the timelines a real run leaves behind (chapter 6).

Chapter 6 ("Pipeline input and layer split") sets the schedules side by side; chapter 7 prints one
beside its training run, and chapter 13's composed training runs 1F1B on every stage.

- *Schedules are data.* ``vanilla_schedule`` (the whole batch at once: one stage works, the others
  wait), ``gpipe_schedule`` (Huang et al. 2019: all forwards of M micro-batches, then all
  backwards) and ``one_f_one_b_schedule`` (PipeDream-Flush, Narayanan et al. 2021: each stage
  alternates one forward and one backward, so it holds at most P - s micro-batches' activations
  instead of M) each return a list of :class:`Action`; ``inference_schedule`` is forwards only.
  One executor, :class:`dmlbook.model_parallel.pipeline.PipelineStage`, runs any valid list.
  Neighbours must post their messages in the same micro-batch order, which
  :func:`check_schedule` verifies before anything is sent; ``format_schedule`` prints one line
  per stage.
- *Timelines.* Every stage records when each of its ops ran (:class:`OpRecord`, seconds since a
  t0 the stages agree on as the step starts). ``measured_bubble`` is the idle fraction of a real
  run, to set beside the theory, ``bubble_theory`` = (P - 1) / (M + P - 1);
  ``packed_timelines`` replays a run's ops with instant messages, to split the gap between the
  two; ``dmlbook.viz.gantt`` draws the timelines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "Action",
    "OpRecord",
    "SCHEDULES",
    "bubble_theory",
    "check_schedule",
    "format_schedule",
    "gpipe_schedule",
    "inference_schedule",
    "measured_bubble",
    "one_f_one_b_schedule",
    "packed_timelines",
    "stage_actions",
    "vanilla_schedule",
]

# ---- Schedules: plain lists of actions -------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One op of one stage: the ``step``-th thing stage ``stage`` does in a training step."""

    stage: int  # pipeline stage (rank in the pipeline group)
    step: int  # position in that stage's own order: 0, 1, 2, ...
    op: str  # "F" (forward) or "B" (backward)
    microbatch: int


def _number(stage: int, ops: Sequence[tuple[str, int]]) -> list[Action]:
    return [Action(stage, step, op, mb) for step, (op, mb) in enumerate(ops)]


def _check_sizes(stages: int, microbatches: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def vanilla_schedule(stages: int, microbatches: int = 1) -> list[Action]:
    """Plain model parallelism: the whole batch goes forward through every stage, then backward.
    Only one stage works at a time; the others idle (the bubble is (P - 1) / P)."""
    _check_sizes(stages, microbatches)
    if microbatches != 1:
        raise ValueError(
            f"vanilla model parallelism runs the whole batch as one micro-batch, got "
            f"microbatches={microbatches}; use 'gpipe' or '1f1b' to pipeline micro-batches"
        )
    return gpipe_schedule(stages, 1)


def gpipe_schedule(stages: int, microbatches: int) -> list[Action]:
    """GPipe: every stage runs the forwards of all M micro-batches, then all their backwards.
    Each stage holds the activations of all M micro-batches at the turn."""
    _check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        forwards = [("F", mb) for mb in range(microbatches)]
        backwards = [("B", mb) for mb in range(microbatches)]
        actions += _number(stage, forwards + backwards)
    return actions


def one_f_one_b_schedule(stages: int, microbatches: int) -> list[Action]:
    """1F1B: stage s warms up with P - s - 1 forwards, then alternates one forward and one
    backward, then cools down with the backwards left. It never holds more than P - s
    micro-batches' activations; the bubble is the same as GPipe's."""
    _check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        ops = [("F", mb) for mb in range(warmup)]  # fill the pipe below this stage
        for i in range(microbatches - warmup):  # steady state: one forward, one backward
            ops += [("F", warmup + i), ("B", i)]
        ops += [("B", mb) for mb in range(microbatches - warmup, microbatches)]  # drain
        actions += _number(stage, ops)
    return actions


def inference_schedule(stages: int, microbatches: int) -> list[Action]:
    """Serving: forwards only, micro-batch after micro-batch, on every stage."""
    _check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        actions += _number(stage, [("F", mb) for mb in range(microbatches)])
    return actions


SCHEDULES: dict[str, Callable[[int, int], list[Action]]] = {
    "vanilla": vanilla_schedule,
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
}


def bubble_theory(stages: int, microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B when every op takes the same time: (P-1)/(M+P-1)."""
    _check_sizes(stages, microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def stage_actions(actions: Sequence[Action], stage: int) -> list[Action]:
    """The actions of one stage, in the order it runs them."""
    return sorted((a for a in actions if a.stage == stage), key=lambda a: a.step)


def check_schedule(
    actions: Sequence[Action], stages: int, microbatches: int, backward: bool = True
) -> None:
    """Raise ValueError unless ``actions`` is a schedule one executor can run without deadlock.

    Every stage runs each micro-batch's forward once (and, with ``backward``, its backward once,
    after its forward); steps are numbered 0, 1, ...; and every stage sends and receives in the
    same micro-batch order as its neighbours, so that messages pair up.
    """
    _check_sizes(stages, microbatches)
    if any(a.stage not in range(stages) for a in actions):
        raise ValueError(f"an action names a stage outside 0..{stages - 1}")
    wanted_ops = ("F", "B") if backward else ("F",)
    orders: dict[str, list[list[int]]] = {op: [] for op in wanted_ops}
    for stage in range(stages):
        mine = stage_actions(actions, stage)
        if [a.step for a in mine] != list(range(len(mine))):
            raise ValueError(f"stage {stage}'s steps must be numbered 0, 1, 2, ...")
        for a in mine:
            if a.op not in wanted_ops or not 0 <= a.microbatch < microbatches:
                raise ValueError(f"{a} is not an op of this schedule")
        for op in wanted_ops:
            order = [a.microbatch for a in mine if a.op == op]
            if sorted(order) != list(range(microbatches)):
                raise ValueError(
                    f"stage {stage} must run {op} once for each of {microbatches} micro-batches, "
                    f"runs it for {order}"
                )
            orders[op].append(order)
        if backward:
            forward_at = {a.microbatch: a.step for a in mine if a.op == "F"}
            for a in mine:
                if a.op == "B" and a.step < forward_at[a.microbatch]:
                    raise ValueError(f"stage {stage} runs B{a.microbatch} before F{a.microbatch}")
    for op, per_stage in orders.items():
        for stage in range(1, stages):
            if per_stage[stage] != per_stage[stage - 1]:
                raise ValueError(
                    f"stages {stage - 1} and {stage} run {op} in different micro-batch orders "
                    f"({per_stage[stage - 1]} vs {per_stage[stage]}): their messages would not pair"
                )


def format_schedule(actions: Sequence[Action]) -> str:
    """One line per stage, e.g. ``stage 0: F0 F1 F2 B0 B1 B2``."""
    stages = sorted({a.stage for a in actions})
    return "\n".join(
        f"stage {s}: " + " ".join(f"{a.op}{a.microbatch}" for a in stage_actions(actions, s))
        for s in stages
    )


# ---- Timelines: what each stage ran, and when ------------------------------------------------


@dataclass
class OpRecord:
    """When one op computed on one stage, in seconds since the step's common t0: ``start`` is when
    its input was there (after the receive), ``end`` when its result was (before the send)."""

    op: str
    microbatch: int
    start: float
    end: float


def measured_bubble(timelines: Sequence[Sequence[OpRecord]]) -> float:
    """Idle fraction of a real run: 1 - (busy time summed over stages) / (stages x makespan)."""
    records = [r for timeline in timelines for r in timeline]
    if not records:
        raise ValueError("no op records: nothing ran")
    makespan = max(r.end for r in records) - min(r.start for r in records)
    busy = sum(r.end - r.start for r in records)
    return 1.0 - busy / (len(timelines) * makespan)


def packed_timelines(timelines: Sequence[Sequence[OpRecord]]) -> list[list[OpRecord]]:
    """The same ops with the same durations, each started as soon as its stage is free and its
    input exists: the step as it would run with instant messages and no other delay.

    A forward on stage s needs that micro-batch's forward on stage s - 1, a backward on stage s
    its backward on stage s + 1. Comparing ``measured_bubble`` of a run and of its packed
    timelines splits the gap to the theory in two: op times that differ (packed vs theory) and
    waiting on messages and the operating system (measured vs packed).
    """
    stages = len(timelines)
    done: dict[tuple[int, str, int], float] = {}  # (stage, op, micro-batch) -> packed end
    packed: list[list[OpRecord]] = [[] for _ in range(stages)]
    while any(len(packed[s]) < len(timelines[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while len(packed[s]) < len(timelines[s]):
                r = timelines[s][len(packed[s])]
                source = s - 1 if r.op == "F" else s + 1  # where this op's input comes from
                needs = (source, r.op, r.microbatch) if 0 <= source < stages else None
                if needs is not None and needs not in done:
                    break  # its input is not computed yet: try the other stages first
                free = packed[s][-1].end if packed[s] else 0.0
                start = max(free, done.get(needs, 0.0))
                packed[s].append(OpRecord(r.op, r.microbatch, start, start + r.end - r.start))
                done[s, r.op, r.microbatch] = start + r.end - r.start
                progressed = True
        if not progressed:
            raise ValueError("the timelines wait on each other in a cycle: not a valid schedule")
    return packed
