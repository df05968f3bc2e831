"""Pipeline schedules as data, and the timelines a real run leaves behind (chapter 6).

Chapter 6 ("Pipeline input and layer split") sets the schedules side by side; chapter 7 prints one
beside its training run, and chapter 13's composed training runs 1F1B on every stage.

- *Schedules are data.* ``vanilla_schedule`` (the whole batch at once: one stage works, the others
  wait), ``gpipe_schedule`` (Huang et al. 2019: all forwards of M micro-batches, then all
  backwards) and ``one_f_one_b_schedule`` (PipeDream-Flush, Narayanan et al. 2021: each stage
  alternates one forward and one backward, so it holds at most P - s micro-batches' activations
  instead of M) each return a list of :class:`Action`; ``inference_schedule`` is forwards only.
  One executor, :class:`dmlbook.model_parallel.pipeline.PipelineStage`, runs any valid list.
  Neighbours must post their messages in the same order, which :func:`check_schedule` verifies
  before anything is sent (it replays the schedule's messages and proves it cannot deadlock);
  ``format_schedule`` prints one line per stage.
- *Beyond the book: the schedules large runs use now.* ``interleaved_schedule`` (Narayanan et al.
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters"): each of the P ranks
  holds v model chunks, chunk c of rank r being virtual stage c*P + r of P*v, so a micro-batch
  passes every rank v times and each op is 1/v as long; the bubble shrinks to
  (P-1)/(v*M + P-1). ``zb_h1_schedule`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"):
  backward split into B (the input gradient, which the previous stage waits for) and W (the
  weight gradient, which nobody waits for), W deferred into the cool-down; with equal F, B and W
  times the bubble is (P-1)/(3M + P-1), a third of 1F1B's in the same units.
  :mod:`dmlbook.model_parallel.backward_split` shows the split on one linear layer.
- *Timelines.* Every stage records when each of its ops ran (:class:`OpRecord`, seconds since a
  t0 the stages agree on as the step starts). ``measured_bubble`` is the idle fraction of a real
  run, to set beside the theory ``bubble_theory`` ((P - 1) / (M + P - 1) for GPipe and 1F1B);
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
    "interleaved_schedule",
    "measured_bubble",
    "one_f_one_b_schedule",
    "packed_timelines",
    "stage_actions",
    "vanilla_schedule",
    "virtual_stage",
    "zb_h1_schedule",
]

# ---- Schedules: plain lists of actions -------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One op of one stage: the ``step``-th thing stage ``stage`` does in a training step.

    ``op`` is "F" (forward), "B" (backward) or "W". In a schedule with W ops (zero bubble), B
    computes only the input gradient, which the previous stage waits for, and W the weight
    gradient later; without them B is the whole backward. ``chunk`` says which of the stage's
    model chunks runs the op (interleaved schedules; 0 for every other): chunk c of stage s is
    virtual stage c * P + s (:func:`virtual_stage`).
    """

    stage: int  # pipeline stage (rank in the pipeline group)
    step: int  # position in that stage's own order: 0, 1, 2, ...
    op: str  # "F" (forward), "B" (backward, or input gradient only) or "W" (weight gradient)
    microbatch: int
    chunk: int = 0  # which of the stage's model chunks (interleaved schedules)


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    """Where chunk ``chunk`` of stage ``stage`` sits in the model: chunk c of each of the P
    stages comes before chunk c + 1 of any, so the model's order is stage 0 chunk 0, stage 1
    chunk 0, ..., stage P-1 chunk 0, stage 0 chunk 1, ..."""
    return chunk * stages + stage


def _number(stage: int, ops: Sequence[tuple]) -> list[Action]:
    """Actions from (op, micro-batch) or (op, micro-batch, chunk) tuples, in order."""
    return [Action(stage, step, *op) for step, op in enumerate(ops)]


def check_sizes(stages: int, microbatches: int) -> None:
    """A clear ValueError unless ``stages`` and ``microbatches`` are integers of at least 1."""
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def vanilla_schedule(stages: int, microbatches: int = 1) -> list[Action]:
    """Plain model parallelism: the whole batch goes forward through every stage, then backward.
    Only one stage works at a time; the others idle (the bubble is (P - 1) / P)."""
    check_sizes(stages, microbatches)
    if microbatches != 1:
        raise ValueError(
            f"vanilla model parallelism runs the whole batch as one micro-batch, got "
            f"microbatches={microbatches}; use 'gpipe' or '1f1b' to pipeline micro-batches"
        )
    return gpipe_schedule(stages, 1)


