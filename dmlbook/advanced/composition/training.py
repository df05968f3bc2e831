"""One training step, every dimension: ZeRO-1 data, tensor (+ sequence), pipeline (1F1B),
context and expert parallelism on one char-GPT, on the one training loop (chapter 13).

:func:`train_composed` is a rank function. Every rank builds the same model from a seed,
:func:`~dmlbook.advanced.composition.compose.compose` keeps its part and builds its ZeRO-1
optimizers (in the one order of :data:`~dmlbook.advanced.composition.compose.COMPOSITION_ORDER`),
and chapter 1's :func:`~dmlbook.data_parallel.loop.train_loop` runs :func:`composed_step` as its
step hook: the single-process step cut along the layout, read top to bottom as picotron's
``train_step`` is:

1. **data** (:func:`cut_batch`): the rows of this rank's DP slice, the positions of its CP chunks;
2. **forward and backward** (compute, with TP/SP, CP and EP messages inside the layers): the
   stage's 1F1B schedule over ``microbatches`` (:class:`~dmlbook.model_parallel.pipeline.
   PipelineStage`), activations and gradients to the neighbouring stages;
3. **gradient sync** (communication): dense gradients averaged over ``dp_cp`` (every rank there
   holds the same shard of the same stage), expert gradients over ``edp``, both divided by
   ``dp * cp``: each rank's loss is the mean over its ``1 / (dp cp)`` of the tokens;
4. **ZeRO-1 step**: AdamW by :class:`~dmlbook.advanced.zero.sharded_optimizer.ShardedOptimizer`,
   its state sharded over the same groups, the updated parameters broadcast by their owners.

The one-process run it equals is
:func:`~dmlbook.data_parallel.loop.train_reference` with ``optimizer=torch.optim.AdamW`` (the
whole batch), and :func:`compare_with_reference` checks, on every rank, that each parameter it
holds equals the same slice of the reference model (so every element of the full model is
checked somewhere). A :class:`StepMeter` times each phase of the step (a loop callback marks
each step's common start); with ``measure=True`` it also counts what
:mod:`dmlbook.advanced.composition.planner` predicts: each rank's memory and its bytes per
axis (see :class:`StepMeasurement`).

The load-balancing auxiliary loss of the MoE is left out: it depends on which tokens are routed
together, so it differs from one process by design; the capacity is unlimited (``None``) for
the same reason (a capacity counts the tokens routed together).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.composition.compose import Composed, compose
from dmlbook.advanced.composition.layout import DEGREE_AXES, GRID_AXES, Axis, Layout, ProcessGroups
from dmlbook.advanced.context_parallel.styles import cp_chunks
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward
from dmlbook.advanced.zero.sharded_optimizer import optimizer_state_bytes
from dmlbook.comm import collectives
from dmlbook.comm.alltoall import exchange_sizes
from dmlbook.comm.compression import WireMeter
from dmlbook.comm.groups import even_block
from dmlbook.data_parallel import average_gradients
from dmlbook.data_parallel.loop import Callback, LoopState, NoSync, train_loop
from dmlbook.model_parallel.pipeline import OpRecord, PipelineStage, StepResult
from dmlbook.models import Batch

__all__ = [
    "PHASES",
    "StepMeter",
    "compare_with_reference",
    "composed_step",
    "cut_batch",
    "time_layouts",
    "train_composed",
]

PHASES = ("forward/backward", "gradient sync", "ZeRO-1 step")  # the parts of a step, in order


@dataclass
class StepMeasurement:
    """One rank's measured memory (bytes) and traffic (bytes it sent) in one step."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # peak bytes saved for backward (all live micro-batches)
    sent: dict[Axis, int] = field(default_factory=dict)  # per axis, counted per message
    wire: dict[str, int] = field(default_factory=dict)  # TCP payload per phase, by the kernel


