"""Advanced speed-ups: see where a step's time goes, then share, move and balance the ranks.

Chapter 12 ("Advanced techniques for further speed-ups") uses this module for four ideas:

1. **Profile a data-parallel step.** :func:`profile_data_parallel` runs a few training steps of
   chapter 3's :class:`~dmlbook.data_parallel.BucketedDDP`, its :class:`NaiveDDP` or torch's
   DDP under ``torch.profiler`` on every rank and writes one Chrome/Perfetto trace file per rank
   (``prof.export_chrome_trace``; open it in https://ui.perfetto.dev or ``chrome://tracing``).
   :func:`analyse_trace` then reads the trace back and splits each step's wall time into
   computation (the ``aten::``/autograd ops of the training thread), communication that no
   computation hid, and the rest (Python between ops, waiting on a future). On the CPU with gloo
   (found by experiment, torch 2.13) a collective shows twice: ``c10d::allreduce_`` on the
   training thread, which only enqueues it (often from a gradient hook inside backward, so its
   time is cut out of the enclosing ops), and ``gloo:all_reduce`` on gloo's worker thread, from
   the moment the worker starts it until it completes, waiting for the peers included.
2. **Overlap.** How much of the all-reduce time ran while backward was still computing: the
   length of (communication intervals) intersected with (backward intervals), over the length
   of the communication. Bucketed DDP starts a bucket's all-reduce inside backward; the naive
   one only after it, so its overlap is zero by construction. The interval arithmetic
   (:func:`union`, :func:`intersection`, :func:`difference`, :func:`overlap_fraction`) is plain
   Python, tested on hand-made intervals.
3. **Multiplexing and migration** (as in Gandiva, Xiao et al. OSDI 2018). :func:`run_multiplexed`
   lets two data-parallel jobs share the same ranks by time slices: each keeps its model and
   optimizer, and they take turns, ``slice_steps`` steps at a time. :func:`train_job` trains one
   job on however many ranks it is launched with, saving and resuming with chapter 3's
   :mod:`dmlbook.data_parallel.checkpoint`; launched again on fewer ranks, the job has migrated.
   Because the global batch and its order do not depend on the world size, both equal training the
   job alone.
4. **Heterogeneous workers.** :func:`train_heterogeneous` throttles ranks on purpose (after
   computing, a rank spins for ``slowdown - 1`` times as long), measures each rank's speed, and
   gives each a share of the global batch in proportion to it (:func:`proportional_batches`).
   Each rank scales its summed loss by ``1 / global_batch`` and the gradients are *summed*, so the
   update is exactly the single-process one on the union batch (:func:`train_union_reference`);
   plain averaging of unequal batches weights the small batch's samples more, and is wrong.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile, record_function

from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel import (
    Batch,
    BucketedDDP,
    Callback,
    GradientAveraging,
    LoopState,
    NaiveDDP,
    broadcast_parameters,
    checkpoint,
    strided_batches,
    train_loop,
)
from dmlbook.datasets import make_classification
from dmlbook.models import mlp

__all__ = [
    "STEP",
    "WRAPPERS",
    "Interval",
    "union",
    "length",
    "intersection",
    "difference",
    "overlap_fraction",
    "is_communication",
    "is_backward",
    "StepProfile",
    "load_trace",
    "analyse_trace",
    "profile_data_parallel",
    "Job",
    "JobRun",
    "MultiplexRun",
    "run_alone",
    "run_multiplexed",
    "train_job",
    "job_reference",
    "proportional_batches",
    "equal_batches",
    "HeteroRun",
    "union_batches",
    "train_heterogeneous",
    "train_union_reference",
]

Interval = tuple[float, float]
STEP = "dmlbook.step"  # the record_function name that marks one training step in a trace
WRAPPERS = ("bucketed", "naive", "torch")
_COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"


# --------------------------------------------------------------------------- 1. intervals


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The same time covered by sorted, disjoint intervals (touching ones merged)."""
    merged: list[list[float]] = []
    for start, end in sorted(_checked(intervals)):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _checked(intervals: Iterable[Interval]) -> list[Interval]:
    out = []
    for interval in intervals:
        if len(interval) != 2:
            raise ValueError(f"an interval is (start, end), got {interval!r}")
        start, end = float(interval[0]), float(interval[1])
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"interval {interval!r} must be finite with start <= end")
        out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total time covered, each moment counted once."""
    return sum(end - start for start, end in union(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by both ``a`` and ``b``, as disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:  # the one that ends first cannot meet anything later
            i += 1
        else:
            j += 1
    return out


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by ``a`` but not by ``b``."""
    out = []
    b = union(b)
    for start, end in union(a):
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def overlap_fraction(communication: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Share of the communication time that ran while ``compute`` did (0.0 if none ran)."""
    communication = union(communication)
    total = length(communication)
    return length(intersection(communication, compute)) / total if total > 0 else 0.0


# --------------------------------------------------------------------------- 1. traces


def is_communication(name: str) -> bool:
    """A collective's event: gloo's worker-thread span (``gloo:all_reduce``) or c10d's enqueue."""
    return name.startswith(_COMM_PREFIXES)


def is_backward(name: str) -> bool:
    """One autograd node's backward computation."""
    return name.startswith(_BACKWARD_PREFIX)


@dataclass
class StepProfile:
    """One rank's profiled steps, read from its trace; times in seconds, summed over the steps."""

    rank: int
    steps: int
    wall_s: float  # the steps' spans (the STEP annotations)
    compute_s: float  # the training thread's ops, each moment once
    communication_s: float  # collectives on any thread, each moment once
    exposed_communication_s: float  # communication while no op computed
    hidden_communication_s: float  # communication while backward computed
    other_s: float  # neither: Python, waiting on a future, the profiler itself
    # The intervals themselves, in µs of the trace's clock, for drawing a timeline:
    steps_at: list[Interval] = field(repr=False, default_factory=list)
    compute: list[Interval] = field(repr=False, default_factory=list)
    communication: list[Interval] = field(repr=False, default_factory=list)
    backward: list[Interval] = field(repr=False, default_factory=list)
    trace_path: str = ""

    @property
    def overlap(self) -> float:
        """Share of the communication time hidden by backward."""
        return self.hidden_communication_s / self.communication_s if self.communication_s else 0.0

    def breakdown(self, per_step: bool = True) -> dict[str, float]:
        """compute + exposed communication + other = wall time (per step, in ms by default)."""
        scale = 1e3 / self.steps if per_step else 1.0
        return {
            "compute": self.compute_s * scale,
            "exposed communication": self.exposed_communication_s * scale,
            "other": self.other_s * scale,
        }


def load_trace(path: str | os.PathLike) -> dict:
    """A Chrome trace file as written by ``prof.export_chrome_trace``, checked for events."""
    with open(path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace: no traceEvents list")
    return trace


def analyse_trace(trace: dict | str | os.PathLike, step_name: str = STEP) -> StepProfile:
    """Split the ``step_name`` spans of one rank's trace into compute, communication and the rest.

    Events are the complete ("X") events; the training thread is the one that recorded the step
    annotations. Communication is every collective event (any thread); computation is that
    thread's ``cpu_op`` events, less the time spent inside collectives they enclose (c10d's
    enqueue, called from a gradient hook inside backward). Both are clipped to the steps.
    """
    path = ""
    if not isinstance(trace, dict):
        path, trace = str(trace), load_trace(trace)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name") == step_name]
    if not steps:
        raise ValueError(f"the trace has no {step_name!r} event: mark steps with record_function")
    thread = steps[0]["tid"]

    def span(e: dict) -> Interval:
        return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))

    wall = union(span(e) for e in steps)
    comm = intersection([span(e) for e in events if is_communication(e["name"])], wall)
    ops = [e for e in events if e.get("tid") == thread and e.get("cat") == "cpu_op"]
    # c10d's enqueue runs inside a gradient hook, inside backward's AccumulateGrad node: its
    # time is communication, so it is cut out of the enclosing ops.
    enqueue = [span(e) for e in ops if is_communication(e["name"])]
    computing = [span(e) for e in ops if not is_communication(e["name"])]
    compute = difference(intersection(computing, wall), enqueue)
    backward = difference(
        intersection([span(e) for e in ops if is_backward(e["name"])], wall), enqueue
    )
    us = 1e-6
    busy = length(compute + comm)
    return StepProfile(
        rank=int(trace.get("distributedInfo", {}).get("rank", 0)),
        steps=len(steps),
        wall_s=length(wall) * us,
        compute_s=length(compute) * us,
        communication_s=length(comm) * us,
        exposed_communication_s=length(difference(comm, compute)) * us,
        hidden_communication_s=length(intersection(comm, backward)) * us,
        other_s=(length(wall) - busy) * us,
        steps_at=wall,
        compute=compute,
        communication=comm,
        backward=backward,
        trace_path=path,
    )


