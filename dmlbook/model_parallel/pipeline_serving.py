"""Model-parallel serving: a stream of requests through pipeline stages that overlap (chapter 7).

Chapter 7 ("Model-parallel training and serving workflows") ends by serving the model it
fine-tuned. :func:`serve_pipelined` is a *rank function* for ``dmlbook.launch.run(fn, P, ...)``:
rank s builds the whole model, keeps stage s (chapter 6's layer split,
:mod:`dmlbook.model_parallel.layer_split`) and runs it forward only
(:meth:`dmlbook.model_parallel.pipeline.PipelineStage.infer`). ``in_flight`` requests enter the
pipeline together as micro-batches, so that stage 1 works on one request while stage 0 already
works on the next (1: one at a time, no overlap). :func:`serve_reference` is one process answering
them one by one. Both report each request's latency and the stream's wall time
(:class:`ServeResult`), and the time the stage lost waiting for a CPU (:mod:`dmlbook.cpu_wait`).
:func:`completion_ticks` is the same stream on paper: when each request is answered when one
micro-batch moves one stage per tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.cpu_wait import cpu_wait_s
from dmlbook.model_parallel import pipeline as pp
from dmlbook.model_parallel.layer_split import stage_for_rank

__all__ = [
    "ServeResult",
    "completion_ticks",
    "on_cpu_clock",
    "serve_pipelined",
    "serve_reference",
    "serve_window",
]


@dataclass
class ServeResult:
    """What one stage (or the single process) saw while serving a stream of requests."""

    stage: int
    outputs: list[torch.Tensor] | None  # one output per request: last stage only
    latencies: list[float] | None  # seconds from a request's window start to its output
    total_s: float  # wall time for the whole stream
    timelines: list[list[pp.OpRecord]] = field(default_factory=list)  # one per window
    cpu_wait: float = 0.0  # seconds lost waiting for a CPU during the stream (see cpu_wait_s)
    op_cpu: list[list[float]] = field(default_factory=list)  # per window: each op's CPU seconds


def clock_ops_on_cpu(stage: pp.PipelineStage) -> list[float]:
    """Make ``stage`` record, op by op, the CPU time its thread used (``time.thread_time``: it
    stops while the thread sleeps in a receive or waits for a core, so under other load it is
    still the op's own work). Returns the list the times go to, in the order of the timeline."""
    cpu: list[float] = []
    for name in ("forward", "backward"):
        op = getattr(stage, name)

        def timed(mb: int, op=op) -> None:
            start = time.thread_time()
            op(mb)
            cpu.append(time.thread_time() - start)

        setattr(stage, name, timed)  # run_schedule calls self.forward / self.backward
    return cpu


def on_cpu_clock(
    timelines: Sequence[Sequence[pp.OpRecord]], op_cpu: Sequence[Sequence[float]]
) -> list[list[pp.OpRecord]]:
    """One step's (or window's) ops of every stage, each lasting its CPU time instead of its
    wall-clock time, all started at 0: what :func:`pp.packed_timelines` replays as the step the
    stages' own work alone would take, whatever else ran on the machine."""
    return [
        [pp.OpRecord(r.op, r.microbatch, 0.0, cpu) for r, cpu in zip(tl, cpus, strict=True)]
        for tl, cpus in zip(timelines, op_cpu, strict=True)
    ]


def completion_ticks(request_sizes: Sequence[int], microbatch_size: int, stages: int) -> list[int]:
    """Requests queue in order and their samples are cut into micro-batches of
    ``microbatch_size`` (the last may be short); micro-batch k is on stage s during tick k + s.
    Each request is answered when the micro-batch holding its last sample leaves the last stage:
    that tick, counting from 1, per request."""
    ticks, end = [], 0
    for size in request_sizes:
        end += size  # one past this request's last sample
        ticks.append((end - 1) // microbatch_size + stages)
    return ticks


def serve_window(stage: pp.PipelineStage, requests: Sequence[torch.Tensor]) -> pp.StepResult:
    """One window: ``requests`` enter the pipeline together, one micro-batch each. Stage 0 cuts
    their concatenation back into micro-batches and runs forward on each, sending each output on
    as soon as it is computed; stage s > 0 receives, computes, sends on; the last stage keeps the
    outputs. So stage 1 works on request i while stage 0 already works on request i + 1."""
    batch = torch.cat(list(requests)) if stage.is_first else None
    return stage.infer(batch, microbatches=len(requests))  # forward only, no backward


def _windows(n: int, in_flight: int) -> list[range]:
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    return [range(i, min(i + in_flight, n)) for i in range(0, n, in_flight)]


def _check_requests(requests: Sequence[torch.Tensor]) -> None:
    if not len(requests):
        raise ValueError("no requests to serve")
    shapes = {tuple(r.shape) for r in requests}
    if len(shapes) > 1:
        raise ValueError(
            f"every request must have the same shape to share micro-batches, got {sorted(shapes)}"
        )


def _logits(outputs):
    return outputs[0] if isinstance(outputs, tuple) else outputs


def serve_pipelined(
    model_fn: Callable[[], nn.Module],
    counts: Sequence[int] | None,
    requests: Sequence[torch.Tensor],
    in_flight: int = 1,
    group: dist.ProcessGroup | None = None,
) -> ServeResult:
    """Answer ``requests`` (equal shapes; each is one micro-batch) in arrival order through a
    pipeline: ``in_flight`` requests enter together, one micro-batch each, so stage 1 works on
    request i while stage 0 already works on request i + 1. ``in_flight=1`` sends one request at
    a time: no overlap. A request's latency runs from the start of its window (when it was taken
    up) to its output leaving the last stage."""
    _check_requests(requests)
    windows = _windows(len(requests), in_flight)
    rank, size = group_rank_size(group)
    model = model_fn().eval()
    module, _ = stage_for_rank(model, counts, rank, size)
    stage = pp.PipelineStage(module, rank, size, group=group)
    cpu = clock_ops_on_cpu(stage)
    outputs, latencies, timelines, op_cpu = [], [], [], []
    barrier(group)
    start, waited = time.perf_counter(), cpu_wait_s()
    for window in windows:
        result = serve_window(stage, [requests[i] for i in window])  # starts at a common t0
        timelines.append(result.timeline)
        op_cpu.append(list(cpu))
        cpu.clear()
        if stage.is_last:
            outputs += list(result.outputs.cpu().chunk(len(window)))
            latencies += [r.end for r in result.timeline]  # since the window's t0
    barrier(group)
    total = time.perf_counter() - start
    return ServeResult(
        stage=rank,
        outputs=outputs if stage.is_last else None,
        latencies=latencies if stage.is_last else None,
        total_s=total,
        timelines=timelines,
        cpu_wait=cpu_wait_s() - waited,
        op_cpu=op_cpu,
    )


@torch.no_grad()
def serve_reference(model: nn.Module, requests: Sequence[torch.Tensor]) -> ServeResult:
    """One process answers the requests one at a time: latency is one whole-model forward."""
    _check_requests(requests)
    model.eval()
    outputs, latencies = [], []
    start = time.perf_counter()
    for request in requests:
        taken_up = time.perf_counter()
        outputs.append(_logits(model(request)))
        latencies.append(time.perf_counter() - taken_up)
    return ServeResult(0, outputs, latencies, time.perf_counter() - start)
