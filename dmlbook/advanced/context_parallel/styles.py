"""Context parallelism as plan styles on an unmodified char-GPT (chapter 13).

:mod:`dmlbook.advanced.context_parallel.ring` computes attention over a sequence whose positions
are spread over the ranks of a group. Two modules of the char-GPT must know that they see only
part of the sequence, and the plan mechanism of :mod:`dmlbook.advanced.composition.plan` changes
exactly those two:

* :class:`ContextParallelPositions` on ``wpe``: the model asks for positions ``0 .. t-1`` of the
  ``t`` tokens it holds; this rank's tokens sit at other places of the whole sequence (two
  chunks, one from each end, with the zigzag chunks), so the lookup is redirected to the global
  positions of this rank's chunks;
* :class:`ContextParallelAttention` on ``blocks.*.attn``: q, k and v come from the attention's
  own ``c_attn`` (plain, or chapter 9's tensor-parallel one, or the sequence-parallel one that
  all-gathers the TP group's sequence blocks first); the score computation is
  :func:`~dmlbook.advanced.context_parallel.ring.ring_attention` over the CP group; ``c_proj`` is
  the attention's own. So CP composes with TP and SP: apply the TP plan first, then these styles.

Everything else (LayerNorm, MLP, loss) works token by token and needs no change: each CP rank's
loss is the mean over its tokens, and the mean of those means (equal token counts) is the whole
sequence's loss, so gradients are averaged over the CP ranks like data-parallel ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmlbook.advanced.context_parallel.ring import (
    RankChunks,
    contiguous_chunks,
    ring_attention,
    zigzag_chunks,
)
from dmlbook.advanced.tensor_parallel import ParallelSelfAttention
from dmlbook.comm.groups import group_rank_size
from dmlbook.models import CausalSelfAttention

__all__ = ["ContextParallel", "ContextParallelAttention", "ContextParallelPositions", "cp_chunks"]


def cp_chunks(local_len: int, cp_size: int, zigzag: bool = True) -> RankChunks:
    """Each CP rank's chunks of a sequence of ``local_len * cp_size`` tokens over ``cp_size``
    ranks: two from opposite ends (``zigzag``), or one contiguous block."""
    make = zigzag_chunks if zigzag else contiguous_chunks
    return make(local_len * cp_size, cp_size)


def local_positions(local_len: int, cp_rank: int, cp_size: int, zigzag: bool = True):
    """The global positions of the ``local_len`` tokens that CP rank ``cp_rank`` holds."""
    chunks = cp_chunks(local_len, cp_size, zigzag)[cp_rank]
    return torch.cat([torch.arange(a, b) for a, b in chunks])


class ContextParallelPositions(nn.Module):
    """A position embedding that looks up this rank's global positions: local position ``i``
    is the ``i``-th position of this rank's chunks."""

    def __init__(self, embedding: nn.Embedding, group, zigzag: bool = True) -> None:
        super().__init__()
        self.embedding, self.group, self.zigzag = embedding, group, zigzag

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        rank, size = group_rank_size(self.group)
        where = local_positions(pos.numel(), rank, size, self.zigzag).to(pos.device)
        return self.embedding(where[pos])  # (T_local, C)


class ContextParallelAttention(nn.Module):
    """Causal attention over the whole sequence for this rank's positions: the wrapped
    attention's q|k|v and output projection, ring attention over ``group`` in between."""

    def __init__(self, attention: nn.Module, group, zigzag: bool = True) -> None:
        super().__init__()
        self.inner, self.group, self.zigzag = attention, group, zigzag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.inner.c_attn(x)  # (B, T_local, 3 C / tp): this rank's tokens (and heads)
        B, T, _ = qkv.shape
        hs = self.inner.head_size
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        _, size = group_rank_size(self.group)
        chunks = cp_chunks(T, size, self.zigzag)  # each CP rank's [start, stop) chunks
        y = ring_attention(q, k, v, chunks, self.group)  # (B, nh, T_local, hs): compute + comm
        return self.inner.c_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T_local, C)


@dataclass(frozen=True)
class ContextParallel:
    """Plan style: ``wpe`` becomes :class:`ContextParallelPositions`, an attention module
    :class:`ContextParallelAttention` (``zigzag=False``: contiguous blocks)."""

    zigzag: bool = True

    def __call__(self, module: nn.Module, group) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return ContextParallelPositions(module, group, self.zigzag)
        if isinstance(module, CausalSelfAttention) and module.dropout:
            raise ValueError("context parallelism here needs attention dropout=0.0")
        if isinstance(module, CausalSelfAttention | ParallelSelfAttention):  # plain, TP or TP + SP
            return ContextParallelAttention(module, group, self.zigzag)
        raise TypeError(
            f"ContextParallel applies to the position embedding or an attention, not {type(module)}"
        )


CONTEXT_PARALLEL_PLAN = {"wpe": ContextParallel(), "blocks.*.attn": ContextParallel()}
