"""Data-parallel serving: split the requests over the ranks, no synchronisation, gather in order.

Chapter 3 ends its pipeline with serving a trained model. Inference needs no gradient and no
model synchronisation: every rank holds the same frozen model, takes a contiguous slice of the
inputs, and runs it alone. The only communication is collecting the outputs, in input order, at
the end. :func:`predict` is that; each rank serves its block of
:func:`dmlbook.comm.groups.balanced_blocks`, so the gathered outputs keep the input order.
(Chapter 7 adds model-parallel serving; chapter 8 makes the model itself cheaper to serve.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.comm.groups import balanced_blocks, group_rank_size

__all__ = ["predict"]


@torch.no_grad()
def predict(
    model: nn.Module, x: torch.Tensor, batch_size: int = 256, group=None, gather: bool = True
) -> torch.Tensor:
    """Run ``model`` on this rank's slice of ``x`` in batches; return every rank's outputs, in
    the order of ``x`` (``gather=False``: just this rank's slice). Outside a process group this
    is plain batched inference: the single-process reference."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rank, world = group_rank_size(group)
    start, stop = balanced_blocks(len(x), world)[rank]
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
    blocks = balanced_blocks(len(x), world)
    longest = blocks[0][1]  # the first block is the longest
    padded = torch.zeros((longest, *out.shape[1:]), dtype=out.dtype, device=out.device)
    padded[: len(out)] = out
    everyone = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    pieces = []
    for (a, b), piece in zip(blocks, everyone, strict=True):
        pieces.append(piece[: b - a])
    return torch.cat(pieces)