@dataclass
class ComposedResult:
    losses: list[float]  # the global batch's mean loss at each step (on every rank)
    rank: int
    coords: dict[Axis, int]
    max_diff: float | None = None  # against the reference's slice, when one was given
    timeline: list[OpRecord] = field(default_factory=list)  # the last step: F, B, sync, step
    measurement: StepMeasurement | None = None  # the last step, with measure=True
    step_s: list[float] = field(default_factory=list)  # wall time of each step (barrier to end)
    phase_s: list[tuple[float, float, float]] = field(default_factory=list)  # each step's
    # seconds in each of PHASES


def cut_batch(batch: Batch, layout: Layout, coords: dict[Axis, int]) -> Batch:
    """This rank's cut of a global batch: its DP rows, its CP positions (``layout.zigzag``)."""
    idx, targets = batch
    start, stop = even_block(idx.shape[0], rank=coords[Axis.dp], world_size=layout.dp,
                             what="dp: batch rows")  # fmt: skip
    idx, targets = idx[start:stop], targets[start:stop]
    if layout.cp > 1:
        chunks = cp_chunks(idx.shape[1] // layout.cp, layout.cp, layout.zigzag)[coords[Axis.cp]]
        idx = torch.cat([idx[:, a:b] for a, b in chunks], dim=1)
        targets = torch.cat([targets[:, a:b] for a, b in chunks], dim=1)
    return Batch(idx, targets)


def compare_with_reference(stage: nn.Module, reference: nn.Module, groups) -> float:
    """The largest absolute difference between this rank's parameters and the same slice of a
    trained reference model, cut by the same transformation (no optimizer: cutting only
    slices)."""
    ref_stage = compose(reference, groups).stage
    ours, theirs = dict(stage.named_parameters()), dict(ref_stage.named_parameters())
    if ours.keys() != theirs.keys():
        raise ValueError(f"parameter names differ: {sorted(ours.keys() ^ theirs.keys())}")
    return max((ours[n].detach() - theirs[n].detach()).abs().max().item() for n in ours)


class StepMeter(Callback):
    """What chapter 13 measures of :func:`composed_step`, without a line of it changed: the seconds
    of each of :data:`PHASES` (``with meter.phase(name):``), from the step's common start (a loop
    callback); with ``traffic=True`` also each phase's messages (counted per message) and TCP
    payload, and on step ``memory_step`` the bytes autograd saves."""

    def __init__(self, traffic: bool = False, memory_step: int | None = None) -> None:
        self.traffic, self.memory_step = traffic, memory_step
        self.memory = False  # whether this step counts the activations (read by composed_step)
        self.t0 = time.time()  # the step's common start
        self.starts: dict[str, float] = {}  # when each phase of the last step began
        self.end = self.t0  # when the last step's last phase ended
        self.sends: dict[str, list] = {}  # each phase's messages (traffic=True)
        self.wire: dict[str, int] = {}  # each phase's TCP payload bytes (traffic=True)
        self.step_s: list[float] = []
        self.phase_s: list[tuple[float, ...]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"no phase {name!r}; the phases are {PHASES}")
        self.starts[name] = time.time()
        if self.traffic:
            with collectives.recording_sends() as sends, WireMeter() as wire:
                yield
            self.sends[name], self.wire[name] = sends, wire.bytes
        else:
            yield
        self.end = time.time()

    def on_step_start(self, state: LoopState) -> None:
        """The step's start on every rank: the latest arrival (an all-reduce is also a barrier)."""
        latest = torch.tensor([time.time()], dtype=torch.float64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        self.t0 = latest.item()
        self.memory = state.step == self.memory_step

    def on_step(self, state: LoopState) -> None:
        bounds = [self.t0, *(self.starts[p] for p in PHASES[1:]), self.end]  # each phase's start
        self.step_s.append(self.end - self.t0)
        self.phase_s.append(tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)))

    def timeline(self, result: StepResult) -> list[OpRecord]:
        """The last step's F and B ops (timed from the pipeline's own common start, ~t0), then
        the gradient sync and the ZeRO-1 step."""
        sync, step = self.starts["gradient sync"], self.starts["ZeRO-1 step"]
        return [
            *result.timeline,
            OpRecord("sync", -1, sync - self.t0, step - self.t0),
            OpRecord("step", -1, step - self.t0, self.end - self.t0),
        ]

    def measurement(self, result: StepResult, composed: Composed) -> StepMeasurement:
        """The last step's memory and traffic (``traffic=True``, ``memory_step`` the last)."""
        layout = composed.groups.layout
        sent = dict.fromkeys(DEGREE_AXES, 0)
        for s in self.sends["forward/backward"]:
            sent[_axis_of(s, layout)] += s.nbytes
        sent[Axis.pp] += result.sent_bytes
        sent[Axis.dp] += sum(s.nbytes for s in self.sends["gradient sync"])
        return StepMeasurement(
            params=_bytes(composed.stage.parameters()),
            grads=_bytes(p.grad for p in composed.stage.parameters()),
            optimizer=sum(optimizer_state_bytes(o) for o in composed.optimizers),
            activations=result.peak_saved_bytes or 0,
            sent=sent,
            wire=dict(self.wire),
        )


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _axis_of(send, layout: Layout) -> Axis:
    """Which axis a message belongs to: all-to-all is EP; otherwise the grid axis in which
    sender and receiver differ (DP when they differ in DP, or in DP and CP)."""
    if send.collective == "all_to_all":
        return Axis.ep
    a, b = layout.coordinates(send.src), layout.coordinates(send.dst)
    differ = [axis for axis in GRID_AXES if a[axis] != b[axis]]
    return Axis.dp if Axis.dp in differ else differ[0]


