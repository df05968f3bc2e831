"""Tensor and sequence parallelism's communication: raw collectives, then autograd functions in
conjugate pairs (chapters 9 and 13).

Chapter 9 ("Hybrid data and model parallelism") splits a layer's matrices across the ranks
(:mod:`dmlbook.advanced.tensor_parallel.layers`), and chapter 13's sequence parallelism splits
the activations between those layers along the sequence
(:mod:`dmlbook.advanced.tensor_parallel.sequence_parallel`); everything either exchanges goes
through this one module, in layers as in Megatron's ``mappings.py``:

* raw collectives (:func:`raw_all_reduce`, :func:`raw_all_gather_last`, and along the sequence
  :func:`raw_all_gather_sequence` and :func:`raw_reduce_scatter_sequence`) that bypass at world
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

Every collective here, forward and backward, first checks that every rank of the group brought
the same shape and dtype: chapter 2's own check (:mod:`dmlbook.comm.shapecheck`, what
:mod:`dmlbook.comm.collectives` runs unless told ``check=False``), so that mismatched inputs (a
batch of 2 on one rank and 3 on another) are the same ValueError on every rank, naming each
rank's shape and saying which operator and pass found it, instead of a gloo abort. The ring
all-reduce, all-gather and reduce-scatter carry that check inside their first message, at no
extra latency (a collective without a ring sends it first, alone). The reduce-scatter along the
sequence checks the whole ``(B, T, C)`` before cutting it into blocks, since a length that does
not divide on one rank only would otherwise fail there alone (:func:`check_same_sequence_split`).
A backward collective skips the check (``check=False``) only where forward's collective already
checked the same shape: a gradient has its tensor's shape and dtype. What is left, measured by
``python -m dmlbook.bench tp-check`` on this project's busy 2-core CPU (gloo, loopback, 2 ranks,
a 2-block char-GPT under TP + SP, 41 collectives a step, 27 of them checked, of which only the 4
whole-shape checks are messages of their own), medians of paired steps: about 3.3-3.4 ms a step
(+19-20%) for a chapter-13-sized model, 2-4 ms (+2-5%) for one 4x wider on a 4x longer sequence
(with the all-gather's and reduce-scatter's checks sent alone, as before: +21-22% and +9-10%).

All communication goes through chapter 2's :mod:`dmlbook.comm.collectives`; ``group=`` picks the
tensor-parallel process group as in ``torch.distributed`` (the TP dimension of a
:class:`dmlbook.advanced.composition.mesh.DeviceMesh`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmlbook.comm import collectives, trace
from dmlbook.comm.alltoall import exchange_sizes
from dmlbook.comm.groups import even_block, group_rank_size

__all__ = [
    "AllGatherForwardSplitBackward",
    "AllReduceForwardIdentityBackward",
    "IdentityForwardAllReduceBackward",
    "CommRecord",
    "check_same_sequence_split",
    "copy_to_tensor_parallel",
    "counting",
    "raw_all_gather_last",
    "raw_all_gather_sequence",
    "raw_all_reduce",
    "raw_reduce_scatter_sequence",
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


@contextmanager
def _found_by(name: str, direction: str) -> Iterator[None]:
    """The shape check's ValueError (the same on every rank), told as this operator's."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{name} ({direction}): {error}") from None


