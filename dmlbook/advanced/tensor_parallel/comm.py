"""Tensor and sequence parallelism's communication: raw collectives, then autograd functions in
conjugate pairs (chapters 9 and 13).

Chapter 9 ("Hybrid data and model parallelism") splits a layer's matrices across the ranks
(:mod:`dmlbook.advanced.tensor_parallel.layers`), and chapter 13's sequence parallelism splits
the activations between those layers along the sequence
(:mod:`dmlbook.advanced.tensor_parallel.sequence_parallel`); everything either exchanges goes
through this one module, in layers as in Megatron's ``mappings.py``:

* raw collectives (an all-reduce, and an all-gather of the last dimension) that bypass at world
  size 1 and record every call they make as a :class:`CommRecord` (:mod:`dmlbook.comm.trace`):
  inside ``with counting() as comms:`` the notebook counts the collectives per layer and pass;
* autograd functions in conjugate pairs, each named for what it does forward and backward:
  :class:`IdentityForwardAllReduceBackward` (Megatron's ``f``, wrapped by
  :func:`copy_to_tensor_parallel`) and :class:`AllReduceForwardIdentityBackward` (``g``,
  :func:`reduce_from_tensor_parallel`);
  :func:`gather_from_tensor_parallel` and :func:`scatter_to_tensor_parallel` are the pair that
  joins or cuts the last dimension; along the sequence (dimension 1 of ``(B, T, C)``),
  :func:`scatter_to_sequence_parallel` (keep my block; all-gather backward),
  :func:`gather_from_sequence_parallel` (all-gather; reduce-scatter backward) and
  :func:`reduce_scatter_to_sequence_parallel` (reduce-scatter; all-gather backward).

The sequence collectives check shapes first, as ring attention and expert parallelism do: one
all-gather of every rank's ``(B, T, C)`` (:func:`check_same_sequence_split`), so that a sequence
split differently on two ranks is the same ValueError on every rank instead of a gloo abort. The
check runs in forward only: backward's shapes follow from forward's. Its cost, measured on this
project's 2-core CPU over gloo (loopback, a busy machine, medians of 300 calls): about 0.4 ms a
check at 2 ranks, one all-gather of four integers, which doubles an all-gather of a chapter-13-
sized block and vanishes in the noise for an 8 MB one; a whole TP + SP training step of a 2-block
char-GPT (9 checks a forward) took 2-12% longer with the checks at 2 and 3 ranks.

All communication goes through chapter 2's :mod:`dmlbook.comm.collectives`; ``group=`` picks the
tensor-parallel process group as in ``torch.distributed`` (the TP dimension of a
:class:`dmlbook.advanced.composition.mesh.DeviceMesh`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmlbook.comm import collectives, trace
from dmlbook.comm.alltoall import exchange_sizes
from dmlbook.comm.groups import even_block, group_rank_size

__all__ = [
    "SEQ_DIM",
    "AllGatherForwardSplitBackward",
    "AllReduceForwardIdentityBackward",
    "IdentityForwardAllReduceBackward",
    "SplitForwardAllGatherBackward",
    "CommRecord",
    "check_same_sequence_split",
    "copy_to_tensor_parallel",
    "counting",
    "gather_from_sequence_parallel",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "scatter_to_tensor_parallel",
]

SEQ_DIM = 1  # sequence-parallel activations are (B, T, C)


# --------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class CommRecord:
    """One collective a tensor-parallel layer ran: which, in which pass, on how many bytes."""

    op: str  # "all_reduce", "all_gather" or "reduce_scatter"
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


def _sequence_block(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of the sequence."""
    rank, size = group_rank_size(group)
    start, stop = even_block(t.shape[SEQ_DIM], rank=rank, world_size=size, what="sequence length")
    return t.narrow(SEQ_DIM, start, stop - start).contiguous()


