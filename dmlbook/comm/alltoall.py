"""All-to-all from point-to-point messages, and its autograd conjugate (chapter 13).

In an all-to-all every rank sends a *different* block of rows to every other rank: rank i's
``input`` is cut along dimension 0 into ``input_split_sizes`` (block j goes to rank j), and its
``output`` is the blocks arriving from ranks 0, 1, ... in order, of ``output_split_sizes`` rows.
It is the transpose of a matrix whose rows are the ranks. Expert parallelism (chapter 13) moves
each token to the rank that holds its expert this way, and back again.

Three layers, as in :mod:`dmlbook.advanced.tensor_parallel`:

* :func:`exchange_sizes`: every rank's list of integers, by one all-gather. Ranks agree on sizes
  before a variable-size exchange (how many rows each will send); the check below uses it too;
* :func:`all_to_all_single`: ``torch.distributed.all_to_all_single``'s signature, built from
  ``isend``/``irecv`` in p - 1 steps: at step s rank r sends to r + s and receives from r - s,
  so every pair of ranks meets exactly once and no link carries two messages at a step (the
  *pairwise exchange* of MPI libraries). Unless ``check=False``, one extra all-gather first
  checks that the ranks agree (what i sends to j is what j expects from i, same row shape and
  dtype), so a mismatch is a ValueError naming the ranks, on every rank, not a hang;
* :func:`differentiable_all_to_all`: all-to-all forward, the reverse all-to-all backward (the
  splits swapped): the gradient of a row goes back to the rank it came from.

Every message is recorded as a :class:`dmlbook.comm.trace.Send` (collective
``"all_to_all"``, phase ``"exchange"``), so ``with collectives.recording_sends() as sends:``
counts the traffic; the check's all-gather of sizes is real traffic too, and shows as
``"all_gather"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.distributed as dist

from dmlbook.comm import collectives, trace  # all_gather and Send, looked up late
from dmlbook.comm.groups import group_rank_size

__all__ = ["all_to_all_single", "differentiable_all_to_all", "exchange_sizes"]

# A small code per dtype, so that the check can compare dtypes as integers.
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8


def _global(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def exchange_sizes(
    sizes: Sequence[int], group=None, device: torch.device | str = "cpu"
) -> list[list[int]]:
    """Every rank's ``sizes`` (the same length on every rank), indexed by group rank: one
    all-gather of a few integers (``device``: where the backend wants them, CUDA for NCCL)."""
    _, world = group_rank_size(group)
    mine = torch.tensor([int(s) for s in sizes], dtype=torch.int64, device=device)
    if world == 1:
        return [mine.tolist()]
    pieces = [torch.empty_like(mine) for _ in range(world)]
    collectives.all_gather(pieces, mine, group=group, check=False)  # same length by contract
    return [p.tolist() for p in pieces]


def _splits(sizes, rows: int, world: int, name: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if rows % world:
            raise ValueError(
                f"all_to_all_single: dimension 0 of {name} has {rows} rows, not divisible by "
                f"the {world} ranks; pass {name}_split_sizes"
            )
        return [rows // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(
            f"all_to_all_single: {name}_split_sizes must be {world} sizes >= 0 (one per rank), "
            f"got {sizes}"
        )
    if sum(sizes) != rows:
        raise ValueError(
            f"all_to_all_single: {name}_split_sizes {sizes} add up to {sum(sizes)}, but "
            f"dimension 0 of {name} has {rows} rows"
        )
    return sizes


def _check_agreement(group, world, input, out_splits, in_splits) -> None:
    """One all-gather of every rank's splits, row shape and dtype; the same verdict on every
    rank, so either all raise or none does."""
    if input.dim() > _MAX_DIMS:
        raise ValueError(f"all_to_all_single supports tensors of up to {_MAX_DIMS} dimensions")
    row_shape = list(input.shape[1:]) + [-1] * (_MAX_DIMS - input.dim())
    code = _DTYPES.index(input.dtype) if input.dtype in _DTYPES else -1
    rows = exchange_sizes([*in_splits, *out_splits, code, *row_shape], group, input.device)
    problems = []
    for i in range(world):
        for j in range(world):
            sent, expected = rows[i][j], rows[j][world + i]
            if sent != expected:
                problems.append(
                    f"rank {_global(group, i)} sends {sent} rows to rank {_global(group, j)}, "
                    f"which expects {expected}"
                )
    if any(row[2 * world :] != rows[0][2 * world :] for row in rows):

        def describe(row):
            shape = tuple(d for d in row[2 * world + 1 :] if d >= 0)
            dtype = _DTYPES[row[2 * world]] if row[2 * world] >= 0 else "other dtype"
            return f"rows of shape {shape} and {dtype}"

        problems.append(
            "ranks pass different row shapes or dtypes ("
            + ", ".join(f"rank {_global(group, r)}: {describe(row)}" for r, row in enumerate(rows))
            + ")"
        )
    if problems:
        raise ValueError("all_to_all_single: " + "; ".join(problems))


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group=None,
    check: bool = True,
) -> None:
    """Send block j of ``input`` (dimension 0, ``input_split_sizes``) to group rank j and store
    the block from group rank i at block i of ``output`` (``output_split_sizes``). Without split
    sizes dimension 0 is cut into equal blocks. ``output`` is written in place."""
    rank, world = group_rank_size(group)
    if rank < 0:  # not a member of group
        return
    if output.shape[1:] != input.shape[1:] or output.dtype != input.dtype:
        raise ValueError(
            f"all_to_all_single: output {tuple(output.shape)} {output.dtype} and input "
            f"{tuple(input.shape)} {input.dtype} must have the same row shape and dtype"
        )
    in_splits = _splits(input_split_sizes, input.shape[0], world, "input")
    out_splits = _splits(output_split_sizes, output.shape[0], world, "output")
    if check and world > 1:
        _check_agreement(group, world, input, out_splits, in_splits)
    in_starts = [0, *accumulate(in_splits)]
    out_starts = [0, *accumulate(out_splits)]
    source = input.contiguous()
    target = output if output.is_contiguous() else output.contiguous()
    target[out_starts[rank] : out_starts[rank + 1]] = source[in_starts[rank] : in_starts[rank + 1]]
    works = []
    for step in range(1, world):
        src, dst = (rank - step) % world, (rank + step) % world
        if out_splits[src]:  # both sides skip an empty block: they agreed on its size
            block = target[out_starts[src] : out_starts[src + 1]]
            works.append(dist.irecv(block, _global(group, src), group=group, tag=step))
        if in_splits[dst]:
            block = source[in_starts[dst] : in_starts[dst + 1]]
            trace.record(
                trace.Send(
                    "all_to_all", "exchange", step, _global(group, rank), _global(group, dst),
                    block.numel() * block.element_size(),
                )
            )  # fmt: skip
            works.append(dist.isend(block, _global(group, dst), group=group, tag=step))
    for work in works:
        work.wait()
    if target is not output:
        output.copy_(target)


class _AllToAll(torch.autograd.Function):
    """All-to-all forward; backward, the reverse all-to-all: each row's gradient goes home."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
        out = x.new_empty(rows, *x.shape[1:])
        all_to_all_single(out, x, output_split_sizes, input_split_sizes, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        rows = sum(in_splits) if in_splits else grad.shape[0]
        grad_input = grad.new_empty(rows, *grad.shape[1:])
        # The forward pass checked the sizes; the reverse exchange needs no second check.
        all_to_all_single(grad_input, grad, in_splits, out_splits, ctx.group, check=False)
        return grad_input, None, None, None


def differentiable_all_to_all(
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group=None,
) -> torch.Tensor:
    """All-to-all forward, the reverse all-to-all backward; returns the received rows (a new
    tensor of ``sum(output_split_sizes)`` rows, or ``input``'s row count when split equally)."""
    _, world = group_rank_size(group)
    if world == 1:
        return input
    return _AllToAll.apply(input, output_split_sizes, input_split_sizes, group)
