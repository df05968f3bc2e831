"""Tensor parallelism's communication: raw collectives, then autograd functions in conjugate pairs.

Chapter 9 ("Hybrid data and model parallelism") splits a layer's matrices across the ranks
(:mod:`dmlbook.advanced.tensor_parallel`); everything those layers exchange goes through this
module, in layers as in Megatron's ``mappings.py``:

* raw collectives (an all-reduce, and an all-gather of the last dimension) that bypass at world
  size 1 and record every call they make as a :class:`CommRecord` (:mod:`dmlbook.comm.trace`):
  inside ``with counting() as comms:`` the notebook counts the collectives per layer and pass;
* autograd functions in conjugate pairs, each saying what it does forward and backward:
  :func:`copy_to_tensor_parallel` is the identity forward and an all-reduce backward (Megatron's
  ``f``), :func:`reduce_from_tensor_parallel` the reverse (``g``);
  :func:`gather_from_tensor_parallel` and :func:`scatter_to_tensor_parallel` are the pair that
  joins or cuts the last dimension.

All communication goes through chapter 2's :mod:`dmlbook.comm.collectives`; ``group=`` picks the
tensor-parallel process group as in ``torch.distributed`` (the TP dimension of a
:class:`dmlbook.advanced.mesh.DeviceMesh`). Chapter 13's sequence parallelism
(:mod:`dmlbook.advanced.sequence_parallel`) records its traffic as the same :class:`CommRecord`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmlbook.comm import collectives, trace
from dmlbook.comm.groups import even_block, group_rank_size

__all__ = [
    "CommRecord",
    "copy_to_tensor_parallel",
    "counting",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
]


# --------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class CommRecord:
    """One collective a tensor-parallel layer ran: which, in which pass, on how many bytes."""

    op: str  # "all_reduce" or "all_gather"
    direction: str  # "forward" or "backward"
    numel: int
    nbytes: int
    group_size: int


def counting() -> AbstractContextManager[list[CommRecord]]:
    """Record, into the yielded list, every collective the layers of this module run
    (:func:`dmlbook.comm.trace.recording` of :class:`CommRecord` events)."""
    return trace.recording(CommRecord)


def _note(op: str, direction: str, t: torch.Tensor, size: int) -> None:
    trace.record(CommRecord(op, direction, t.numel(), t.numel() * t.element_size(), size))


def _all_reduce(t: torch.Tensor, group, direction: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    _, size = group_rank_size(group)
    t = t.contiguous().clone()
    if size > 1:
        _note("all_reduce", direction, t, size)
        collectives.all_reduce(t, op=op, group=group, check=False)
    return t


def _all_gather_last(t: torch.Tensor, group, direction: str) -> torch.Tensor:
    rank, size = group_rank_size(group)
    if size == 1:
        return t
    t = t.contiguous()
    _note("all_gather", direction, t, size)
    pieces = [torch.empty_like(t) for _ in range(size)]
    collectives.all_gather(pieces, t, group=group, check=False)
    return torch.cat(pieces, dim=-1)


def _my_block_last(t: torch.Tensor, group) -> torch.Tensor:
    rank, size = group_rank_size(group)
    start, stop = even_block(t.shape[-1], rank=rank, world_size=size, what="last dimension")
    return t[..., start:stop].contiguous()


# --------------------------------------------------------------------------- conjugate operators


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward all-reduces the input's gradient, because
    every rank's shard used the whole input and each contributes part of its gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward"), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward (add the ranks' partial sums); identity backward,
    because every partial sum gets the whole output's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the last dimension forward; backward keeps this rank's block of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _my_block_last(grad, ctx.group), None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's block of the last dimension forward; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_block_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group, "backward"), None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (``f``)."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (``g``)."""
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's last-dimension block forward; split the gradient backward."""
    return _GatherFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's last-dimension block forward; all-gather the gradient backward."""
    return _ScatterToTensorParallel.apply(x, group)
