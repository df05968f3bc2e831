"""Sequence parallelism (Megatron-SP): the activations between tensor-parallel regions split
along the sequence (chapter 13).

Chapter 9's tensor parallelism splits the attention and the MLP, but every rank still holds the
whole ``(B, T, C)`` activations *between* them: the LayerNorms' inputs and outputs, the residual
stream, the dropouts. Those ops work token by token, so they can run on a slice of the sequence
instead (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"). The all-reduce that closes a tensor-parallel region becomes a **reduce-scatter** along
the sequence (each rank keeps the sum for its tokens only), and the region opens with an
**all-gather** of the sequence. A ring all-reduce *is* a reduce-scatter then an all-gather, so
the bytes on the wire do not change; the activations per rank fall from ``replicated + split / t``
to ``(replicated + split) / t`` (:func:`activation_bytes_per_rank`).

Three layers, as in chapter 9's tensor parallelism:

* conjugate operators along the sequence, in the folder's one communication module
  (:mod:`dmlbook.advanced.tensor_parallel.comm`, which checks that every rank split the
  sequence the same way): :func:`scatter_to_sequence_parallel` (keep my block; all-gather
  backward), :func:`gather_from_sequence_parallel` (all-gather; reduce-scatter backward) and
  :func:`reduce_scatter_to_sequence_parallel` (reduce-scatter; all-gather backward); this
  module gives their names too;
* layers: :class:`ColumnSequenceParallelLinear` all-gathers its input inside one autograd
  function that saves only this rank's block and gathers it again in backward, as Megatron does,
  so the gathered ``(B, T, C)`` is never kept; :class:`RowSequenceParallelLinear` reduce-scatters
  its output; the MLP and attention built from them;
* plan styles for :mod:`dmlbook.advanced.composition.plan`: :class:`SequenceParallel` for modules
  that run on the sequence block (LayerNorm, dropout; their replicated weights' gradients are summed
  over the group, since each rank saw only its tokens), :class:`ScatterSequence` where the
  sequence is cut, and the sequence-sharded column/row, attention and MLP styles.
  :data:`SEQUENCE_PARALLEL_PLAN` applied by :func:`sequence_parallel_char_gpt` turns an
  unmodified char-GPT into its TP + SP shard. torch's counterparts are
  ``torch.distributed.tensor.parallel.SequenceParallel``, ``ColwiseParallel(input_layouts=
  Shard(1))`` and ``RowwiseParallel(output_layouts=Shard(1))``.

The sequence length must divide by the TP size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dmlbook.advanced import tensor_parallel as tp
from dmlbook.advanced.composition.plan import (
    LossParallel,
    Style,
    VocabParallel,
    apply_plan,
    expect_module,
)
from dmlbook.advanced.tensor_parallel.comm import (
    gather_from_sequence_parallel,
    raw_all_gather_sequence,
    raw_all_reduce,
    raw_reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
)
from dmlbook.comm.groups import group_rank_size
from dmlbook.model_parallel.memory.estimate import block_saved_terms
from dmlbook.model_parallel.recompute import SavedTensorMeter
from dmlbook.models import CausalSelfAttention, FeedForward

__all__ = [
    "SEQUENCE_PARALLEL_PLAN",
    "AllGatherLinear",
    "AttentionSequenceParallel",
    "ColumnSequenceParallelLinear",
    "ColwiseSequenceParallel",
    "FeedForwardSequenceParallel",
    "RowSequenceParallelLinear",
    "RowwiseSequenceParallel",
    "ScatterSequence",
    "SequenceParallel",
    "SequenceParallelMLP",
    "activation_bytes_per_rank",
    "gather_from_sequence_parallel",
    "measure_block_activations",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "sequence_parallel_char_gpt",
]

# --------------------------------------------------------------------------- layers


class AllGatherLinear(torch.autograd.Function):
    """All-gather the sequence, then ``x W^T + b``; saves only this rank's block of x and
    gathers it again in backward for W's gradient (Megatron's sequence-parallel linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # (B, T / t, C): the block, not the gathered sequence
        whole = raw_all_gather_sequence(x, group, "forward")  # (B, T, C): the whole sequence
        return F.linear(whole, weight, bias)  # (B, T, out / t)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # x is the block forward's all-gather checked on every rank, and grad_whole has its
        # gathered shape and dtype: no check to repeat (check=False)
        whole = raw_all_gather_sequence(x, ctx.group, "backward", check=False)  # the sequence again
        grad_whole = grad @ weight  # (B, T, C): this rank's columns' share of the input grad
        # communication: my tokens' input gradient, summed over the ranks
        grad_x = raw_reduce_scatter_sequence(grad_whole, ctx.group, "backward", check=False)
        grad_w = grad.flatten(0, -2).t() @ whole.flatten(0, -2)  # (out / t, C)
        grad_b = grad.flatten(0, -2).sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class ColumnSequenceParallelLinear(tp.ColumnParallelLinear):
    """A column-parallel linear whose input is this rank's block of the sequence: all-gathered
    along the sequence forward (reduce-scattered backward). Output: the whole sequence, this
    rank's columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_output:
            raise ValueError("a sequence-parallel column linear keeps its output split")
        return AllGatherLinear.apply(x, self.weight, self.bias, self.group)


class RowSequenceParallelLinear(tp.RowParallelLinear):
    """A row-parallel linear whose partial outputs are reduce-scattered along the sequence
    (each rank keeps the sum for its tokens) instead of all-reduced. The bias, replicated, is
    added to this rank's tokens: its gradient is all-reduced backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (B, T, C): this rank's share of the sum
        y = reduce_scatter_to_sequence_parallel(partial, self.group)  # (B, T / t, C)
        if self.bias is None:
            return y
        return y + tp.copy_to_tensor_parallel(self.bias, self.group)  # bias grad: all-reduced