def gpipe_schedule(stages: int, microbatches: int) -> list[Action]:
    """GPipe: every stage runs the forwards of all M micro-batches, then all their backwards.
    Each stage holds the activations of all M micro-batches at the turn."""
    check_sizes(stages, microbatches)
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
    check_sizes(stages, microbatches)
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
    check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        actions += _number(stage, [("F", mb) for mb in range(microbatches)])
    return actions


def _check_chunks(chunks: int) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(
            f"chunks (model chunks per stage, v) must be an integer >= 1, got {chunks!r}"
        )


def interleaved_schedule(stages: int, microbatches: int, chunks: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021): each stage holds ``chunks`` = v model chunks.

    Micro-batches go in groups of P: stage s runs the forwards of micro-batches 0..P-1 on its
    chunk 0, then the same P on chunk 1, ..., then the next group; backwards go the same way from
    the last chunk down. Stage s warms up with (P - s - 1) + (v - 1) * P forwards (1F1B's
    warm-up, plus one round of P micro-batches on each further chunk), then alternates one forward
    and one backward, then drains. With v = 1 it is 1F1B. M must be a multiple of P, so that
    every group fills the pipe.
    """
    check_sizes(stages, microbatches)
    _check_chunks(chunks)
    if microbatches % stages:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in groups of P = {stages} stages: "
            f"M = {microbatches} micro-batches is not a multiple of P = {stages}"
        )

    def unit(k: int, backward: bool) -> tuple[int, int]:  # k-th forward (backward): (mb, chunk)
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        return group * stages + within % stages, chunks - 1 - chunk if backward else chunk

    total = microbatches * chunks  # forwards (and backwards) per stage
    actions = []
    for stage in range(stages):
        warmup = min(stages - stage - 1 + (chunks - 1) * stages, total)
        ops = [("F", *unit(k, False)) for k in range(warmup)]
        for i in range(total - warmup):  # steady state: one forward, one backward
            ops += [("F", *unit(warmup + i, False)), ("B", *unit(i, True))]
        ops += [("B", *unit(k, True)) for k in range(total - warmup, total)]  # drain
        actions += _number(stage, ops)
    return actions


def zb_h1_schedule(stages: int, microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B with backward split into B (input gradient) and W (weight
    gradient), where stage s runs each W s micro-batches behind its B (W m-s right after B m),
    so that its last s Ws are left for the cool-down: where 1F1B's stage s > 0 idles while the
    last backwards climb up to it, ZB-H1's runs those Ws. Stage 0 runs every W right after its B.
    Stage s warms up like 1F1B (P - s - 1 forwards); a micro-batch is held from its F to its W,
    at most min(P, M) at once on every stage (1F1B's stage 0)."""
    check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        ops = [("F", mb) for mb in range(warmup)]
        for i in range(microbatches):
            if warmup + i < microbatches:  # steady state: one forward, ...
                ops.append(("F", warmup + i))
            ops.append(("B", i))  # ... one input gradient, and the W of s micro-batches ago
            if i >= stage:
                ops.append(("W", i - stage))
        ops += [("W", mb) for mb in range(max(microbatches - stage, 0), microbatches)]  # cool-down
        actions += _number(stage, ops)
    return actions


SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "vanilla": vanilla_schedule,
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_schedule,  # takes chunks=v too
    "zb-h1": zb_h1_schedule,
}


