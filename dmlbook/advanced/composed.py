"""One training loop, every dimension: ZeRO-1 data, tensor (+ sequence), pipeline (1F1B),
context and expert parallelism on one char-GPT (chapter 13).

:func:`train_composed` is a rank function. Every rank builds the same model from a seed,
:func:`~dmlbook.advanced.parallelize.parallelize_composed` keeps its part (in the one order of
:data:`~dmlbook.advanced.parallelize.COMPOSITION_ORDER`), and each step is the single-process
step cut along the layout:

1. **data** (:func:`rank_batch`): the rows of this rank's DP slice, the positions of its CP chunks;
2. **forward and backward** (compute, with TP/SP, CP and EP messages inside the layers): the
   stage's 1F1B schedule over ``microbatches`` (:class:`~dmlbook.model_parallel.pipeline.
   PipelineStage`), activations and gradients to the neighbouring stages;
3. **gradient sync** (communication): dense gradients averaged over ``dp_cp`` (every rank there
   holds the same shard of the same stage), expert gradients over ``edp``, both divided by
   ``dp * cp``: each rank's loss is the mean over its ``1 / (dp cp)`` of the tokens;
4. **ZeRO-1 step**: AdamW by :class:`~dmlbook.advanced.sharded_optimizer.ShardedOptimizer`, its
   state sharded over the same groups, the updated parameters broadcast by their owners.

:func:`train_reference` is the one-process run it equals (AdamW, the whole batch), and
:func:`compare_with_reference` checks, on every rank, that each parameter it holds equals the
same slice of the reference model (so every element of the full model is checked somewhere).
With ``measure=True`` the loop also returns what :mod:`dmlbook.advanced.planner` predicts:
each rank's memory and its bytes per dimension (see :class:`StepMeasurement`).

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

from dmlbook.advanced.context_parallel_styles import cp_layout
from dmlbook.advanced.layout import Layout, ProcessGroups
from dmlbook.advanced.parallelize import parallelize_composed
from dmlbook.advanced.sharded_optimizer import ShardedOptimizer, optimizer_state_bytes
from dmlbook.comm import collectives
from dmlbook.comm.alltoall import exchange_sizes
from dmlbook.comm.compression import WireMeter
from dmlbook.data_parallel import average_gradients
from dmlbook.data_parallel.loop import train_reference as _reference_loop
from dmlbook.model_parallel.pipeline import OpRecord, PipelineStage

__all__ = [
    "ComposedResult",
    "StepMeasurement",
    "compare_with_reference",
    "rank_batch",
    "train_composed",
    "time_layouts",
    "train_reference",
]

Batch = tuple[torch.Tensor, torch.Tensor]  # (idx, targets), each (B, T)


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


def rank_batch(batch: Batch, layout: Layout, coords: dict[str, int], zigzag: bool = True):
    """This rank's part of a global batch: its DP rows, its CP positions (zigzag chunks)."""
    idx, targets = batch
    if idx.shape[0] % layout.dp:
        raise ValueError(f"dp: batch={idx.shape[0]} is not divisible by dp={layout.dp}")
    rows = idx.shape[0] // layout.dp
    sl = slice(coords["dp"] * rows, (coords["dp"] + 1) * rows)
    idx, targets = idx[sl], targets[sl]
    if layout.cp > 1:
        chunks = cp_layout(idx.shape[1] // layout.cp, layout.cp, zigzag)[coords["cp"]]
        idx = torch.cat([idx[:, a:b] for a, b in chunks], dim=1)
        targets = torch.cat([targets[:, a:b] for a, b in chunks], dim=1)
    return idx, targets


def train_reference(make_model: Callable[[], nn.Module], batches: Sequence[Batch], lr=1e-2):
    """One process, the whole batch, AdamW: the losses and the final state dict."""
    done = _reference_loop(make_model, batches, optimizer=torch.optim.AdamW, lr=lr)
    return done.losses, {k: v.detach().clone() for k, v in done.model.state_dict().items()}


def compare_with_reference(stage: nn.Module, reference: nn.Module, groups, zigzag=True) -> float:
    """The largest absolute difference between this rank's parameters and the same slice of a
    trained reference model, cut by the same transformation (no communication: cutting only
    slices)."""
    ref_stage = parallelize_composed(reference, groups, zigzag).stage
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


def train_composed(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    layout: Layout,
    microbatches: int = 1,
    lr: float = 1e-2,
    reference_state: dict | None = None,
    measure: bool = False,
    zigzag: bool = True,
    group_cache: dict | None = None,
) -> ComposedResult:
    """Rank function: train ``make_model()`` on ``batches`` with ``layout`` (see the module).
    ``reference_state``: a trained reference's state dict to compare the final weights with;
    ``group_cache``: one dict passed to every call that trains in the same processes."""
    groups = ProcessGroups(layout, group_cache)
    coords = groups.coords
    model = make_model()
    n_experts = max((len(m.experts) for m in model.modules() if hasattr(m, "router")), default=0)
    rows, seq = batches[0][0].shape
    layout.validate_model(model.config, seq, rows, microbatches, n_experts, zigzag)
    composed = parallelize_composed(model, groups, zigzag)
    stage = PipelineStage(composed.stage, coords["pp"], layout.pp, groups.pp, device="cpu")
    optimizers = [
        ShardedOptimizer(ps, torch.optim.AdamW, group=g, lr=lr)
        for ps, g in ((composed.dense, groups.dp_cp), (composed.experts, groups.edp))
        if ps
    ]
    is_last = coords["pp"] == layout.pp - 1
    losses, step_s, timeline, measured = [], [], [], None
    for step, batch in enumerate(batches):
        idx, targets = rank_batch(batch, layout, coords, zigzag)
        _same_batch_shape(idx)
        last_step = step == len(batches) - 1
        meter = measure and last_step
        for p in composed.stage.parameters():
            p.grad = None
        t0 = _common_start()
        with collectives.recording() as sends, WireMeter() as wire_fb:
            result = stage.train_step(
                idx if coords["pp"] == 0 else None,
                targets if is_last else None,
                composed.model.loss if is_last else None,
                microbatches=microbatches,
                schedule="1f1b",
                measure_memory=meter,
            )
        t_sync = time.time()
        with collectives.recording() as sync_sends, WireMeter() as wire_sync:
            for params, group in ((composed.dense, groups.dp_cp), (composed.experts, groups.edp)):
                average_gradients(params, group, algorithm="ring", divide_by=layout.dp * layout.cp)
        grads = _bytes(p.grad for p in composed.stage.parameters())
        t_step = time.time()
        with WireMeter() as wire_opt:
            for optimizer in optimizers:
                optimizer.step()
        t_end = time.time()
        step_s.append(t_end - t0)
        mine = result.loss if is_last and coords["tp"] == 0 else 0.0
        loss = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(loss)  # for the curve: the last stages' losses, averaged over dp x cp
        losses.append(loss.item() / (layout.dp * layout.cp))
        if last_step:  # the pipeline's ops are timed from its own common start, ~t0
            timeline = [
                *result.timeline,
                OpRecord("sync", -1, t_sync - t0, t_step - t0),
                OpRecord("step", -1, t_step - t0, t_end - t0),
            ]
        if meter:
            sent: dict[str, int] = {d: 0 for d in ("dp", "tp", "pp", "cp", "ep")}
            for s in sends:
                sent[_dimension_of(s, layout)] += s.nbytes
            sent["pp"] += result.sent_bytes
            sent["dp"] += sum(s.nbytes for s in sync_sends)
            measured = StepMeasurement(
                params=_bytes(composed.stage.parameters()),
                grads=grads,
                optimizer=sum(optimizer_state_bytes(o) for o in optimizers),
                activations=result.peak_saved_bytes or 0,
                sent=sent,
                wire={
                    "forward/backward": wire_fb.bytes,
                    "gradient sync": wire_sync.bytes,
                    "ZeRO-1 step": wire_opt.bytes,
                },
            )
    max_diff = None
    if reference_state is not None:
        reference = make_model()
        reference.load_state_dict(reference_state)
        max_diff = compare_with_reference(composed.stage, reference, groups, zigzag)
    return ComposedResult(losses, groups.rank, coords, max_diff, timeline, measured, step_s)


def time_layouts(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    layouts: Sequence[Layout],
    microbatches: int = 1,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Rank function: train with each layout in turn on the same ranks; for each, the step
    times after ``warmup`` steps, each the slowest rank's (seconds, from the common start)."""
    cache: dict = {}
    times = {}
    for layout in layouts:
        result = train_composed(make_model, batches, layout, microbatches, group_cache=cache)
        slowest = torch.tensor(result.step_s[warmup:], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[str(layout)] = slowest.tolist()
    return times