def check_same_sequence_split(name: str, t: torch.Tensor, group) -> None:
    """One all-gather of every rank's shape: the same ValueError on every rank, naming each
    rank's shape, when they differ (gloo would abort the process on mismatched sizes)."""
    _, size = group_rank_size(group)
    if size == 1:
        return
    rows = exchange_sizes([t.dim(), *t.shape], group, t.device)  # communication: a few ints
    if any(row != rows[0] for row in rows):
        found = ", ".join(f"rank {r}: {tuple(row[1:])}" for r, row in enumerate(rows))
        raise ValueError(
            f"{name}: the ranks' activations must have one shape (B, T, C), the sequence split "
            f"the same way on every rank; got {found}"
        )


def _all_gather_sequence(t: torch.Tensor, group, direction: str) -> torch.Tensor:
    """Every rank's sequence block, concatenated: (B, T / t, C) -> (B, T, C)."""
    _, size = group_rank_size(group)
    if size == 1:
        return t
    t = t.contiguous()
    if direction == "forward":
        check_same_sequence_split("sequence-parallel all-gather", t, group)
    _note("all_gather", direction, t, size)
    pieces = [torch.empty_like(t) for _ in range(size)]
    collectives.all_gather(pieces, t, group=group, check=False)  # shapes checked above
    return torch.cat(pieces, dim=SEQ_DIM)


def _reduce_scatter_sequence(t: torch.Tensor, group, direction: str) -> torch.Tensor:
    """The sum over the ranks of this rank's sequence block: (B, T, C) -> (B, T / t, C)."""
    rank, size = group_rank_size(group)
    if size == 1:
        return t
    if direction == "forward":  # every rank's shape first, so a bad split fails on all of them
        check_same_sequence_split("sequence-parallel reduce-scatter", t, group)
    even_block(t.shape[SEQ_DIM], rank=rank, world_size=size, what="sequence length")
    blocks = [b.contiguous() for b in t.chunk(size, dim=SEQ_DIM)]
    _note("reduce_scatter", direction, t, size)
    out = torch.empty_like(blocks[rank])
    collectives.reduce_scatter(out, blocks, group=group, check=False)  # shapes checked above
    return out


# --------------------------------------------------------------------------- conjugate operators


class IdentityForwardAllReduceBackward(torch.autograd.Function):
    """Megatron's ``f``: identity in forward, all-reduce of the gradient in backward. Placed
    before a column-parallel layer: every rank's shard used the whole input, so each rank's
    input gradient is only its shard's part of the whole one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward"), None


class AllReduceForwardIdentityBackward(torch.autograd.Function):
    """Megatron's ``g``: all-reduce in forward (add the ranks' partial sums), identity in
    backward. Placed after a row-parallel layer: every partial sum gets the whole output's
    gradient as it is."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllGatherForwardSplitBackward(torch.autograd.Function):
    """All-gather of the last dimension in forward; this rank's block of the gradient in
    backward (a column-parallel layer's ``gather_output``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _my_block_last(grad, ctx.group), None


class SplitForwardAllGatherBackward(torch.autograd.Function):
    """This rank's block of the last dimension in forward; all-gather of the gradient in
    backward (a row-parallel layer given the whole input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_block_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group, "backward"), None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (``f``)."""
    return IdentityForwardAllReduceBackward.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (``g``)."""
    return AllReduceForwardIdentityBackward.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's last-dimension block forward; split the gradient backward."""
    return AllGatherForwardSplitBackward.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's last-dimension block forward; all-gather the gradient backward."""
    return SplitForwardAllGatherBackward.apply(x, group)


# --------------------------------------------------------------------------- along the sequence


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this rank's sequence block forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_block(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group, "backward"), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather the sequence forward; reduce-scatter the gradient backward (every rank's
    consumer of the whole sequence contributed part of each block's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_sequence(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group, "backward"), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter forward (sum the partial outputs, keep my tokens); all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group, "backward"), None


def scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the sequence forward; all-gather of the gradient backward."""
    return _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather of the sequence forward; reduce-scatter of the gradient backward."""
    return _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""
    return _ReduceScatterToSequenceParallel.apply(x, group)