def bubble_theory(stages: int, microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> float:
    """The idle fraction of ``schedule`` when its ops take equal times (one unit each).

    - GPipe and 1F1B (F and B one unit): the first forward reaches stage P-1 after P-1 units and
      stage 0's last backward comes P-1 units after stage P-1's, so each stage idles 2(P-1) of
      2M + 2(P-1) units: (P-1)/(M+P-1).
    - Interleaved, v chunks per stage (M a multiple of P): an op of one chunk lasts 1/v unit. The
      pipe still fills and drains once per step through P-1 stage boundaries, each crossing now
      1/v unit long: 2(P-1)/v idle of 2M + 2(P-1)/v, that is (P-1)/(v*M + P-1), the bubble
      divided by about v.
    - ZB-H1 (F, B and W one unit each, M >= P): every stage idles P-1 units (the last stage while
      the first forward comes down, the others while the first gradient comes back), and in the
      drain, where B ops hop up the pipe without their Ws, each stage runs the Ws it held back
      instead of waiting: (P-1)/(3M + P-1). 1F1B in the same units (backward = B + W = 2) idles
      3(P-1): ZB-H1's bubble is about a third of it.
    """
    check_sizes(stages, microbatches)
    _check_chunks(chunks)
    if schedule == "interleaved":
        return (stages - 1) / (chunks * microbatches + stages - 1)
    if chunks != 1:
        raise ValueError(f"{schedule!r} runs one model chunk per stage, got chunks={chunks}")
    if schedule == "zb-h1":
        if microbatches < stages:
            raise ValueError(
                f"ZB-H1's bubble (P-1)/(3M+P-1) needs M >= P micro-batches to fill the pipe, "
                f"got M = {microbatches} < P = {stages}"
            )
        return (stages - 1) / (3 * microbatches + stages - 1)
    if schedule in ("vanilla", "gpipe", "1f1b"):
        return (stages - 1) / (microbatches + stages - 1)
    raise ValueError(f"unknown schedule {schedule!r}; use one of {list(SCHEDULES)}")


def stage_actions(actions: Sequence[Action], stage: int) -> list[Action]:
    """The actions of one stage, in the order it runs them."""
    return sorted((a for a in actions if a.stage == stage), key=lambda a: a.step)


def _messages(action: Action, stages: int, chunks: int) -> tuple[list, list]:
    """What one action receives and sends: ([(from stage, message)], [(to stage, message)]).

    A message is (kind, virtual stage it goes to, micro-batch). F receives the activation from
    the virtual stage before it and sends its output to the one after; B receives the gradient
    of its output from the one after and sends its input's gradient back; W does neither. The
    hop from stage P-1 chunk c to stage 0 chunk c+1 is a message like any other.
    """
    here, last = virtual_stage(action.stage, action.chunk, stages), stages * chunks - 1
    step = {"F": 1, "B": -1}.get(action.op)
    if step is None:
        return [], []
    kind = "activation" if action.op == "F" else "gradient"
    source, target = here - step, here + step
    recvs = [(source % stages, (kind, here, action.microbatch))] if 0 <= source <= last else []
    sends = [(target % stages, (kind, target, action.microbatch))] if 0 <= target <= last else []
    return recvs, sends


def _label(a: Action, chunks: int) -> str:
    return f"{a.op}{a.microbatch}" + (f" of chunk {a.chunk}" if chunks > 1 else "")


def check_schedule(
    actions: Sequence[Action],
    stages: int,
    microbatches: int,
    backward: bool = True,
    chunks: int = 1,
) -> None:
    """Raise ValueError unless ``actions`` is a schedule one executor can run without deadlock.

    Every stage runs each micro-batch's forward once on each of its ``chunks`` model chunks (and,
    with ``backward``, its backward once, after its forward; where the schedule splits backward,
    its W once, after its B); steps are numbered 0, 1, ...; every pair of stages sends and
    receives their messages in the same order, so that messages pair up; and the schedule, replayed
    with messages that never block the sender (``isend``) and receives that do, finishes: no
    stage waits for a message that a stage waiting on it would send.
    """
    check_sizes(stages, microbatches)
    _check_chunks(chunks)
    if any(a.stage not in range(stages) for a in actions):
        raise ValueError(f"an action names a stage outside 0..{stages - 1}")
    if any(a.chunk not in range(chunks) for a in actions):
        raise ValueError(f"an action names a model chunk outside 0..{chunks - 1}")
    split = backward and any(a.op == "W" for a in actions)  # B is the input gradient only
    wanted_ops = ("F",) if not backward else ("F", "B", "W") if split else ("F", "B")
    programs = []
    for stage in range(stages):
        mine = stage_actions(actions, stage)
        if [a.step for a in mine] != list(range(len(mine))):
            raise ValueError(f"stage {stage}'s steps must be numbered 0, 1, 2, ...")
        for a in mine:
            if a.op not in wanted_ops or not 0 <= a.microbatch < microbatches:
                raise ValueError(f"{a} is not an op of this schedule")
        for chunk in range(chunks):
            for op in wanted_ops:
                order = [a.microbatch for a in mine if a.op == op and a.chunk == chunk]
                if sorted(order) != list(range(microbatches)):
                    where = f"stage {stage}" + (f" chunk {chunk}" if chunks > 1 else "")
                    raise ValueError(
                        f"{where} must run {op} once for each of {microbatches} micro-batches, "
                        f"runs it for {order}"
                    )
        done: set[tuple[str, int, int]] = set()
        for a in mine:
            before = {"B": "F", "W": "B"}.get(a.op)
            if before is not None and (before, a.chunk, a.microbatch) not in done:
                raise ValueError(
                    f"stage {stage} runs {_label(a, chunks)} before "
                    f"{_label(Action(stage, 0, before, a.microbatch, a.chunk), chunks)}"
                )
            done.add((a.op, a.chunk, a.microbatch))
        programs.append(mine)
    # Messages pair in order: what stage i sends to stage j, in i's order, must be what j
    # receives from i, in j's order. Point-to-point messages between two ranks are matched in
    # the order they were posted, per tag: activations and gradients go with different tags (with
    # P = 2 and model chunks, both kinds travel each way between the same two ranks).
    sent: dict[tuple[int, int, str], list] = {}
    received: dict[tuple[int, int, str], list] = {}
    for stage, mine in enumerate(programs):
        for a in mine:
            recvs, sends = _messages(a, stages, chunks)
            for source, message in recvs:
                received.setdefault((source, stage, message[0]), []).append(message)
            for target, message in sends:
                sent.setdefault((stage, target, message[0]), []).append(message)
    for link in sorted(set(sent) | set(received)):
        if sent.get(link, []) != received.get(link, []):
            raise ValueError(
                f"stage {link[0]} sends {link[2]}s to stage {link[1]} and stage {link[1]} "
                f"receives them in different micro-batch orders ({_brief(sent.get(link, []))} "
                f"sent vs {_brief(received.get(link, []))} received): their messages would "
                f"not pair"
            )
    # Replay: a stage runs its next action once the message it receives has been sent.
    position, posted = [0] * stages, {link: 0 for link in sent}
    while any(position[s] < len(programs[s]) for s in range(stages)):
        progressed = False
        for stage in range(stages):
            while position[stage] < len(programs[stage]):
                a = programs[stage][position[stage]]
                recvs, sends = _messages(a, stages, chunks)
                if any(
                    received[source, stage, message[0]].index(message)
                    >= posted[source, stage, message[0]]
                    for source, message in recvs
                ):
                    break  # its input has not been sent yet
                for target, message in sends:
                    posted[stage, target, message[0]] += 1
                position[stage] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"stage {s} at {_label(programs[s][position[s]], chunks)}"
                for s in range(stages)
                if position[s] < len(programs[s])
            )
            raise ValueError(f"the schedule deadlocks: every stage waits ({waiting})")


