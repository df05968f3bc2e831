"""Megatron-style tensor parallelism: one layer's matrices split across the ranks (chapter 9).

Chapter 9 ("Hybrid data and model parallelism") splits *inside* a layer. In ``Y = X W`` the
weight ``W`` can be cut two ways over p ranks:

* by columns (:class:`ColumnParallelLinear`): rank r holds ``W[:, r-th block]`` and computes its
  own block of ``Y``'s columns from the whole ``X``;
* by rows (:class:`RowParallelLinear`): rank r holds ``W[r-th block, :]`` and the matching block of
  ``X``'s columns, and computes a *partial sum* of the whole ``Y``; an all-reduce adds them up.

A column split followed by a row split needs no communication in between (an element-wise GeLU
keeps the column blocks separate), so a transformer MLP or attention block costs exactly one
all-reduce forward and one backward (Shoeybi et al. 2019, "Megatron-LM"). The communication is
:mod:`dmlbook.advanced.tensor_parallel.comm`'s: two *conjugate* autograd functions,
:func:`copy_to_tensor_parallel` (identity forward, all-reduce backward: Megatron's ``f``) and
:func:`reduce_from_tensor_parallel` (the reverse: ``g``), and the pair that joins or cuts the last
dimension; inside ``with counting() as comms:`` every collective is recorded, so the notebook can
count them per layer and pass. :func:`communication_per_step` is a whole step's count in closed
form.

On top of them, here: :class:`ParallelMLP` and :class:`ParallelSelfAttention` (heads split across
the ranks, causal); in :mod:`~dmlbook.advanced.tensor_parallel.vocab_parallel`,
:class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy`; and
:func:`dmlbook.advanced.composition.plan.tensor_parallel_char_gpt`, the char-GPT of
:mod:`dmlbook.models` with every block split by a plan. Each layer has a ``from_...`` constructor
that cuts its shard out of an unsplit layer, which is how the plan applies it and how the tests and
the notebook prove the split layer computes the same thing. The package
(``from dmlbook.advanced import tensor_parallel as tp``) gives the names of all three modules.

``group=`` picks the tensor-parallel process group as in ``torch.distributed`` (the TP dimension
of a :class:`dmlbook.advanced.composition.layout.ProcessGroups`). Which block of a size each rank
holds is :func:`dmlbook.comm.groups.even_block`: sizes must divide by the TP size.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dmlbook.advanced.tensor_parallel.comm import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from dmlbook.comm.groups import even_block, group_rank_size
from dmlbook.models import CausalSelfAttention, FeedForward

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "communication_per_step",
]


# --------------------------------------------------------------------------- linear layers


def _init_uniform(t: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default distribution, with the *unsplit* layer's fan-in."""
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(t, -bound, bound)


