"""Data-parallel serving: split the requests over the ranks, no synchronisation, gather in order.

Chapter 3 ends its pipeline with serving a trained model. Inference needs no gradient and no
model synchronisation: every rank holds the same frozen model, takes a contiguous slice of the
inputs, and runs it alone. The only communication is collecting the outputs, in input order, at
the end. :func:`predict` is that; :func:`shard_bounds` says which slice each rank serves.
(Chapter 7 adds model-parallel serving; chapter 8 makes the model itself cheaper to serve.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["predict", "shard_bounds"]


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, stop)`` of rank's contiguous slice of ``n`` inputs; the first ``n % world_size``
    ranks take one more. Contiguous slices keep the gathered outputs in input order."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@torch.no_grad()
def predict(
    model: nn.Module, x: torch.Tensor, batch_size: int = 256, group=None, gather: bool = True
) -> torch.Tensor:
    """Run ``model`` on this rank's slice of ``x`` in batches; return every rank's outputs, in
    the order of ``x`` (``gather=False``: just this rank's slice). Outside a process group this
    is plain batched inference: the single-process reference."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    start, stop = shard_bounds(len(x), rank, world)
    was_training = model.training
    model.eval()
    try:
        mine = [model(x[i : min(i + batch_size, stop)]) for i in range(start, stop, batch_size)]
    finally:
        model.train(was_training)
    if mine:
        out = torch.cat(mine)
    else:  # more ranks than inputs: learn the output's shape from one sample
        model.eval()
        shape = model(x[:1]).shape[1:]
        model.train(was_training)
        out = torch.empty((0, *shape), dtype=x.dtype, device=x.device)
    if world == 1 or not gather:
        return out
    # All-gather needs equal sizes: pad every slice to the longest, then cut the padding off.
    longest = shard_bounds(len(x), 0, world)[1]
    padded = torch.zeros((longest, *out.shape[1:]), dtype=out.dtype, device=out.device)
    padded[: len(out)] = out
    everyone = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    pieces = []
    for r, piece in enumerate(everyone):
        a, b = shard_bounds(len(x), r, world)
        pieces.append(piece[: b - a])
    return torch.cat(pieces)