def _brief(messages: Sequence[tuple[str, int, int]]) -> str:
    """E.g. ``[0>v1, 1>v1]``: micro-batch 0, then 1, to virtual stage 1."""
    return "[" + ", ".join(f"{mb}>v{to}" for _, to, mb in messages) + "]"


def format_schedule(actions: Sequence[Action]) -> str:
    """One line per stage, e.g. ``stage 0: F0 F1 F2 B0 B1 B2``; where stages hold more than one
    model chunk, each op names its chunk after a dot (``F0.1``: micro-batch 0 on chunk 1)."""
    stages = sorted({a.stage for a in actions})
    chunked = any(a.chunk for a in actions)

    def name(a: Action) -> str:
        return f"{a.op}{a.microbatch}" + (f".{a.chunk}" if chunked else "")

    return "\n".join(
        f"stage {s}: " + " ".join(name(a) for a in stage_actions(actions, s)) for s in stages
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
    chunk: int = 0  # which of the stage's model chunks ran it (interleaved schedules)


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

    A forward on (virtual) stage s needs that micro-batch's forward on stage s - 1, a backward
    its backward on stage s + 1; a W needs only its own stage's B, earlier in the same row.
    With model chunks (interleaved), stage s - 1 of chunk 0 of stage 0 is chunk c - 1 of the last
    stage. Comparing ``measured_bubble`` of a run and of its packed timelines splits the gap to
    the theory in two: op times that differ (packed vs theory) and waiting on messages and the
    operating system (measured vs packed).
    """
    stages = len(timelines)
    last = stages * (1 + max((r.chunk for t in timelines for r in t), default=0)) - 1
    done: dict[tuple[int, str, int], float] = {}  # (virtual stage, op, micro-batch) -> packed end
    packed: list[list[OpRecord]] = [[] for _ in range(stages)]
    while any(len(packed[s]) < len(timelines[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while len(packed[s]) < len(timelines[s]):
                r = timelines[s][len(packed[s])]
                here = virtual_stage(s, r.chunk, stages)
                source = {"F": here - 1, "B": here + 1}.get(r.op, -1)  # W: no one else's
                needs = (source, r.op, r.microbatch) if 0 <= source <= last else None
                if needs is not None and needs not in done:
                    break  # its input is not computed yet: try the other stages first
                free = packed[s][-1].end if packed[s] else 0.0
                start = max(free, done.get(needs, 0.0))
                end = start + r.end - r.start
                packed[s].append(OpRecord(r.op, r.microbatch, start, end, r.chunk))
                done[here, r.op, r.microbatch] = end
                progressed = True
        if not progressed:
            raise ValueError("the timelines wait on each other in a cycle: not a valid schedule")
    return packed