class SequenceParallelMLP(tp.ParallelMLP):
    """The transformer MLP on a sequence block: all-gather, GeLU(x A) B, reduce-scatter."""

    @classmethod
    def from_feedforward(cls, mlp: nn.Module, group=None) -> SequenceParallelMLP:
        layer = super().from_feedforward(mlp, group)
        layer.c_fc = ColumnSequenceParallelLinear.from_linear(mlp.c_fc, group=group)
        layer.c_proj = RowSequenceParallelLinear.from_linear(mlp.c_proj, group=group)
        return layer


class SequenceParallelSelfAttention(tp.ParallelSelfAttention):
    """Causal attention, heads split, on a sequence block: q|k|v of the whole (gathered)
    sequence for this rank's heads, the output reduce-scattered back to the block."""

    @classmethod
    def from_attention(cls, attn: nn.Module, n_head: int, group=None):
        layer = super().from_attention(attn, n_head, group)
        layer.c_attn = ColumnSequenceParallelLinear.from_linear(attn.c_attn, group=group, parts=3)
        layer.c_proj = RowSequenceParallelLinear.from_linear(attn.c_proj, group=group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 C / t): the whole sequence, this rank's heads
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_size).transpose(1, 2) for t in qkv.chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh / t, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T / t, C)


# --------------------------------------------------------------------------- styles


def _sum_gradients_over(module: nn.Module, group) -> None:
    """Each rank's gradient of a replicated weight covers its tokens only: sum them (Megatron
    all-reduces these after backward; here a hook does it as each gradient is made)."""
    _, size = group_rank_size(group)
    if size == 1:
        return
    for p in module.parameters(recurse=True):
        p.register_hook(lambda grad: raw_all_reduce(grad, group, "backward"))  # communication


@dataclass(frozen=True)
class SequenceParallel:
    """A module that works token by token (LayerNorm, dropout) runs on this rank's sequence
    block, unchanged; the gradients of its replicated weights are summed over the group."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        _sum_gradients_over(module, group)
        return module


@dataclass(frozen=True)
class ScatterSequence:
    """Where the sequence is cut: the module's input, whole on every rank, becomes this rank's
    block (its gradient all-gathered backward), and the module runs as :class:`SequenceParallel`."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        module.register_forward_pre_hook(
            lambda _, args: (scatter_to_sequence_parallel(args[0], group), *args[1:])
        )
        return SequenceParallel()(module, group)


