"""A rank's place in a group, and the block of a size that each rank of the group owns.

Every parallelism cuts something over the ranks of a group: samples (chapter 3's serving), the
flat parameter vector (chapter 2's parameter server, chapter 9b's ZeRO), a weight matrix's rows
or columns (chapter 9's tensor parallelism), a ring's chunks (chapter 2). There are three ways,
one function each, with ``rank`` and ``world_size`` keyword-only so that they cannot be swapped:

* :func:`even_block`: equal blocks, and a ValueError when the size does not divide (a weight
  matrix split for tensor parallelism must split exactly);
* :func:`balanced_blocks`: near-equal blocks of any size, the first ``size % parts`` one longer
  (samples to serve, a ring's chunks);
* :func:`padded_block`: equal blocks of a buffer padded to a multiple of the world size, so the
  last ranks' blocks may run into the padding (ZeRO's flat shards, as FSDP1 pads them).

:func:`local_rows` is :func:`even_block` applied to a batch: this rank's rows of a global batch
(chapters 9, 9b, 13: every data-parallel dimension takes its rows this way).

:func:`group_rank_size` and :func:`barrier` also work outside a process group, as the one rank of
a world of one, so that the same rank function runs in a single process; :func:`device` is the
rank's device (every chapter's rank functions put their tensors there).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

__all__ = [
    "balanced_blocks",
    "barrier",
    "device",
    "even_block",
    "group_rank_size",
    "local_rows",
    "padded_block",
    "padded_size",
]


def group_rank_size(group=None) -> tuple[int, int]:
    """This rank's index and the number of ranks in ``group``; (0, 1) outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group=None) -> None:
    """``dist.barrier(group=group)`` when ``group`` has more than one rank; else a no-op."""
    if group_rank_size(group)[1] > 1:
        dist.barrier(group=group)  # communication


def _check(size: int, rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")


def even_block(size: int, *, rank: int, world_size: int, what: str = "size") -> tuple[int, int]:
    """``[start, stop)`` of rank's block when ``size`` is cut into ``world_size`` equal blocks;
    a ValueError naming ``what`` and both numbers when they do not divide."""
    _check(size, rank, world_size)
    if size % world_size:
        raise ValueError(
            f"{what}={size} is not divisible by the {world_size} ranks it is split over; "
            "choose sizes that divide (or pad them, as padded_vocab_size does a vocabulary)"
        )
    block = size // world_size
    return rank * block, (rank + 1) * block


def local_rows(batch, group=None):
    """This rank's equal share of the rows (dimension 0) of ``batch``: a tensor, or a tuple of
    tensors with as many rows each (``(inputs, targets)``; a named tuple keeps its type). The
    rows must divide over ``group``'s ranks (a ValueError says so, as :func:`even_block` does);
    outside a process group it is the whole batch."""
    rank, world = group_rank_size(group)
    parts = batch if isinstance(batch, tuple) else (batch,)
    rows = {len(part) for part in parts}
    if len(rows) != 1:
        raise ValueError(f"the parts of a batch must have as many rows each, got {sorted(rows)}")
    start, stop = even_block(rows.pop(), rank=rank, world_size=world, what="batch rows")
    mine = [part[start:stop] for part in parts]
    if not isinstance(batch, tuple):
        return mine[0]
    return type(batch)(*mine) if hasattr(batch, "_fields") else tuple(mine)


def balanced_blocks(size: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``parts`` contiguous near-equal blocks of ``size``; the first
    ``size % parts`` are one longer, and blocks are empty when ``size < parts``."""
    _check(size, 0, parts)
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def padded_size(size: int, world_size: int) -> int:
    """``size`` rounded up to a multiple of ``world_size``: what :func:`padded_block` cuts."""
    return math.ceil(size / world_size) * world_size


def padded_block(size: int, *, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank's block of a buffer of ``size`` elements padded to
    :func:`padded_size` and cut into equal blocks: the last ranks' blocks may run into the
    padding, or lie wholly in it."""
    _check(size, rank, world_size)
    block = math.ceil(size / world_size)
    return rank * block, (rank + 1) * block


# A ring's chunk travels as slices of about this many bytes (at most 16 a chunk), so that receiving
# the next slice overlaps adding the last one (chapter 4; dmlbook.comm.algorithms).
RING_SLICE_BYTES = 1 << 20


def ring_slices(
    start: int, stop: int, element_size: int, slice_bytes: int | None = None
) -> list[tuple[int, int]]:
    """The slices ``(start, stop)`` in which a ring sends the chunk ``[start, stop)``, each of
    about ``slice_bytes`` (default :data:`RING_SLICE_BYTES`)."""
    n = stop - start
    slice_bytes = slice_bytes or RING_SLICE_BYTES
    parts = max(1, min(16, math.ceil(n * element_size / slice_bytes)))
    return [(start + a, start + b) for a, b in balanced_blocks(n, parts) if b > a]


def ring_schedule(numel: int, parts: int, element_size: int):
    """A ring all-reduce's chunks of a ``numel``-element tensor over ``parts`` ranks
    (:func:`balanced_blocks`) and each chunk's slices (:func:`ring_slices`), as tuples.

    The same on every rank and for every call with the same shape, so it is worked out once and
    kept: on a 64 KiB all-reduce, working it out again each call cost more than adding the
    chunks (chapter 4)."""
    return _ring_schedule(numel, parts, element_size, RING_SLICE_BYTES)


@functools.lru_cache(maxsize=256)
def _ring_schedule(numel: int, parts: int, element_size: int, slice_bytes: int):
    chunks = tuple(balanced_blocks(numel, parts))
    slices = tuple(tuple(ring_slices(a, b, element_size, slice_bytes)) for a, b in chunks)
    return chunks, slices
