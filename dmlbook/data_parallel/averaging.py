"""Model synchronisation for data parallelism: average the gradients, or the parameters (ch. 1).

* :func:`average_gradients` is synchronous SGD's model synchronisation, and the one gradient
  average every chapter uses: after backward, each gradient becomes its mean over the ranks
  (one flat buffer, one all-reduce: ``dist.all_reduce``, or chapter 2's collectives with
  ``algorithm=``); :func:`average_gradients_per_parameter`, one all-reduce per parameter, is the
  naive baseline. Every rank then takes the same step, so the ranks stay identical
  without ever sending parameters.
* :class:`GradientAveraging` and :class:`ModelAveraging` are the two synchronisation schemes,
  behind one interface: average gradients every step, or let each rank take ``every`` local steps
  and then average the parameters (periodic model averaging, also called local SGD).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.comm import collectives
from dmlbook.comm.groups import group_rank_size

__all__ = [
    "average_gradients",
    "average_gradients_per_parameter",
    "average_parameters",
    "broadcast_parameters",
    "GradientAveraging",
    "ModelAveraging",
]


def average_gradients(
    model: nn.Module | Iterable[torch.Tensor],
    group=None,
    *,
    algorithm: str | None = None,
    divide_by: int | None = None,
) -> None:
    """Replace each gradient by its sum over the ranks of ``group`` divided by ``divide_by``
    (by default the group's size: the mean). Every chapter's data parallelism syncs with it.

    The gradients are copied into one flat buffer (one per dtype) and reduced by a single
    all-reduce, then copied back: one collective's latency instead of one per parameter, which
    is most of what torch's DDP saves (its buckets, chapter 3). :func:`average_gradients_per_
    parameter` is chapter 1's first version, one all-reduce per parameter, kept as the baseline.
    ``algorithm=None`` reduces with ``dist.all_reduce``; ``"ring"`` (or ``"tree"``,
    ``"recursive_doubling"``, ``"naive"``, ``"auto"``, ``"shm"``) with chapter 2's
    :func:`dmlbook.comm.collectives.all_reduce`. ``divide_by=1`` keeps the plain sum: right when
    each rank's loss is already its share of the global batch's mean (chapters 11 and 12, with
    batches of different sizes).
    """
    _, world = group_rank_size(group)
    params = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in params if p.grad is not None]
    divide_by = world if divide_by is None else divide_by
    if world == 1 and divide_by == 1:
        return  # alone, and nothing to divide
    for dtype in dict.fromkeys(g.dtype for g in grads):  # one buffer per dtype, in order
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])  # (sum of numel,)
        if world > 1 and algorithm is None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # communication
        elif world > 1:
            collectives.all_reduce(flat, group=group, algorithm=algorithm)  # communication
        if divide_by != 1:
            flat.div_(divide_by)  # gloo has no AVG, so sum then divide
        for grad, piece in zip(same, flat.split([g.numel() for g in same]), strict=True):
            grad.copy_(piece.view_as(grad))


def average_gradients_per_parameter(
    model: nn.Module | Iterable[torch.Tensor], group=None, *, divide_by: int | None = None
) -> None:
    """Chapter 1's first gradient average: one ``dist.all_reduce`` per parameter, then divide.

    Each small tensor pays a whole collective's latency, so this is 1.4-3.4x the step time of
    torch's DDP on chapter 3's MLPs (``python -m dmlbook.bench data-parallel``), where
    :func:`average_gradients` (one flat buffer) is within a few percent of it.
    """
    _, world = group_rank_size(group)
    params = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in params if p.grad is not None]
    divide_by = world if divide_by is None else divide_by
    for grad in grads:
        if world > 1:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)  # communication
        if divide_by != 1:
            grad.div_(divide_by)


def average_parameters(model: nn.Module, group=None) -> None:
    """Replace each parameter by its mean over the ranks (model averaging): like
    :func:`average_gradients`, one flat buffer and one all-reduce, so that a round of model
    averaging costs what a round of gradient averaging costs."""
    _, world = group_rank_size(group)
    if world == 1:
        return
    with torch.no_grad():
        params = list(model.parameters())
        flat = torch.cat([p.reshape(-1) for p in params])  # (number of parameters,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # communication
        flat.div_(world)
        for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(piece.view_as(p))


def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank, so that all start identical."""
    if group_rank_size(group)[1] == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=src, group=group)  # communication


# --------------------------------------------------------------------------- sync schemes


@dataclass
class GradientAveraging:
    """Synchronous SGD: average the gradients after every backward pass, with
    :func:`average_gradients`'s ``algorithm`` and ``divide_by``."""

    algorithm: str | None = None
    divide_by: int | None = None
    rounds: int = 0  # how many times the ranks communicated
    floats_sent: int = 0  # how many numbers each rank contributed to all-reduces
    seconds: float = 0.0  # wall-clock time spent averaging (waiting for the other ranks too)

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        if group_rank_size(group)[1] > 1:
            start = time.perf_counter()
            average_gradients(model, group, algorithm=self.algorithm, divide_by=self.divide_by)
            self.seconds += time.perf_counter() - start
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
    seconds: float = 0.0

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"ModelAveraging(every={self.every}): every must be >= 1")

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        pass

    def after_step(self, model: nn.Module, step: int, group=None) -> None:
        # step counts from 0 and this step is done: steps + 1 steps taken so far
        if (step + 1) % self.every == 0:
            self._average(model, group)

    def finish(self, model: nn.Module, step: int, group=None) -> None:
        # step is now the number of steps taken: any since the last average? end in agreement
        if step % self.every != 0:
            self._average(model, group)

    def _average(self, model: nn.Module, group) -> None:
        if group_rank_size(group)[1] > 1:
            start = time.perf_counter()
            average_parameters(model, group)
            self.seconds += time.perf_counter() - start
            self.rounds += 1
            self.floats_sent += sum(p.numel() for p in model.parameters())
