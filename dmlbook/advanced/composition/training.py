"""One training loop, every dimension: ZeRO-1 data, tensor (+ sequence), pipeline (1F1B),
context and expert parallelism on one char-GPT (chapter 13).

:func:`train_composed` is a rank function. Every rank builds the same model from a seed,
:func:`~dmlbook.advanced.composition.compose.compose` keeps its part and builds its ZeRO-1
optimizers (in the one order of :data:`~dmlbook.advanced.composition.compose.COMPOSITION_ORDER`),
and each step, :func:`train_step`, is the single-process step cut along the layout:

1. **data** (:func:`rank_batch`): the rows of this rank's DP slice, the positions of its CP chunks;
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
checked somewhere). With ``measure=True`` the loop also returns what
:mod:`dmlbook.advanced.composition.planner` predicts: each rank's memory and its bytes per
dimension (see :class:`StepMeasurement`).

The load-balancing auxiliary loss of the MoE is left out: it depends on which tokens are routed
together, so it differs from one process by design; the capacity is unlimited (``None``) for
the same reason (a capacity counts the tokens routed together).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.composition.compose import compose
from dmlbook.advanced.composition.layout import Layout, ProcessGroups
from dmlbook.advanced.context_parallel.styles import cp_layout
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward
from dmlbook.advanced.zero.sharded_optimizer import optimizer_state_bytes
from dmlbook.comm import collectives
from dmlbook.comm.alltoall import exchange_sizes
from dmlbook.comm.compression import WireMeter
from dmlbook.comm.groups import even_block
from dmlbook.model_parallel.pipeline import OpRecord, PipelineStage
from dmlbook.models import Batch

__all__ = [
    "ComposedResult",
    "PHASES",
    "StepMeasurement",
    "compare_with_reference",
    "rank_batch",
    "time_layouts",
    "train_composed",
    "train_step",
]


@dataclass
class StepMeasurement:
    """One rank's measured memory (bytes) and traffic (bytes it sent) in one step."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # peak bytes saved for backward (all live micro-batches)
    sent: dict[str, int] = field(default_factory=dict)  # per dimension, counted per message
    wire: dict[str, int] = field(default_factory=dict)  # TCP payload per phase, by the kernel


@dataclass
class ComposedResult:
    losses: list[float]  # the global batch's mean loss at each step (on every rank)
    rank: int
    coords: dict[str, int]
    max_diff: float | None = None  # against the reference's slice, when one was given
    timeline: list[OpRecord] = field(default_factory=list)  # the last step: F, B, sync, step
    measurement: StepMeasurement | None = None  # the last step, with measure=True
    step_s: list[float] = field(default_factory=list)  # wall time of each step (barrier to end)
    phase_s: list[tuple[float, float, float]] = field(default_factory=list)  # each step's
    # (forward/backward, gradient sync, ZeRO-1 step) seconds


def rank_batch(batch: Batch, layout: Layout, coords: dict[str, int]):
    """This rank's part of a global batch: its DP rows, its CP positions (``layout.zigzag``)."""
    idx, targets = batch
    start, stop = even_block(idx.shape[0], rank=coords["dp"], world_size=layout.dp,
                             what="dp: batch rows")  # fmt: skip
    idx, targets = idx[start:stop], targets[start:stop]
    if layout.cp > 1:
        chunks = cp_layout(idx.shape[1] // layout.cp, layout.cp, layout.zigzag)[coords["cp"]]
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


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _dimension_of(send, layout: Layout) -> str:
    """Which dimension a message belongs to: all-to-all is EP; otherwise the coordinate in
    which sender and receiver differ (DP when they differ in DP, or in DP and CP)."""
    if send.collective == "all_to_all":
        return "ep"
    a, b = layout.coordinates(send.src), layout.coordinates(send.dst)
    differ = [d for d in ("pp", "dp", "cp", "tp") if a[d] != b[d]]
    return "dp" if "dp" in differ else differ[0]


def _same_batch_shape(idx: torch.Tensor) -> None:
    """One all-gather of every rank's local batch shape: a ValueError on every rank, naming the
    dimension, when they differ (a collective on mismatched shapes could wait forever)."""
    shapes = exchange_sizes(list(idx.shape), None, idx.device)
    problems = []
    for d, what in enumerate(("dp: batch rows", "cp/tp: sequence lengths")):
        if len({s[d] for s in shapes}) > 1:
            found = ", ".join(f"rank {r}: {s[d]}" for r, s in enumerate(shapes))
            problems.append(f"{what} differ across ranks ({found})")
    if problems:
        raise ValueError("the ranks' batches do not match: " + "; ".join(problems))


def _common_start() -> float:
    """The step's start on every rank: the latest arrival (an all-reduce is also a barrier)."""
    latest = torch.tensor([time.time()], dtype=torch.float64)
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)
    return latest.item()


def train_step(composed, pipeline: PipelineStage, batch: Batch, microbatches: int):
    """One composed training step, read top to bottom (picotron's ``train_step``): this rank's
    part of the batch through its pipeline stage, the gradients averaged, ZeRO-1's update.
    ``composed``: what :func:`~dmlbook.advanced.composition.compose.compose` returned;
    ``pipeline``: its stage as chapter 6's :class:`~dmlbook.model_parallel.pipeline.
    PipelineStage`; ``batch``: this rank's rows and positions (:func:`rank_batch`)."""
    idx, targets = batch  # (B / dp, T / cp): my DP rows, my CP positions
    first, last = pipeline.is_first, pipeline.is_last
    composed.zero_grad()
    # Compute: forward and backward of every micro-batch in 1F1B order. Inside the layers run
    # the TP/SP collectives, ring attention's K/V passes and the experts' all-to-alls; between
    # stages, each micro-batch's activations go forward and its gradients come back.
    result = pipeline.train_step(
        idx if first else None,  # only the first stage reads tokens
        targets if last else None,  # only the last stage has the loss
        composed.model.loss if last else None,
        microbatches=microbatches,
        schedule="1f1b",
    )
    composed.sync_gradients()  # communication: dense over dp_cp, experts over edp
    composed.step()  # ZeRO-1: each owner updates its share and broadcasts it
    return result  # .loss on the last stage: the mean over my tokens


