"""Heterogeneous workers: throttled ranks, batches in proportion to speed, and the weighted sum
that keeps the update exact (chapter 12, idea 4; see :mod:`dmlbook.advanced.speedups`)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmlbook.advanced.speedups.jobs import Job, check_steps
from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel import (
    Callback,
    GradientAveraging,
    LocalBatch,
    LoopState,
    broadcast_parameters,
    train_loop,
)


def proportional_batches(speeds: Sequence[float], global_batch: int) -> list[int]:
    """Split ``global_batch`` in proportion to ``speeds`` (samples per second), summing exactly
    to ``global_batch``: round down, hand the samples left to the largest remainders, then give
    any rank left with none one sample from the largest batch (a rank with nothing to do would
    still have to join every all-reduce)."""
    speeds = [float(s) for s in speeds]
    if not speeds or any(not math.isfinite(s) or s <= 0 for s in speeds):
        raise ValueError(f"speeds must be positive and finite, got {speeds}")
    if global_batch < len(speeds):
        raise ValueError(f"global_batch={global_batch} cannot give {len(speeds)} ranks one each")
    exact = [global_batch * s / sum(speeds) for s in speeds]
    batches = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda r: batches[r] - exact[r])
    for r in by_remainder[: global_batch - sum(batches)]:
        batches[r] += 1
    for r in range(len(batches)):
        if batches[r] == 0:
            batches[max(range(len(batches)), key=batches.__getitem__)] -= 1
            batches[r] = 1
    return batches


def equal_batches(global_batch: int, world_size: int) -> list[int]:
    """``global_batch`` split as evenly as it goes (the first ranks take the remainder)."""
    if world_size < 1 or global_batch < world_size:
        raise ValueError(f"global_batch={global_batch} cannot give {world_size} ranks one each")
    base, extra = divmod(global_batch, world_size)
    return [base + (r < extra) for r in range(world_size)]


@dataclass
class HeteroRun:
    """One rank's heterogeneous training: the split it used and how fast the steps went."""

    rank: int
    batches: list[int]  # every rank's share of the global batch
    speeds: list[float]  # every rank's measured samples per second (empty unless measured)
    step_s: list[float]  # wall time of each step on this rank
    state: dict[str, torch.Tensor] = field(repr=False)
    global_batch: int = 0

    @property
    def throughput(self) -> float:
        """Global samples per second, from the median step time."""
        ordered = sorted(self.step_s)
        return self.global_batch / ordered[len(ordered) // 2]


class _Throttle(Callback):
    """A processor ``slowdown`` times slower: after each backward pass the rank keeps its core
    busy until ``slowdown`` times the step's compute time has passed. Spinning, unlike sleeping,
    holds the core, so other work on the machine cannot use the gap (and a sleeper is not woken
    ahead of busy processes); unlike repeating the computation, it is not sped up by warm
    caches. It also times each whole step. Its hooks read nothing of the loop's state, so the
    speed probe calls them around its own backward passes."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown, self.step_s, self.start = slowdown, [], 0.0

    def on_step_start(self, state: LoopState) -> None:
        self.start = time.perf_counter()

    def after_backward(self, state: LoopState) -> None:
        until = self.start + self.slowdown * (time.perf_counter() - self.start)
        while time.perf_counter() < until:
            pass

    def on_step(self, state: LoopState) -> None:
        self.step_s.append(time.perf_counter() - self.start)


def union_batches(
    samples: int, split: Sequence[int], rank: int, steps: int, seed: int, weighted: bool = True
) -> Iterable[LocalBatch]:
    """Chapter 12's batch plan: step t's global batch is the t-th ``sum(split)`` samples of the
    epoch's shuffle, and rank r takes ``split[r]`` of them. ``weighted`` makes each rank's loss
    its share of the global mean (the sum over ranks is then the single-process gradient);
    otherwise each rank's own mean, which plain DDP averages."""
    global_batch, offset = sum(split), sum(split[:rank])
    per_epoch = samples // global_batch
    for step in range(steps):
        epoch, t = divmod(step, per_epoch)
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))
        part = order[t * global_batch + offset : t * global_batch + offset + split[rank]]
        yield LocalBatch(epoch, t, part, last_in_epoch=t + 1 == per_epoch, offset=t * global_batch,
                    global_size=global_batch if weighted else None)  # fmt: skip