def _checked_cuts(batches: Iterable[Batch], layout: Layout, coords) -> Iterator[Batch]:
    """Each batch's :func:`cut_batch`, after one all-gather of every rank's cut shape: a
    ValueError on every rank, naming the axis, when they differ (a collective on mismatched
    shapes could wait forever)."""
    for batch in batches:
        mine = cut_batch(batch, layout, coords)
        shapes = exchange_sizes(list(mine.inputs.shape), None, mine.inputs.device)
        problems = []
        for d, what in enumerate(("dp: batch rows", "cp/tp: sequence lengths")):
            if len({s[d] for s in shapes}) > 1:
                found = ", ".join(f"rank {r}: {s[d]}" for r, s in enumerate(shapes))
                problems.append(f"{what} differ across ranks ({found})")
        if problems:
            raise ValueError("the ranks' batches do not match: " + "; ".join(problems))
        yield mine


def composed_step(
    composed: Composed,
    pipeline: PipelineStage,
    batch: Batch,
    microbatches: int,
    meter: StepMeter | None = None,
) -> StepResult:
    """One composed training step, read top to bottom (picotron's ``train_step``): this rank's
    part of the batch through its pipeline stage, the gradients averaged by group, ZeRO-1's
    update. ``composed``: what :func:`~dmlbook.advanced.composition.compose.compose` returned;
    ``pipeline``: its stage as chapter 6's :class:`~dmlbook.model_parallel.pipeline.
    PipelineStage`; ``batch``: this rank's rows and positions (:func:`cut_batch`)."""
    meter = StepMeter() if meter is None else meter
    layout, groups = composed.groups.layout, composed.groups
    idx, targets = batch  # (B / dp, T / cp): my DP rows, my CP positions
    first, last = pipeline.is_first, pipeline.is_last
    composed.stage.zero_grad(set_to_none=True)
    with meter.phase("forward/backward"):
        # Compute: forward and backward of every micro-batch in 1F1B order. Inside the layers
        # run the TP/SP collectives, ring attention's K/V passes and the experts' all-to-alls;
        # between stages, each micro-batch's activations go forward, its gradients come back.
        result = pipeline.train_step(
            idx if first else None,  # only the first stage reads tokens
            targets if last else None,  # only the last stage has the loss
            composed.model.loss if last else None,
            microbatches=microbatches,
            schedule="1f1b",
            measure_memory=meter.memory,
        )
    with meter.phase("gradient sync"):
        # Communication: dense gradients summed over dp_cp, expert gradients over edp, both
        # divided by dp x cp: each rank's loss is the mean over its 1 / (dp cp) of the tokens.
        for params, group in ((composed.dense, groups.dp_cp), (composed.experts, groups.edp)):
            average_gradients(params, group, algorithm="ring", divide_by=layout.dp * layout.cp)
    with meter.phase("ZeRO-1 step"):
        for optimizer in composed.optimizers:  # dense over dp_cp, experts over edp
            optimizer.step()  # each owner updates its share and broadcasts it
    return result  # .loss on the last stage: the mean over my tokens


