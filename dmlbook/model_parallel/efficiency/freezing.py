"""Freezing layers: train only the top of a model, and measure what the frozen part stops costing.

Chapter 8 ("Achieving higher throughput and lower latency") freezes layers: fine-tuning often
updates only the last layers of a pre-trained model. A frozen parameter (``requires_grad=False``)
costs less in three ways, each measured by :func:`measure_freezing`:

- backward skips its weight-gradient product and allocates no ``.grad`` (gradient bytes);
- the optimizer keeps no state for it (Adam: two tensors the size of the parameter);
- if the frozen layers are a *prefix* of the model, nothing before the first trainable layer
  needs a gradient at all, so autograd records no graph there and saves none of its
  activations (bytes saved for backward, counted by ``recompute.SavedTensorMeter``).

Frozen layers in the *middle* lose only the first two: backward must still pass through them to
reach the trainable layers below, so they keep what their input gradient needs.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dmlbook.model_parallel.efficiency.layers import as_layers, layer_loss, run_layers
from dmlbook.model_parallel.recompute import SavedTensorMeter

__all__ = [
    "forward_frozen_prefix",
    "freeze",
    "freeze_first",
    "frozen_prefix_length",
    "measure_freezing",
]


def freeze(layers: Sequence[nn.Module], indices: Iterable[int]) -> list[nn.Parameter]:
    """Freeze the parameters of ``layers[i]`` for each ``i`` in ``indices`` and make every other
    layer's trainable; return the frozen parameters."""
    indices = set(indices)
    bad = sorted(i for i in indices if not 0 <= i < len(layers))
    if bad:
        raise ValueError(f"layer indices {bad} are not in a model of {len(layers)} layers")
    frozen = []
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            p.requires_grad_(i not in indices)
            if i in indices:
                frozen.append(p)
    return frozen


def freeze_first(layers: Sequence[nn.Module], k: int) -> list[nn.Parameter]:
    """Freeze ``layers[:k]``, the usual fine-tuning choice, and train the rest."""
    if not 0 <= k <= len(layers):
        raise ValueError(f"k must be in [0, {len(layers)}], got {k}")
    return freeze(layers, range(k))


def frozen_prefix_length(layers: Sequence[nn.Module]) -> int:
    """How many layers at the start have no trainable parameter."""
    for i, layer in enumerate(layers):
        if any(p.requires_grad for p in layer.parameters()):
            return i
    return len(layers)


def forward_frozen_prefix(layers: Sequence[nn.Module], x: torch.Tensor, k: int) -> torch.Tensor:
    """Run ``layers[:k]`` without autograd (no graph, nothing saved), then the rest as usual.

    With a frozen prefix and an input that needs no gradient, autograd would record nothing there
    anyway; ``no_grad`` says so explicitly, and guarantees it even if a prefix parameter was left
    trainable (that parameter then simply gets no gradient).
    """
    if not 0 <= k <= len(layers):
        raise ValueError(f"k must be in [0, {len(layers)}], got {k}")
    with torch.no_grad():
        x = run_layers(layers[:k], x)  # frozen: a plain tensor comes out, with no history
    return run_layers(layers[k:], x)


@dataclass
class FreezingCost:
    """What one training step costs with some layers frozen."""

    name: str
    frozen: tuple[int, ...]  # indices of the frozen layers
    trainable_params: int
    saved_bytes: int  # activation bytes autograd holds for backward at the end of forward
    grad_bytes: int  # bytes of the .grad tensors backward allocated
    optimizer_state_bytes: int  # bytes of Adam's state after one step
    step_s: float  # median time of a step (forward, backward, Adam), interleaved rounds


def _step(layers, optimizer, inputs, targets, prefix) -> None:
    optimizer.zero_grad(set_to_none=True)
    layer_loss(forward_frozen_prefix(layers, inputs, prefix), targets).backward()
    optimizer.step()
    if inputs.is_cuda:
        torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock


def measure_freezing(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    settings: Mapping[str, Sequence[int]],
    rounds: int = 5,
    warmup: int = 1,
    lr: float = 1e-3,
    clock: Callable[[], float] = time.perf_counter,
) -> list[FreezingCost]:
    """Train a copy of ``model`` per setting (name -> frozen layer indices of ``as_layers``):
    count saved-activation, gradient and Adam-state bytes of one step, and time steps.

    Timing interleaves the settings round by round (setting A, B, C, then A, B, C...), so a
    burst of load on a shared machine hits them all alike; ``step_s`` is the median. ``clock`` is
    wall time by default; with one intra-op thread the work is all on the calling thread, and
    ``time.thread_time`` (its CPU time) leaves out the moments it waited for a core (chapter 8).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    runs = {}
    for name, frozen in settings.items():
        copied = copy.deepcopy(model).train()
        layers = as_layers(copied)
        freeze(layers, frozen)
        trainable = [p for p in copied.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"setting {name!r} freezes every layer: nothing left to train")
        runs[name] = (copied, layers, torch.optim.Adam(trainable, lr=lr), tuple(sorted(frozen)))
    costs = {}
    for name, (copied, layers, optimizer, frozen) in runs.items():
        prefix = frozen_prefix_length(layers)
        weights = [*copied.parameters(), *copied.buffers()]
        with SavedTensorMeter(exclude=weights) as meter:
            loss = layer_loss(forward_frozen_prefix(layers, inputs, prefix), targets)
            saved = meter.current  # everything forward left for backward to use
            loss.backward()
        optimizer.step()
        grads = sum(p.grad.nbytes for p in copied.parameters() if p.grad is not None)
        state = sum(
            t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )
        trainable = sum(p.numel() for p in copied.parameters() if p.requires_grad)
        costs[name] = FreezingCost(name, frozen, trainable, saved, grads, state, float("nan"))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + rounds):
        for name, (_, layers, optimizer, _) in runs.items():
            if inputs.is_cuda:
                torch.cuda.synchronize()
            start = clock()
            _step(layers, optimizer, inputs, targets, frozen_prefix_length(layers))
            if round_ >= warmup:
                times[name].append(clock() - start)
    for name in runs:
        costs[name].step_s = statistics.median(times[name])
    return list(costs.values())
