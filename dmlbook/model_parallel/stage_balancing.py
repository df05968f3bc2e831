"""Balancing a pipeline: cut the layers where the slowest stage is as fast as it can be.

Chapter 7 ("Model-parallel training and serving workflows") balances the workload across stages.
A pipeline runs at the pace of its slowest stage: in the steady state one micro-batch leaves the
last stage every ``max(stage cost)`` seconds, so an even split by layer *count* of a model whose
layers differ in cost leaves the light stages waiting. Balancing is three steps:

1. measure each layer's cost: :func:`measure_layer_costs` (seconds of forward + backward on one
   micro-batch, median of repeats) or :func:`measure_layer_bytes` (what a stage holds per layer);
2. choose contiguous stages that minimise the largest stage cost: for 2 stages by trying every
   cut (:func:`best_two_stage_split`, what chapter 7 shows), for P stages by
   :func:`linear_partition`, the linear-partition dynamic program, exact.
   ``torch.distributed.pipelining`` has no balancer (the user names the split points);
   torchgpipe's and fairscale's ``balance_by_time`` and ``balance_by_size`` solve this problem
   with a block-partition heuristic that may miss the optimum. So the DP is checked against brute
   force and against a second, independent method, :func:`partition_by_bisection` (binary search
   on the bottleneck with a greedy feasibility test);
3. predict what the split buys: :func:`stage_costs`, and :func:`pipeline_time` for a pipeline of
   M micro-batches.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dmlbook.model_parallel.recompute import SavedTensorMeter

__all__ = [
    "best_two_stage_split",
    "linear_partition",
    "measure_layer_bytes",
    "measure_layer_costs",
    "partition_by_bisection",
    "pipeline_time",
    "stage_costs",
]


# ---- Measuring what each layer costs ---------------------------------------------------------


def _layer_inputs(layers: Sequence[nn.Module], sample_input: torch.Tensor) -> list[torch.Tensor]:
    """The real input of every layer: the sample, then each layer's output in turn."""
    inputs, h = [], sample_input
    with torch.no_grad():
        for layer in layers:
            inputs.append(h)
            h = layer(h)
    return inputs


def _forward_backward(layer: nn.Module, x: torch.Tensor, input_grad: bool = True) -> None:
    """One forward and one backward of ``layer`` alone, as a pipeline stage runs it: gradients for
    the parameters and, where ``input_grad`` (every layer but the first, whose input is the data)
    and the input is not token ids, for the input. ``autograd.grad`` leaves ``.grad`` alone."""
    x = x.detach().requires_grad_(input_grad and x.is_floating_point())
    out = layer(x)
    wrt = [x] if x.requires_grad else []
    wrt += [p for p in layer.parameters() if p.requires_grad]
    if wrt:
        torch.autograd.grad(out, wrt, torch.ones_like(out))