def _wrap(model: nn.Module, wrapper: str, bucket_cap_mb: float, group) -> nn.Module:
    if wrapper == "bucketed":
        return BucketedDDP(model, bucket_cap_mb=bucket_cap_mb, group=group)
    if wrapper == "naive":
        return NaiveDDP(model, group=group)
    return TorchDDP(model, bucket_cap_mb=bucket_cap_mb, process_group=group)


def profile_data_parallel(
    wrapper: str = "bucketed",
    *,
    trace_dir: str | os.PathLike,
    steps: int = 3,
    warmup: int = 2,
    batch: int = 256,
    in_features: int = 256,
    hidden: Sequence[int] = (512, 512, 512),
    bucket_cap_mb: float = 0.5,
    seed: int = 0,
    group=None,
) -> StepProfile:
    """Rank function: profile ``steps`` data-parallel SGD steps of an MLP under ``wrapper``
    ("bucketed", "naive" or "torch"), write ``<trace_dir>/<wrapper>-rank<r>.json`` and analyse it.

    A barrier before each step (outside the step's span) keeps one rank's late start from being
    counted as the others' communication.
    """
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {wrapper!r}")
    if steps < 1 or warmup < 0 or batch < 1:
        raise ValueError(f"steps={steps} >= 1, warmup={warmup} >= 0 and batch={batch} >= 1")
    rank, world = group_rank_size(group)
    if world < 2:
        raise ValueError("profile_data_parallel needs a process group of at least 2 ranks")
    model = _wrap(
        mlp(seed, in_features=in_features, hidden=tuple(hidden)), wrapper, bucket_cap_mb, group
    )
    g = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own shard
    x, y = torch.randn(batch, in_features, generator=g), torch.randint(0, 10, (batch,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        loss = F.cross_entropy(model(x), y)  # compute
        opt.zero_grad(set_to_none=True)
        loss.backward()  # compute, and the DDP wrapper's communication
        opt.step()

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier(group=group)
            with record_function(STEP):
                step()
    path = Path(trace_dir) / f"{wrapper}-rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return analyse_trace(path)


# --------------------------------------------------------------------------- 3. jobs


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


def _check_steps(steps: int, slice_steps: int = 1) -> None:
    if steps < 1 or slice_steps < 1:
        raise ValueError(f"steps={steps} and slice_steps={slice_steps} must be >= 1")


def run_alone(job: Job, steps: int, group=None) -> JobRun:
    """Rank function: train ``job`` for ``steps`` steps with the ranks to itself."""
    _check_steps(steps)
    state = _JobState(job, group)
    _barrier(group)
    start = time.perf_counter()
    state.train(steps)
    elapsed = time.perf_counter() - start
    return JobRun(
        job.name, state.world, steps, steps * job.global_batch, elapsed, state.state(), state.losses
    )


def run_multiplexed(
    jobs: Sequence[Job], steps: int, slice_steps: int = 5, group=None
) -> MultiplexRun:
    """Rank function: ``jobs`` take turns on the same ranks, ``slice_steps`` steps each, until
    each has trained ``steps`` steps. Each job's throughput is its samples over the shared wall
    time: with two equal jobs, about half of what it gets alone."""
    _check_steps(steps, slice_steps)
    names = [job.name for job in jobs]
    if not jobs or len(set(names)) != len(names):
        raise ValueError(f"run_multiplexed needs jobs with distinct names, got {names}")
    states = [_JobState(job, group) for job in jobs]
    slices = []
    _barrier(group)
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


def _barrier(group=None) -> None:
    if group_rank_size(group)[1] > 1:
        dist.barrier(group=group)


def train_job(job: Job, steps: int, checkpoint_dir: str | os.PathLike, group=None) -> JobRun:
    """Rank function: train ``job`` until global step ``steps``, resuming from the latest
    checkpoint in ``checkpoint_dir`` if there is one (saved at any world size), and checkpoint
    at the end. Launched again on fewer ranks with a larger ``steps``, the job has migrated."""
    _check_steps(steps)
    state = _JobState(job, group)
    resumed_from = None
    if (path := checkpoint.latest(checkpoint_dir)) is not None:
        with warnings.catch_warnings():  # another world size: no RNG is drawn here anyway
            warnings.simplefilter("ignore", RuntimeWarning)
            loaded = checkpoint.load(path, model=state.model, optimizer=state.opt, group=group)
        if loaded.extra.get("job") != job.name:
            raise ValueError(f"{path} holds job {loaded.extra.get('job')!r}, not {job.name!r}")
        state.step = resumed_from = loaded.progress.step
        if state.step > steps:
            raise ValueError(f"{path} is already at step {state.step}, past steps={steps}")
    _barrier(group)
    start = time.perf_counter()
    state.train(steps - state.step)
    elapsed = time.perf_counter() - start
    epoch, t = divmod(state.step, state.steps_per_epoch)
    progress = checkpoint.Progress(epoch, t, state.step)
    checkpoint.save(
        checkpoint.checkpoint_path(checkpoint_dir, state.step),
        model=state.model,
        optimizer=state.opt,
        progress=progress,
        extra={"job": job.name},
        group=group,
    )
    done = steps - (resumed_from or 0)
    return JobRun(
        job.name,
        state.world,
        done,
        done * job.global_batch,
        elapsed,
        state.state(),
        state.losses,
        resumed_from,
    )


def job_reference(job: Job, steps: int) -> dict[str, torch.Tensor]:
    """The job trained single-process, outside any process group: the exactness reference."""
    if group_rank_size()[1] != 1:
        raise RuntimeError("job_reference runs outside a process group (world size 1)")
    return run_alone(job, steps).state


# --------------------------------------------------------------------------- 4. heterogeneity


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
    caches. It also times each whole step."""

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
) -> Iterable[Batch]:
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
        yield Batch(epoch, t, part, last_in_epoch=t + 1 == per_epoch, offset=t * global_batch,
                    global_size=global_batch if weighted else None)  # fmt: skip


def _probe_speeds(job: Job, model: nn.Module, x, y, slowdown: float, probe_steps: int, group):
    """Every rank's samples per second, each measured over ``probe_steps`` throttled backward
    passes (after a warm-up), then all-gathered."""
    rank, world = group_rank_size(group)
    batch = max(1, job.global_batch // world)
    probe = [Batch(0, 0, range(batch))] * (probe_steps + 1)
    throttle = _Throttle(slowdown)
    no_step = torch.optim.SGD(model.parameters(), lr=0.0)  # the probe must not train
    train_loop(model, no_step, x, y, probe, sync=_NoSync(), callbacks=[throttle], group=group)
    median_s = sorted(throttle.step_s[1:])[probe_steps // 2]  # the first was a warm-up
    mine = torch.tensor([batch / median_s], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(every, mine, group=group)  # communication: every rank's speed
    else:
        every = [mine]
    return [t.item() for t in every]


class _NoSync:
    """No synchronisation: each rank on its own (the speed probe)."""

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        pass

    after_step = finish = after_backward


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
    _check_steps(steps)
    rank, world = group_rank_size(group)
    slowdown = [1.0] * world if slowdown is None else [float(s) for s in slowdown]
    if len(slowdown) != world or any(not math.isfinite(s) or s < 1 for s in slowdown):
        raise ValueError(f"slowdown needs {world} factors >= 1, got {slowdown}")
    if job.momentum:
        raise ValueError("train_heterogeneous takes plain SGD steps: give the job momentum=0")
    B = job.global_batch
    x, y = job.data()
    model = job.model()
    broadcast_parameters(model, group=group)
    speeds: list[float] = []
    if batches == "equal":
        split = equal_batches(B, world)
    elif batches == "proportional":
        speeds = _probe_speeds(job, model, x, y, slowdown[rank], probe_steps, group)
        split = proportional_batches(speeds, B)
    elif isinstance(batches, str):
        raise ValueError(f"batches is 'equal', 'proportional' or a list, got {batches!r}")
    else:
        split = [int(b) for b in batches]
        if len(split) != world or sum(split) != B or min(split) < 1:
            raise ValueError(f"batches {split} need {world} sizes >= 1 summing to {B}")
    throttle = _Throttle(slowdown[rank])
    # weighted, the sum of the ranks' gradients is the answer; else their mean, as plain DDP
    sync = GradientAveraging(divide_by=1 if weighted else None)
    plan = union_batches(job.samples, split, rank, steps, job.seed, weighted)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    train_loop(model, opt, x, y, plan, sync=sync, callbacks=[throttle], group=group)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return HeteroRun(rank, split, speeds, throttle.step_s, state, B)


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