@dataclass(frozen=True)
class ColwiseSequenceParallel:
    """An ``nn.Linear`` split by output features, its input a sequence block (all-gathered)."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, nn.Linear)
        return ColumnSequenceParallelLinear.from_linear(module, group=group)


@dataclass(frozen=True)
class RowwiseSequenceParallel:
    """An ``nn.Linear`` split by input features, its output reduce-scattered along the sequence."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, nn.Linear)
        return RowSequenceParallelLinear.from_linear(module, group=group)


@dataclass(frozen=True)
class AttentionSequenceParallel:
    """Causal self-attention, heads split, entered and left on sequence blocks."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, CausalSelfAttention)
        n_head = module.c_proj.in_features // module.head_size
        return SequenceParallelSelfAttention.from_attention(module, n_head, group)


@dataclass(frozen=True)
class FeedForwardSequenceParallel:
    """The transformer MLP, entered and left on sequence blocks."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, FeedForward)
        return SequenceParallelMLP.from_feedforward(module, group)


SEQUENCE_PARALLEL_PLAN: dict[str, Style] = {
    "wte": VocabParallel(),  # (B, T, C) on every rank: the embedding's all-reduce
    "drop": ScatterSequence(),  # the sequence is cut here: (B, T / t, C) from now on
    "blocks.*.ln_1": SequenceParallel(),
    "blocks.*.attn": AttentionSequenceParallel(),  # all-gather ... reduce-scatter
    "blocks.*.ln_2": SequenceParallel(),
    "blocks.*.mlp": FeedForwardSequenceParallel(),  # all-gather ... reduce-scatter
    "ln_f": SequenceParallel(),
    "lm_head": ColwiseSequenceParallel(),  # all-gather: (B, T, V / t) for the split loss
    "criterion": LossParallel(),
}


def sequence_parallel_char_gpt(model: nn.Module, group=None) -> nn.Module:
    """This rank's TP + SP shard of a char-GPT: a copy with :data:`SEQUENCE_PARALLEL_PLAN`
    applied. Sizes as :func:`~dmlbook.advanced.composition.plan.tensor_parallel_char_gpt`, and the
    sequence length divisible by the TP size; dropout is refused."""
    if model.config.dropout:
        raise ValueError(f"sequence parallelism here needs dropout=0.0, got {model.config.dropout}")
    return apply_plan(copy.deepcopy(model), SEQUENCE_PARALLEL_PLAN, group)


# --------------------------------------------------------------------------- activation memory

# What a block saves for backward on the whole sequence under plain tensor parallelism (the
# names of block_saved_terms): Korthikanti et al.'s "10" of sbh(10 + 24/t + 5as/ht).
_REPLICATED_UNDER_TP = (
    "LayerNorm inputs (2)",
    "LayerNorm mean and 1/std (2)",
    "qkv and fc inputs (LayerNorm outputs)",
    "dropout masks after attention and MLP",
)


def activation_bytes_per_rank(
    spec, batch: int, seq: int, tp_size: int, sequence_parallel: bool, precision: str = "fp32"
) -> int:
    """Bytes one transformer block saves for backward on each of ``tp_size`` ranks: with tensor
    parallelism alone the terms on the whole sequence stay whole and the rest is divided by
    ``tp_size``; with sequence parallelism every term is divided (Korthikanti et al. 2022:
    sbh(10 + 24/t) becomes sbh 34/t). ``spec``: a
    :class:`~dmlbook.model_parallel.memory.spec.TransformerSpec`."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if spec.n_head % tp_size:
        raise ValueError(f"n_head={spec.n_head} is not divisible by tp_size={tp_size}")
    if sequence_parallel and seq % tp_size:
        raise ValueError(f"sequence length={seq} is not divisible by tp_size={tp_size}")
    terms = block_saved_terms(spec, batch, seq, precision)
    whole = sum(v for k, v in terms.items() if k in _REPLICATED_UNDER_TP)
    split = sum(v for k, v in terms.items() if k not in _REPLICATED_UNDER_TP)  # heads, d_ff
    if sequence_parallel:
        return (whole + split) // tp_size
    return whole + split // tp_size


def measure_block_activations(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes ``block`` saves for backward when it runs on ``x`` (counted per storage by chapter
    4's :class:`~dmlbook.model_parallel.recompute.SavedTensorMeter`; weights excluded)."""
    with SavedTensorMeter(exclude=list(block.parameters())) as meter:
        out = block(x)
    held = meter.current
    del out
    return held