def measure_layer_costs(
    layers: Sequence[nn.Module],
    sample_input: torch.Tensor,
    repeats: int = 7,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds of forward + backward of each layer on ``sample_input`` (one micro-batch), the
    median of ``repeats`` timings. Each layer gets its real input (the previous layer's output),
    and the repeats go round the layers in turn, so a noisy moment hits every layer alike. The
    first layer computes no input gradient: its input is the data, as on the first stage.
    ``clock``: wall time by default; ``time.thread_time`` counts only the CPU time the thread
    used (with one compute thread, the layer's own work even when other work holds the cores)."""
    if not layers:
        raise ValueError("need at least one layer to measure")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    inputs = _layer_inputs(layers, sample_input)
    timings: list[list[float]] = [[] for _ in layers]
    for round_ in range(warmup + repeats):
        for index, (layer, x, samples) in enumerate(zip(layers, inputs, timings, strict=True)):
            start = clock()
            _forward_backward(layer, x, input_grad=index > 0)
            if round_ >= warmup:
                samples.append(clock() - start)
    return [statistics.median(samples) for samples in timings]


def measure_layer_bytes(
    layers: Sequence[nn.Module], sample_input: torch.Tensor, copies_of_parameters: int = 2
) -> list[int]:
    """Bytes each layer makes its stage hold: ``copies_of_parameters`` x its parameter bytes (2:
    weights and gradients; 4 with Adam's two moments) plus the activations its forward saves for
    backward on ``sample_input`` (one micro-batch), counted by chapter 4's SavedTensorMeter over
    one forward of all the layers: a tensor that two layers save (a ReLU's output is also the
    next Linear's input) counts once, for the layer that saved it first."""
    if not layers:
        raise ValueError("need at least one layer to measure")
    params = [p for layer in layers for p in layer.parameters()]
    buffers = [b for layer in layers for b in layer.buffers()]
    saved_by_layer = []
    with torch.enable_grad(), SavedTensorMeter(exclude=[*params, *buffers]) as meter:
        h = sample_input
        for layer in layers:
            before = meter.current
            h = layer(h)
            saved_by_layer.append(meter.current - before)
    del h  # the graph goes, and with it what it saved
    return [
        copies_of_parameters * sum(p.numel() * p.element_size() for p in layer.parameters()) + saved
        for layer, saved in zip(layers, saved_by_layer, strict=True)
    ]


# ---- Choosing the stages ----------------------------------------------------------------------


def _check(costs: Sequence[float], stages: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an integer >= 1, got {stages!r}")
    if not costs:
        raise ValueError("costs is empty: there are no layers to partition")
    if stages > len(costs):
        raise ValueError(
            f"cannot split {len(costs)} layers into {stages} stages: every stage needs a layer"
        )
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"costs must be finite and >= 0, got {list(costs)}")


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """The cost of each stage: the sum of its layers' costs, ``counts[s]`` layers for stage s."""
    if sum(counts) != len(costs) or any(c < 1 for c in counts):
        raise ValueError(
            f"counts {list(counts)} must be positive and sum to the {len(costs)} layers"
        )
    totals, start = [], 0
    for count in counts:
        totals.append(sum(costs[start : start + count]))  # left to right, as the DP adds
        start += count
    return totals


def best_two_stage_split(costs: Sequence[float]) -> list[int]:
    """Layers per stage of the best split into 2 stages: try every cut, keep the one whose
    slower stage is fastest. (P stages have C(n - 1, P - 1) cuts: :func:`linear_partition`.)"""
    _check(costs, 2)
    n = len(costs)
    cuts = [[k, n - k] for k in range(1, n)]  # k layers on stage 0, the rest on stage 1
    return min(cuts, key=lambda counts: max(stage_costs(costs, counts)))


def linear_partition(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage (contiguous, each >= 1) that make the largest stage cost as small as it can
    be: the linear-partition dynamic program, O(n^2 P) for n layers and P stages (chapter 7's
    exercise 1 writes it). ``best[s][j]`` is the smallest bottleneck with which the first j layers
    fit on s stages.
    """
    _check(costs, stages)
    n = len(costs)
    # span[i][j]: cost of layers i..j-1, added left to right exactly as stage_costs adds them.
    span = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        for j in range(i + 1, n + 1):
            span[i][j] = span[i][j - 1] + costs[j - 1]
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    last_start = [[0] * (n + 1) for _ in range(stages + 1)]  # where the last stage begins
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        # s stages hold at least s layers and leave at least one for each later stage.
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                bottleneck = max(best[s - 1][i], span[i][j])
                if bottleneck < best[s][j]:
                    best[s][j], last_start[s][j] = bottleneck, i
    counts, end = [], n
    for s in range(stages, 0, -1):  # walk the choices back from the last stage
        start = last_start[s][end]
        counts.append(end - start)
        end = start
    return counts[::-1]


def _stages_needed(costs: Sequence[float], limit: float) -> int | None:
    """Greedy: fill each stage while its cost stays <= limit. None if one layer exceeds limit."""
    needed, load = 1, 0.0
    for cost in costs:
        if cost > limit:
            return None
        if load + cost > limit:
            needed, load = needed + 1, 0.0
        load += cost
    return needed


def partition_by_bisection(costs: Sequence[float], stages: int) -> list[int]:
    """The same optimum by another road: binary search for the smallest bottleneck that greedy
    packing fits in ``stages`` stages. The optimum is the cost of some run of layers, so the
    search runs over those sums and is exact. Then the greedy packing at that limit is cut
    further (never raising a stage's cost: costs are >= 0) until there are ``stages`` stages."""
    _check(costs, stages)
    n = len(costs)
    candidates = sorted({sum(costs[i:j]) for i in range(n) for j in range(i + 1, n + 1)})
    low, high = 0, len(candidates) - 1  # candidates[high], the total, always fits on one stage
    while low < high:
        mid = (low + high) // 2
        needed = _stages_needed(costs, candidates[mid])
        if needed is not None and needed <= stages:
            high = mid
        else:
            low = mid + 1
    limit = candidates[low]
    counts, load = [0], 0.0
    for cost in costs:
        if counts[-1] and load + cost > limit:
            counts.append(0)
            load = 0.0
        counts[-1] += 1
        load += cost
    while len(counts) < stages:  # split the last stage that has more than one layer
        s = max(i for i, c in enumerate(counts) if c > 1)
        counts[s : s + 1] = [counts[s] - 1, 1]
    return counts


def pipeline_time(per_stage: Sequence[float], microbatches: int) -> float:
    """Time for ``microbatches`` equal micro-batches to cross stages that take ``per_stage[s]``
    each, fill included, with no communication cost (chapter 7's exercise 2 derives it). For a
    GPipe training step pass forward + backward costs (exact when backward / forward is the same
    ratio on every stage)."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if not per_stage:
        raise ValueError("need at least one stage")
    return sum(per_stage) + (microbatches - 1) * max(per_stage)