def measure_speeds(
    model: nn.Module, x, y, batch: int, slowdown: float, probe_steps: int = 3, group=None
) -> list[float]:
    """Every rank's samples per second: each times ``probe_steps`` throttled forward and backward
    passes on ``batch`` samples (after a warm-up, without training), then they all-gather."""
    rank, world = group_rank_size(group)
    xb, yb = x[:batch], y[:batch]
    throttle = _Throttle(slowdown)
    for _ in range(probe_steps + 1):  # forward and backward only: the probe must not train
        throttle.on_step_start(None)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        throttle.after_backward(None)
        throttle.on_step(None)
    median_s = sorted(throttle.step_s[1:])[probe_steps // 2]  # the first was a warm-up
    mine = torch.tensor([batch / median_s], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(every, mine, group=group)  # communication: every rank's speed
    else:
        every = [mine]
    return [t.item() for t in every]


def train_heterogeneous(
    job: Job,
    steps: int,
    *,
    slowdown: Sequence[float] | None = None,
    batches: str | Sequence[int] = "proportional",
    weighted: bool = True,
    probe_steps: int = 3,
    group=None,
) -> HeteroRun:
    """Rank function: SGD on ``job`` where rank r is ``slowdown[r]`` times slower on purpose.

    ``batches`` is "equal", "proportional" (to speeds measured over ``probe_steps`` throttled
    steps, all-gathered) or an explicit list. ``weighted=True`` scales each rank's summed loss by
    1 / global_batch and sums the gradients: the single-process update on the union batch.
    ``weighted=False`` averages the ranks' mean-loss gradients, as plain DDP does.
    """
    rank, world = group_rank_size(group)
    slowdown = _checked_slowdown(job, steps, slowdown, world)
    x, y = job.data()
    model = job.model()
    broadcast_parameters(model, group=group)  # every rank starts from the same weights
    speeds: list[float] = []
    if batches == "proportional":  # every rank's samples per second, timed and all-gathered
        speeds = measure_speeds(model, x, y, max(1, job.global_batch // world), slowdown[rank],
                                probe_steps, group)  # fmt: skip
        split = proportional_batches(speeds, job.global_batch)
    else:  # "equal", or the sizes given
        split = _fixed_split(batches, world, job.global_batch)
    throttle = _Throttle(slowdown[rank])  # a slower processor, by spinning after each backward
    # weighted: each rank's loss is its summed loss / global batch, and the gradients are SUMMED;
    # unweighted: each rank's mean loss, and the gradients averaged, as plain DDP does
    sync = GradientAveraging(divide_by=1 if weighted else None)
    plan = union_batches(job.samples, split, rank, steps, job.seed, weighted)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    train_loop(model, opt, x, y, plan, sync=sync, callbacks=[throttle], group=group)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return HeteroRun(rank, split, speeds, throttle.step_s, state, job.global_batch)


def _checked_slowdown(job: Job, steps: int, slowdown, world: int) -> list[float]:
    check_steps(steps)
    slowdown = [1.0] * world if slowdown is None else [float(s) for s in slowdown]
    if len(slowdown) != world or any(not math.isfinite(s) or s < 1 for s in slowdown):
        raise ValueError(f"slowdown needs {world} factors >= 1, got {slowdown}")
    if job.momentum:
        raise ValueError("train_heterogeneous takes plain SGD steps: give the job momentum=0")
    return slowdown


def _fixed_split(batches, world: int, global_batch: int) -> list[int]:
    if batches == "equal":
        return equal_batches(global_batch, world)
    if isinstance(batches, str):
        raise ValueError(f"batches is 'equal', 'proportional' or a list, got {batches!r}")
    split = [int(b) for b in batches]
    if len(split) != world or sum(split) != global_batch or min(split) < 1:
        raise ValueError(f"batches {split} need {world} sizes >= 1 summing to {global_batch}")
    return split


def train_union_reference(job: Job, steps: int) -> dict[str, torch.Tensor]:
    """Single-process SGD on the same union batches: what :func:`train_heterogeneous` must equal."""
    x, y = job.data()
    model = job.model()
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    for batch in union_batches(job.samples, [job.global_batch], 0, steps, job.seed):
        loss = F.cross_entropy(model(x[batch.samples]), y[batch.samples])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