class _Measured:
    """What chapter 13 measures of :func:`train_step`, without a line of it changed: stands in
    for the pipeline stage and for the composed model (everything else passes through), records
    the messages and wire bytes of each phase, its times and, on the last step, the memory."""

    def __init__(self, composed, pipeline: PipelineStage, measure: bool, steps: int) -> None:
        self.composed, self.pipeline, self.measure, self.last = (
            composed,
            pipeline,
            measure,
            steps - 1,
        )
        self.model, self.is_first, self.is_last = (
            composed.model,
            pipeline.is_first,
            pipeline.is_last,
        )
        self.step_index = 0

    def zero_grad(self) -> None:
        self.composed.zero_grad()

    def train_step(self, idx, targets, loss_fn, **options):
        self.t0 = _common_start()
        memory = self.measure and self.step_index == self.last
        with collectives.recording() as self.sends, WireMeter() as self.wire_fb:
            self.result = self.pipeline.train_step(idx, targets, loss_fn, measure_memory=memory,
                                                   **options)  # fmt: skip
        return self.result

    def sync_gradients(self) -> None:
        self.t_sync = time.time()
        with collectives.recording() as self.sync_sends, WireMeter() as self.wire_sync:
            self.composed.sync_gradients()
        self.grads = _bytes(p.grad for p in self.composed.stage.parameters())

    def step(self) -> None:
        self.t_step = time.time()
        with WireMeter() as self.wire_opt:
            self.composed.step()
        self.t_end = time.time()
        self.step_index += 1

    def phases(self) -> tuple[float, float, float]:
        """Seconds of the last step's forward/backward, gradient sync and ZeRO-1 step."""
        return self.t_sync - self.t0, self.t_step - self.t_sync, self.t_end - self.t_step

    def timeline(self) -> list[OpRecord]:
        """The step's F and B ops (timed from the pipeline's own common start, ~t0), then the
        gradient sync and the ZeRO-1 step."""
        return [
            *self.result.timeline,
            OpRecord("sync", -1, self.t_sync - self.t0, self.t_step - self.t0),
            OpRecord("step", -1, self.t_step - self.t0, self.t_end - self.t0),
        ]

    def measurement(self) -> StepMeasurement:
        layout = self.composed.groups.layout
        sent: dict[str, int] = {d: 0 for d in ("dp", "tp", "pp", "cp", "ep")}
        for s in self.sends:
            sent[_dimension_of(s, layout)] += s.nbytes
        sent["pp"] += self.result.sent_bytes
        sent["dp"] += sum(s.nbytes for s in self.sync_sends)
        return StepMeasurement(
            params=_bytes(self.composed.stage.parameters()),
            grads=self.grads,
            optimizer=sum(optimizer_state_bytes(o) for o in self.composed.optimizers),
            activations=self.result.peak_saved_bytes or 0,
            sent=sent,
            wire={
                "forward/backward": self.wire_fb.bytes,
                "gradient sync": self.wire_sync.bytes,
                "ZeRO-1 step": self.wire_opt.bytes,
            },
        )


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
    by the one training loop. ``reference_state``: a trained reference's state dict to compare
    the final weights with; ``group_cache``: one dict passed to every call that trains in the
    same processes."""
    groups = ProcessGroups(layout, group_cache)
    coords = groups.coords
    model = make_model()
    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    n_experts = max((len(m.experts) for m in moes), default=0)
    rows, seq = batches[0][0].shape
    layout.validate_model(model.config, seq, rows, microbatches, n_experts)
    composed = compose(model, groups, None, torch.optim.AdamW, lr=lr)
    pipeline = PipelineStage(composed.stage, coords["pp"], layout.pp, groups.pp, device="cpu")
    measured = _Measured(composed, pipeline, measure, len(batches))
    losses, step_s, phase_s = [], [], []
    for batch in batches:
        mine = rank_batch(batch, layout, coords)
        _same_batch_shape(mine.inputs)  # a ValueError on every rank, not a hang, if they differ
        result = train_step(measured, measured, mine, microbatches)
        step_s.append(measured.t_end - measured.t0)
        phase_s.append(measured.phases())
        last = result.loss if pipeline.is_last and coords["tp"] == 0 else 0.0
        loss = torch.tensor([last], dtype=torch.float64)
        dist.all_reduce(loss)  # for the curve: the last stages' losses, averaged over dp x cp
        losses.append(loss.item() / (layout.dp * layout.cp))
    max_diff = None
    if reference_state is not None:
        reference = make_model()
        reference.load_state_dict(reference_state)
        max_diff = compare_with_reference(composed.stage, reference, groups)
    return ComposedResult(
        losses, groups.rank, coords, max_diff, measured.timeline(),
        measured.measurement() if measure else None, step_s, phase_s,
    )  # fmt: skip


PHASES = ("forward/backward", "gradient sync", "ZeRO-1 step")  # the parts of a timed step


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
