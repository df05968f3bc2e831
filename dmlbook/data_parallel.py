"""Data parallelism the plain way: every rank holds the whole model and trains on a shard.

Chapter 1 ("Splitting input data") teaches it with these pieces:

* :func:`average_gradients` is synchronous SGD's model synchronisation: after backward, one
  all-reduce per parameter gradient, divided by the world size. Every rank then takes the same
  step, so the ranks stay identical without ever sending parameters.
* :class:`GradientAveraging` and :class:`ModelAveraging` are the two synchronisation schemes,
  behind one interface: average gradients every step, or let each rank take ``every`` local steps
  and then average the parameters (periodic model averaging, also called local SGD).
* :func:`train` is the training loop. It is the single-process loop plus one ``sync`` call; at
  world size 1, outside any process group, it *is* the single-process reference. Because
  :func:`~dmlbook.datasets.shard_indices` splits each epoch's permutation with a stride, the
  ranks' t-th local batches together are exactly the t-th global batch of the single-process run.
* :func:`linear_scaling` and :func:`warmup` are the learning-rate rules for a larger global batch
  (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

Chapter 3 puts a bucketed, overlapped ``DistributedDataParallel`` beside the naive version here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmlbook.datasets import shard_indices

__all__ = [
    "average_gradients",
    "average_parameters",
    "broadcast_parameters",
    "GradientAveraging",
    "ModelAveraging",
    "History",
    "train",
    "accuracy",
    "linear_scaling",
    "warmup",
]


def _world(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) outside any process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def average_gradients(model: nn.Module, group=None) -> None:
    """Replace each gradient by its mean over the ranks: one all-reduce per parameter (naive)."""
    _, world = _world(group)
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)  # communication
            p.grad /= world  # gloo has no AVG, so sum then divide


def average_parameters(model: nn.Module, group=None) -> None:
    """Replace each parameter by its mean over the ranks (model averaging)."""
    _, world = _world(group)
    if world == 1:
        return
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p, op=dist.ReduceOp.SUM, group=group)  # communication
            p /= world


def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank, so that all start identical."""
    if _world(group)[1] == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=src, group=group)  # communication


# --------------------------------------------------------------------------- sync schemes


@dataclass
class GradientAveraging:
    """Synchronous SGD: average the gradients after every backward pass."""

    rounds: int = 0  # how many times the ranks communicated
    floats_sent: int = 0  # how many numbers each rank contributed to all-reduces

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        if _world(group)[1] > 1:
            average_gradients(model, group)
            self.rounds += 1
            self.floats_sent += sum(p.numel() for p in model.parameters())

    def after_step(self, model: nn.Module, step: int, group=None) -> None:
        pass

    def finish(self, model: nn.Module, step: int, group=None) -> None:
        pass


@dataclass
class ModelAveraging:
    """Periodic model averaging: ``every`` local SGD steps, then average the parameters."""

    every: int = 1
    rounds: int = 0
    floats_sent: int = 0

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"ModelAveraging(every={self.every}): every must be >= 1")

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        pass

    def after_step(self, model: nn.Module, step: int, group=None) -> None:
        if (step + 1) % self.every == 0:
            self._average(model, group)

    def finish(self, model: nn.Module, step: int, group=None) -> None:
        if step % self.every != 0:  # local steps left since the last average: end in agreement
            self._average(model, group)

    def _average(self, model: nn.Module, group) -> None:
        if _world(group)[1] > 1:
            average_parameters(model, group)
            self.rounds += 1
            self.floats_sent += sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- training


@dataclass
class History:
    """What :func:`train` measured: per-step local loss and lr, test accuracy at evaluations."""

    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)  # wall time since training began
    accuracy: list[float] = field(default_factory=list)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    with torch.no_grad():
        return (model(x).argmax(dim=-1) == y).float().mean().item()


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    global_batch: int,
    lr: float | Callable[[int], float],
    epochs: int = 1,
    seed: int = 0,
    sync: GradientAveraging | ModelAveraging | None = None,
    momentum: float = 0.0,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    eval_every: int = 0,
    loss_fn: Callable = F.cross_entropy,
    group=None,
) -> History:
    """Data-parallel SGD on this rank's shard of ``(x, y)``; single-process SGD at world size 1.

    ``global_batch`` is summed over the ranks, so each rank takes ``global_batch // world``
    samples a step. ``lr`` is a number or a function of the step (see :func:`warmup`).
    """
    rank, world = _world(group)
    if global_batch < 1 or global_batch % world:
        raise ValueError(
            f"global_batch={global_batch} must be a positive multiple of the world size {world}"
        )
    if global_batch > len(x):
        raise ValueError(f"global_batch={global_batch} is larger than the {len(x)} samples")
    sync = GradientAveraging() if sync is None else sync
    lr_at = lr if callable(lr) else (lambda step: lr)
    local_batch = global_batch // world
    steps_per_epoch = len(x) // global_batch  # incomplete global batches are dropped
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0), momentum=momentum)
    broadcast_parameters(model, group=group)  # every rank starts from rank 0's model
    history, step, start = History(), 0, time.perf_counter()
    for epoch in range(epochs):
        shard = shard_indices(len(x), rank, world, shuffle=True, seed=seed, epoch=epoch)
        for t in range(steps_per_epoch):
            idx = shard[t * local_batch : (t + 1) * local_batch]  # this rank's part of batch t
            history.lr.append(lr_at(step))
            for g in opt.param_groups:
                g["lr"] = history.lr[-1]
            loss = loss_fn(model(x[idx]), y[idx])  # compute
            opt.zero_grad(set_to_none=True)
            loss.backward()  # compute
            sync.after_backward(model, step, group)  # communication (synchronous SGD)
            opt.step()
            sync.after_step(model, step, group)  # communication (model averaging)
            step += 1
            history.loss.append(loss.item())
            if test is not None and eval_every and step % eval_every == 0:
                history.eval_steps.append(step)
                history.eval_seconds.append(time.perf_counter() - start)
                history.accuracy.append(accuracy(model, *test))
    sync.finish(model, step, group)
    return history


# --------------------------------------------------------------------------- learning rate


def linear_scaling(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: k times the batch, k times the learning rate."""
    if base_batch < 1 or global_batch < 1:
        raise ValueError("batch sizes must be >= 1")
    return base_lr * global_batch / base_batch


def warmup(peak_lr: float, warmup_steps: int) -> Callable[[int], float]:
    """Gradual warm-up: ramp linearly to ``peak_lr`` over ``warmup_steps`` steps, then hold."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
    return lambda step: peak_lr * min(1.0, (step + 1) / warmup_steps)
