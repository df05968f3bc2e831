"""Profile a data-parallel step: per-rank traces split into compute and exposed communication
(chapter 12, idea 1 and 2; see :mod:`dmlbook.advanced.speedups`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile, record_function

from dmlbook.advanced.speedups.intervals import (
    Interval,
    difference,
    intersection,
    length,
    union,
)
from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel import (
    BucketedDDP,
    NaiveDDP,
)
from dmlbook.models import mlp

STEP = "dmlbook.step"  # the record_function name that marks one training step in a trace
WRAPPERS = ("bucketed", "naive", "torch")
_COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"


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

    def step_spans(self, index: int = 0) -> dict[str, list[Interval]]:
        """Step ``index``'s compute, backward, all-reduce and hidden (all-reduce and backward at
        once) intervals, in µs since that step began: one step of the timeline, for drawing."""
        step = [self.steps_at[index]]
        t0 = step[0][0]

        def clip(spans: list[Interval]) -> list[Interval]:
            return [(s - t0, e - t0) for s, e in intersection(spans, step)]

        return {
            "compute": clip(self.compute),
            "backward": clip(self.backward),
            "all-reduce": clip(self.communication),
            "hidden": clip(intersection(self.backward, self.communication)),
        }

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


def trace_steps(step: Callable[[], None], steps: int, path: str | os.PathLike, group=None) -> None:
    """Run ``step()`` ``steps`` times under ``torch.profiler``, each call marked as one
    ``STEP`` span, and write this rank's trace to ``path`` (Chrome trace-event JSON)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # records every operator's span
        for _ in range(steps):
            dist.barrier(group=group)  # outside the span: a late peer is not our communication
            with record_function(STEP):  # the span that analyse_trace splits
                step()
    prof.export_chrome_trace(str(path))  # one file per rank


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
    path = Path(trace_dir) / f"{wrapper}-rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with _without_profiler_banners():
        trace_steps(step, steps, path, group=group)
    return analyse_trace(path)


@contextlib.contextmanager
def _without_profiler_banners():
    """Drop the ``USDT: ... profiler_start`` / ``profiler_stop`` lines that torch's profiler
    library writes to stderr at each start and stop (no log level turns them off); any other
    line written to stderr meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [ln for ln in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not ln.startswith("USDT:")]  # fmt: skip
            sys.stderr.write("".join(kept))