def _blocks(size: int, parts: int, rank: int, world: int, what: str) -> torch.Tensor:
    """Indices of rank's block of each of ``parts`` equal parts of ``size`` (a fused q|k|v weight
    is cut per part, so each rank gets its q, its k and its v)."""
    if size % parts:
        raise ValueError(f"{what}={size} is not divisible into {parts} fused parts")
    part = size // parts
    start, stop = even_block(
        part, rank=rank, world_size=world, what=f"{what} / {parts}" if parts > 1 else what
    )
    return torch.cat([torch.arange(i * part + start, i * part + stop) for i in range(parts)])


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows (Y's columns) split across the ranks of ``group``.

    Each rank holds ``out_features / p`` rows of the weight and bias. The input is the whole
    ``x`` on every rank (``f`` before: its gradient is all-reduced backward). The output is this
    rank's block of columns, or the whole ``y`` with ``gather_output=True`` (one all-gather).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        rank, world = group_rank_size(group)
        start, stop = even_block(out_features, rank=rank, world_size=world, what="out_features")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.out_range = (start, stop)
        self.rows = torch.arange(start, stop)  # the unsplit weight's rows (outputs) held here
        self.weight = nn.Parameter(torch.empty(stop - start, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(stop - start, dtype=dtype)) if bias else None
        _init_uniform(self.weight.data, in_features)
        if self.bias is not None:
            _init_uniform(self.bias.data, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, gather_output: bool = False, group=None, parts: int = 1
    ) -> ColumnParallelLinear:
        """This rank's shard of an unsplit ``linear``; ``parts=3`` for a fused q|k|v weight
        (each rank takes its block of each part; the output then stays split)."""
        if parts > 1 and gather_output:
            raise ValueError("gather_output=True would interleave a fused weight's parts")
        rank, world = group_rank_size(group)
        rows = _blocks(linear.out_features, parts, rank, world, "out_features")
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            gather_output,
            group,
            linear.weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        layer.rows = rows
        if parts > 1:
            layer.out_range = None  # not one contiguous range: a block of each part
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group)  # (..., in) on every rank
        y = F.linear(x, self.weight, self.bias)  # (..., out / p): this rank's columns
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        mine = f"{self.out_range[0]}:{self.out_range[1]}" if self.out_range else "fused blocks"
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this rank: {mine}), gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns (the rows of W in Y = X W) split across ranks.

    Each rank holds ``in_features / p`` columns of the weight and multiplies its block of the
    input's last dimension (``input_is_parallel=True``: the output of a ColumnParallelLinear;
    otherwise the whole input is cut here). The partial products are summed by one all-reduce
    (``g``); the bias, whole on every rank, is added once after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        rank, world = group_rank_size(group)
        start, stop = even_block(in_features, rank=rank, world_size=world, what="in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.in_range = (start, stop)
        self.weight = nn.Parameter(torch.empty(out_features, stop - start, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        _init_uniform(self.weight.data, in_features)
        if self.bias is not None:
            _init_uniform(self.bias.data, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, input_is_parallel: bool = True, group=None
    ) -> RowParallelLinear:
        """This rank's shard of an unsplit ``linear``."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            input_is_parallel,
            group,
            linear.weight.dtype,
        )
        start, stop = layer.in_range
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, start:stop])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)  # (..., in / p)
        partial = F.linear(x, self.weight)  # (..., out): this rank's share of the sum
        y = reduce_from_tensor_parallel(partial, self.group)  # (..., out): the whole product
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this rank: {self.in_range[0]}:{self.in_range[1]}), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
        )


# --------------------------------------------------------------------------- MLP and attention


class ParallelMLP(nn.Module):
    """The transformer MLP, column then row: GeLU(x A) B with A split by columns and B by rows.

    One all-reduce forward (after B) and one backward (before A), nothing in between.
    Parameter names match :class:`dmlbook.models.FeedForward` (``c_fc``, ``c_proj``).
    """

    def __init__(self, n_embd: int, hidden: int, bias: bool = True, group=None, dtype=None) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(n_embd, hidden, bias, group=group, dtype=dtype)
        self.gelu = nn.GELU()
        self.c_proj = RowParallelLinear(hidden, n_embd, bias, group=group, dtype=dtype)

    @classmethod
    def from_feedforward(cls, mlp: FeedForward, group=None) -> ParallelMLP:
        """This rank's shard of an unsplit :class:`~dmlbook.models.FeedForward` (or any module
        with linears ``c_fc`` and ``c_proj``)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, group=group)
        layer.gelu = nn.GELU()
        layer.c_proj = RowParallelLinear.from_linear(mlp.c_proj, group=group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (..., C) -> (..., H / p) -> (..., C)


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split across the ranks.

    ``c_attn`` is column-parallel, cut so that each rank gets the q, k and v of its
    ``n_head / p`` heads; attention runs on those heads alone; ``c_proj`` is row-parallel over the
    same heads. One all-reduce forward, one backward, as in the MLP.
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, group=None, dtype=None) -> None:
        super().__init__()
        rank, world = group_rank_size(group)
        even_block(
            n_head, rank=rank, world_size=world, what="n_head"
        )  # heads must divide, not just channels
        if n_embd % n_head:
            raise ValueError(f"n_head={n_head} must divide n_embd={n_embd}")
        self.head_size, self.n_head, self.group = n_embd // n_head, n_head, group
        self.c_attn = ColumnParallelLinear(n_embd, 3 * n_embd, bias, group=group, dtype=dtype)
        self.c_proj = RowParallelLinear(n_embd, n_embd, bias, group=group, dtype=dtype)
        # A fresh layer's c_attn rows are this rank's q|k|v heads by convention (from_attention
        # cuts an unsplit layer the same way).

    @classmethod
    def from_attention(
        cls, attn: CausalSelfAttention, n_head: int, group=None
    ) -> ParallelSelfAttention:
        """This rank's heads of an unsplit :class:`~dmlbook.models.CausalSelfAttention`."""
        n_embd = attn.c_proj.in_features
        rank, world = group_rank_size(group)
        even_block(n_head, rank=rank, world_size=world, what="n_head")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.head_size, layer.n_head, layer.group = n_embd // n_head, n_head, group
        layer.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, group=group, parts=3)
        layer.c_proj = RowParallelLinear.from_linear(attn.c_proj, group=group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # 3 x (B, T, C / p): this rank's heads
        q, k, v = (t.view(B, T, -1, self.head_size).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh / p, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C / p)
        return self.c_proj(y)  # (B, T, C), summed over the ranks' heads


# --------------------------------------------------------------------------- cost


def communication_per_step(
    n_layer: int, batch: int, seq: int, n_embd: int, tp: int, element_size: int = 4
) -> dict:
    """All-reduces and bytes each rank sends per training step of a Megatron GPT (the char-GPT
    under chapter 9's plan) at tensor-parallel size ``tp``, by part:

    * ``blocks``: per block, attention's and the MLP's ``g`` forward and ``f`` backward, 4
      all-reduces of one ``(batch, seq, n_embd)`` activation;
    * ``embedding``: the vocab-parallel embedding's all-reduce forward, one activation;
    * ``lm_head``: its ``f`` backward (the head is column-parallel), one activation;
    * ``cross_entropy``: two forward, of one and of two numbers per token.

    A ring all-reduce of n bytes sends 2 (p - 1) / p n per rank (chapter 2). Returns
    ``{"parts": {part: (all-reduces, bytes)}, "all_reduces": total, "bytes_sent_per_rank":
    total}``; at ``tp = 1`` every count is 0."""
    if tp < 1 or n_layer < 0:
        raise ValueError(f"need tp >= 1 and n_layer >= 0, got tp={tp}, n_layer={n_layer}")
    tokens = batch * seq
    activation = tokens * n_embd * element_size
    ring = 2 * (tp - 1) / tp  # 0 at tp = 1: nothing to send
    on = 1 if tp > 1 else 0  # at tp = 1 the operators skip the call
    parts = {
        "blocks": (4 * n_layer * on, 4 * n_layer * ring * activation),
        "embedding": (on, ring * activation),
        "lm_head": (on, ring * activation),
        "cross_entropy": (2 * on, ring * 3 * tokens * element_size),
    }
    return {
        "parts": parts,
        "all_reduces": sum(count for count, _ in parts.values()),
        "bytes_sent_per_rank": sum(nbytes for _, nbytes in parts.values()),
    }
