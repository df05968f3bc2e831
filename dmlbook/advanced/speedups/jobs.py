"""Jobs that share ranks by time slices, and jobs that migrate between world sizes (chapter 12,
idea 3; see :mod:`dmlbook.advanced.speedups`)."""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.data_parallel import (
    broadcast_parameters,
    checkpoint,
    strided_batches,
    train_loop,
)
from dmlbook.datasets import make_classification
from dmlbook.models import mlp


@dataclass(frozen=True)
class Job:
    """A small data-parallel training job: an MLP on Gaussian blobs, SGD with momentum."""

    name: str
    seed: int = 0  # the model's initial weights, the data, the order of the batches
    samples: int = 512
    features: int = 32
    hidden: tuple[int, ...] = (64,)
    classes: int = 4
    global_batch: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.global_batch > self.samples:
            raise ValueError(
                f"job {self.name!r}: global_batch={self.global_batch} must be in 1..{self.samples}"
            )

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = make_classification(self.samples, self.features, self.classes, seed=self.seed)
        return x.to(self.dtype), y

    def model(self) -> nn.Module:
        return mlp(
            self.seed, in_features=self.features, hidden=self.hidden, out_features=self.classes
        ).to(self.dtype)


class _JobState:
    """One job's model, optimizer and position on this rank: what a time slice resumes."""

    def __init__(self, job: Job, group=None) -> None:
        self.job, self.group = job, group
        self.rank, self.world = group_rank_size(group)
        if job.global_batch % self.world:
            raise ValueError(
                f"job {job.name!r}: global_batch={job.global_batch} is not a multiple of the "
                f"world size {self.world}"
            )
        self.x, self.y = job.data()
        self.model = job.model()
        broadcast_parameters(self.model, group=group)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=job.lr, momentum=job.momentum)
        self.step = 0
        self.losses: list[float] = []

    @property
    def steps_per_epoch(self) -> int:
        return self.job.samples // self.job.global_batch

    def train(self, steps: int) -> None:
        """``steps`` more steps of chapter 1's loop, from where the job stopped (the global batch
        is world-size independent)."""
        epochs = -(-(self.step + steps) // self.steps_per_epoch)
        batches = strided_batches(self.job.samples, self.job.global_batch, rank=self.rank,
                                  world_size=self.world, epochs=epochs, seed=self.job.seed,
                                  start=divmod(self.step, self.steps_per_epoch))  # fmt: skip
        batches = itertools.islice(batches, steps)
        done = train_loop(self.model, self.opt, self.x, self.y, batches, step=self.step,
                          group=self.group)  # fmt: skip
        self.step = done.step
        self.losses += done.losses

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@dataclass
class JobRun:
    """What one job did on this rank: its final weights and how fast it went."""

    name: str
    world_size: int
    steps: int  # steps this run trained (not counting those before a resume)
    samples: int  # global samples those steps processed
    train_s: float  # wall time of those steps
    state: dict[str, torch.Tensor] = field(repr=False)
    losses: list[float] = field(repr=False, default_factory=list)
    resumed_from: int | None = None  # global step of the checkpoint it resumed from

    @property
    def throughput(self) -> float:
        """Global samples per second of wall time."""
        return self.samples / self.train_s if self.train_s > 0 else float("nan")


@dataclass
class MultiplexRun:
    """Jobs that shared the ranks by time slices: each job's run, and the slices in order."""

    jobs: list[JobRun]
    wall_s: float
    slices: list[tuple[str, float, float]] = field(repr=False)  # (job, start, end), from 0 s

    @property
    def throughput(self) -> float:
        """All jobs' samples per second of the shared wall time."""
        return sum(j.samples for j in self.jobs) / self.wall_s


def check_steps(steps: int, slice_steps: int = 1) -> None:
    """A ValueError unless ``steps`` and ``slice_steps`` are at least 1."""
    if steps < 1 or slice_steps < 1:
        raise ValueError(f"steps={steps} and slice_steps={slice_steps} must be >= 1")


def run_alone(job: Job, steps: int, group=None) -> JobRun:
    """Rank function: train ``job`` for ``steps`` steps with the ranks to itself."""
    check_steps(steps)
    state = _JobState(job, group)
    barrier(group)
    start = time.perf_counter()
    state.train(steps)
    elapsed = time.perf_counter() - start
    return JobRun(
        job.name, state.world, steps, steps * job.global_batch, elapsed, state.state(), state.losses
    )


def _check_jobs(jobs: Sequence[Job], steps: int, slice_steps: int) -> None:
    check_steps(steps, slice_steps)
    names = [job.name for job in jobs]
    if not jobs or len(set(names)) != len(names):
        raise ValueError(f"run_multiplexed needs jobs with distinct names, got {names}")


def run_multiplexed(
    jobs: Sequence[Job], steps: int, slice_steps: int = 5, group=None
) -> MultiplexRun:
    """Rank function: ``jobs`` take turns on the same ranks, ``slice_steps`` steps each, until
    each has trained ``steps`` steps. Each job's throughput is its samples over the shared wall
    time: with two equal jobs, about half of what it gets alone."""
    _check_jobs(jobs, steps, slice_steps)
    states = [_JobState(job, group) for job in jobs]  # every job's model and optimizer, in memory
    slices = []
    barrier(group)
    start = time.perf_counter()
    while any(s.step < steps for s in states):
        for s in states:
            if s.step < steps:
                t0 = time.perf_counter() - start
                s.train(min(slice_steps, steps - s.step))  # a context switch: the other job waits
                slices.append((s.job.name, t0, time.perf_counter() - start))
    wall = time.perf_counter() - start
    runs = [
        JobRun(s.job.name, s.world, steps, steps * s.job.global_batch, wall, s.state(), s.losses)
        for s in states
    ]
    return MultiplexRun(runs, wall, slices)


def train_job(job: Job, steps: int, checkpoint_dir: str | os.PathLike, group=None) -> JobRun:
    """Rank function: train ``job`` until global step ``steps``, resuming from the latest
    checkpoint in ``checkpoint_dir`` if there is one (saved at any world size), and checkpoint
    at the end. Launched again on fewer ranks with a larger ``steps``, the job has migrated."""
    check_steps(steps)
    state = _JobState(job, group)  # a fresh model and optimizer on however many ranks run this
    resumed_from = None
    if (path := checkpoint.latest(checkpoint_dir)) is not None:  # the job ran before: resume
        resumed_from = state.step = _resume(state, path, steps)
    barrier(group)
    start = time.perf_counter()
    state.train(steps - state.step)  # the same global batches as if it had never stopped
    elapsed = time.perf_counter() - start
    epoch, t = divmod(state.step, state.steps_per_epoch)
    checkpoint.save(  # model, optimizer and position: all another world size needs to go on
        checkpoint.checkpoint_path(checkpoint_dir, state.step),
        model=state.model,
        optimizer=state.opt,
        progress=checkpoint.Progress(epoch, t, state.step),
        extra={"job": job.name},
        group=group,
    )
    done = steps - (resumed_from or 0)
    return JobRun(job.name, state.world, done, done * job.global_batch, elapsed, state.state(),
                  state.losses, resumed_from)  # fmt: skip


def _resume(state: _JobState, path, steps: int) -> int:
    """Load ``path`` into ``state``'s model and optimizer; returns the step it was saved at."""
    with warnings.catch_warnings():  # another world size: no RNG is drawn here anyway
        warnings.simplefilter("ignore", RuntimeWarning)
        loaded = checkpoint.load(path, model=state.model, optimizer=state.opt, group=state.group)
    if loaded.extra.get("job") != state.job.name:
        raise ValueError(f"{path} holds job {loaded.extra.get('job')!r}, not {state.job.name!r}")
    if loaded.progress.step > steps:
        raise ValueError(f"{path} is already at step {loaded.progress.step}, past steps={steps}")
    return loaded.progress.step


def job_reference(job: Job, steps: int) -> dict[str, torch.Tensor]:
    """The job trained single-process, outside any process group: the exactness reference."""
    if group_rank_size()[1] != 1:
        raise RuntimeError("job_reference runs outside a process group (world size 1)")
    return run_alone(job, steps).state