def train_composed(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    layout: Layout,
    microbatches: int = 1,
    lr: float = 1e-2,
    reference_state: dict | None = None,
    measure: bool = False,
    group_cache: dict | None = None,
) -> ComposedResult:
    """Rank function: train ``make_model()`` on ``batches`` with ``layout`` (see the module),
    by the one training loop with :func:`composed_step` as its step hook. ``reference_state``: a
    trained reference's state dict to compare the final weights with; ``group_cache``: one dict
    passed to every call that trains in the same processes."""
    groups = ProcessGroups(layout, group_cache)
    coords = groups.coords
    model = make_model()
    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    n_experts = max((len(m.experts) for m in moes), default=0)
    rows, seq = batches[0][0].shape
    layout.validate_model(model.config, seq, rows, microbatches, n_experts)
    composed = compose(model, groups, None, torch.optim.AdamW, lr=lr)
    pipeline = PipelineStage(composed.stage, coords[Axis.pp], layout.pp, groups.pp, device="cpu")
    meter = StepMeter(traffic=measure, memory_step=len(batches) - 1 if measure else None)
    last: list[StepResult] = []

    def step_hook(state: LoopState, batch: Batch) -> torch.Tensor | None:
        last[:] = [composed_step(composed, pipeline, batch, microbatches, meter)]
        loss = last[0].loss  # on the last stage; None elsewhere
        return None if loss is None else torch.tensor(loss, dtype=torch.float64)

    state = train_loop(composed.stage, None, None, None,
                       _checked_cuts(batches, layout, coords), sync=NoSync(),
                       callbacks=[meter], forward_backward=step_hook)  # fmt: skip
    counted = pipeline.is_last and coords[Axis.tp] == 0  # one loss per DP x CP place
    losses = torch.tensor([x if counted else 0.0 for x in state.losses], dtype=torch.float64)
    dist.all_reduce(losses)  # for the curve: the last stages' losses, averaged over dp x cp
    losses /= layout.dp * layout.cp
    max_diff = None
    if reference_state is not None:
        reference = make_model()
        reference.load_state_dict(reference_state)
        max_diff = compare_with_reference(composed.stage, reference, groups)
    return ComposedResult(
        losses.tolist(), groups.rank, coords, max_diff, meter.timeline(last[0]),
        meter.measurement(last[0], composed) if measure else None, meter.step_s, meter.phase_s,
    )  # fmt: skip


def time_layouts(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    layouts: Sequence[Layout],
    microbatches: int = 1,
    warmup: int = 1,
) -> dict[str, dict[str, list[float]]]:
    """Rank function: train with each layout in turn on the same ranks. For each, after
    ``warmup`` steps: ``"step"``, each step's time on the slowest rank (seconds, from the common
    start), and for each of :data:`PHASES` that same rank's seconds in that part of the step,
    so that the parts add up to the step."""
    cache: dict = {}
    times = {}
    for layout in layouts:
        result = train_composed(make_model, batches, layout, microbatches, group_cache=cache)
        rows = [[total, *parts] for total, parts in zip(result.step_s, result.phase_s, strict=True)]
        mine = torch.tensor(rows[warmup:], dtype=torch.float64)  # (steps, 1 + phases)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        every = torch.stack(everyone)  # (ranks, steps, 1 + phases)
        slowest = every[:, :, 0].argmax(dim=0)  # each step's slowest rank
        picked = every[slowest, torch.arange(every.shape[1])]  # (steps, 1 + phases)
        times[str(layout)] = dict(zip(("step", *PHASES), picked.t().tolist(), strict=True))
    return times