def raw_all_reduce(t: torch.Tensor, group, direction: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A reduced copy of ``t`` over ``group`` (world size 1: a plain copy), counted as sent."""
    _, size = group_rank_size(group)
    t = t.contiguous().clone()
    if size > 1:
        _note("all_reduce", direction, t, size)
        with _found_by("tensor-parallel all-reduce", direction):
            collectives.all_reduce(t, op=op, group=group)  # communication; shapes checked first
    return t


def raw_all_gather_last(t: torch.Tensor, group, direction: str) -> torch.Tensor:
    """Every rank's ``t`` joined along the last dimension (at world size 1: ``t`` itself)."""
    rank, size = group_rank_size(group)
    if size == 1:
        return t
    t = t.contiguous()
    _note("all_gather", direction, t, size)
    pieces = [torch.empty_like(t) for _ in range(size)]
    with _found_by("tensor-parallel all-gather", direction):
        collectives.all_gather(pieces, t, group=group)  # communication; shapes checked first
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
    """One all-gather of every rank's ``(B, T, C)``: the same ValueError on every rank, naming each
    rank's shape, when they differ. What a reduce-scatter along the sequence runs before cutting
    its input into blocks, so that a length that divides on one rank only fails on every rank."""
    _, size = group_rank_size(group)
    if size == 1:
        return
    rows = exchange_sizes([t.dim(), *t.shape], group, t.device)  # communication: a few ints
    if any(row != rows[0] for row in rows):
        shapes = [f"rank {_global(group, r)}: {tuple(row[1:])}" for r, row in enumerate(rows)]
        found = ", ".join(shapes)
        raise ValueError(
            f"{name}: the ranks' activations must have one shape (B, T, C), the sequence split "
            f"the same way on every rank; got {found}"
        )


def _global(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def raw_all_gather_sequence(
    t: torch.Tensor, group, direction: str, check: bool = True
) -> torch.Tensor:
    """Every rank's sequence block, concatenated: (B, T / t, C) -> (B, T, C). ``check=False``
    only where forward already checked this very shape (a gradient has its tensor's shape)."""
    _, size = group_rank_size(group)
    if size == 1:
        return t
    t = t.contiguous()
    _note("all_gather", direction, t, size)
    pieces = [torch.empty_like(t) for _ in range(size)]
    with _found_by("sequence-parallel all-gather", direction):
        collectives.all_gather(pieces, t, group=group, check=check)  # communication
    return torch.cat(pieces, dim=SEQ_DIM)


def raw_reduce_scatter_sequence(
    t: torch.Tensor, group, direction: str, check: bool = True
) -> torch.Tensor:
    """The sum over the ranks of this rank's sequence block: (B, T, C) -> (B, T / t, C).
    ``check=False`` only where forward already checked this very shape."""
    rank, size = group_rank_size(group)
    if size == 1:
        return t
    if check:  # the whole shape first, so that a length that divides on one rank fails on all
        check_same_sequence_split(f"sequence-parallel reduce-scatter ({direction})", t, group)
    even_block(t.shape[SEQ_DIM], rank=rank, world_size=size, what="sequence length")
    blocks = [b.contiguous() for b in t.chunk(size, dim=SEQ_DIM)]
    _note("reduce_scatter", direction, t, size)
    out = torch.empty_like(blocks[rank])
    with _found_by("sequence-parallel reduce-scatter", direction):
        collectives.reduce_scatter(out, blocks, group=group, check=check)  # communication
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
        return raw_all_reduce(grad, ctx.group, "backward"), None


class AllReduceForwardIdentityBackward(torch.autograd.Function):
    """Megatron's ``g``: all-reduce in forward (add the ranks' partial sums), identity in
    backward. Placed after a row-parallel layer: every partial sum gets the whole output's
    gradient as it is."""

    @staticmethod
    def forward(ctx, x, group):
        return raw_all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllGatherForwardSplitBackward(torch.autograd.Function):
    """All-gather of the last dimension in forward; this rank's block of the gradient in
    backward (a column-parallel layer's ``gather_output``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return raw_all_gather_last(x, group, "forward")

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
        return raw_all_gather_last(grad, ctx.group, "backward"), None


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
        return raw_all_gather_sequence(grad, ctx.group, "backward"), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather the sequence forward; reduce-scatter the gradient backward (every rank's
    consumer of the whole sequence contributed part of each block's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return raw_all_gather_sequence(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        # grad has forward's output shape and dtype (autograd sees to it), checked equal on
        # every rank by forward's all-gather: a second check would find nothing
        return raw_reduce_scatter_sequence(grad, ctx.group, "backward", check=False), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter forward (sum the partial outputs, keep my tokens); all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return raw_reduce_scatter_sequence(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        # grad has forward's output shape and dtype, checked by forward's reduce-scatter
        return raw_all_gather_sequence(grad, ctx.group, "backward", check=False), None


def scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the sequence forward; all-gather of the gradient backward."""
    return _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather of the sequence forward; reduce-scatter of the gradient backward."""
    return _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""
    return _ReduceScatterToSequenceParallel.apply(x, group)
