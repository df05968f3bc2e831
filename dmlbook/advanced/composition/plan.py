"""Plans: parallelisms applied to an unmodified model, module path by module path (chapter 9).

The model is written once, for one process (:class:`~dmlbook.models.CharGPT`). Parallelising it
is a transformation, not a second model class:

* a **plan** maps module paths to **styles**. ``"blocks.*.attn"`` names the attention of every
  block (``*`` stands for one name or index); the style says what replaces that module on this
  rank, built from it by chapter 9's Megatron layers. :data:`CHAR_GPT_PLAN` is the char-GPT's:
  vocabulary-parallel embedding, attention heads and MLP split column-then-row, a column-parallel
  ``lm_head`` whose logits stay split, and the ``criterion`` (the loss module) replaced by one
  that takes the split logits;
* :func:`apply_plan` swaps, in place, each planned module for this rank's shard; a plan entry
  that matches nothing is an error, so a typo cannot train the unsplit model; a style given a
  module of the wrong type says so (a style checks the type, not what attributes it happens to
  have).

Chapter 13's sequence parallelism (:mod:`dmlbook.advanced.tensor_parallel.sequence_parallel`),
context parallelism (:mod:`dmlbook.advanced.context_parallel.styles`) and expert parallelism
(:mod:`dmlbook.advanced.expert_parallel.layer`) bring their own styles to the same
:func:`apply_plan`; :func:`dmlbook.advanced.composition.compose.compose` applies them all in one
stated order. torch's counterpart is ``torch.distributed.tensor.parallel.parallelize_module``
with ``ColwiseParallel`` / ``RowwiseParallel`` and ``loss_parallel``.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from dmlbook.advanced import tensor_parallel as tp
from dmlbook.models import CausalSelfAttention, FeedForward, TokenCrossEntropy

__all__ = [
    "CHAR_GPT_PLAN",
    "AttentionParallel",
    "ColwiseParallel",
    "LossParallel",
    "RowwiseParallel",
    "Style",
    "VocabParallel",
    "apply_plan",
    "expect_module",
    "tensor_parallel_char_gpt",
]


class Style(Protocol):
    """What a plan maps a module path to: this rank's replacement of the module there."""

    def __call__(self, module: nn.Module, group) -> nn.Module: ...


def expect_module(style: object, module: nn.Module, *types: type) -> None:
    """A TypeError naming the style and the module's type unless it is one of ``types``."""
    if not isinstance(module, types):
        wanted = " or ".join(t.__name__ for t in types)
        raise TypeError(f"{type(style).__name__} applies to {wanted}, not {type(module).__name__}")


# --------------------------------------------------------------------------- styles


@dataclass(frozen=True)
class ColwiseParallel:
    """An ``nn.Linear`` split by output features; ``gather_output`` all-gathers the result."""

    gather_output: bool = False

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, nn.Linear)
        return tp.ColumnParallelLinear.from_linear(module, self.gather_output, group)


@dataclass(frozen=True)
class RowwiseParallel:
    """An ``nn.Linear`` split by input features; its partial outputs are all-reduced."""

    input_is_parallel: bool = True

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, nn.Linear)
        return tp.RowParallelLinear.from_linear(module, self.input_is_parallel, group)


@dataclass(frozen=True)
class VocabParallel:
    """An ``nn.Embedding`` split by vocabulary rows; the looked-up vectors are all-reduced."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, nn.Embedding)
        return tp.VocabParallelEmbedding.from_embedding(module, group)


@dataclass(frozen=True)
class AttentionParallel:
    """Causal self-attention, heads split: q|k|v column-parallel, ``c_proj`` row-parallel."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, CausalSelfAttention)
        n_head = module.c_proj.in_features // module.head_size
        return tp.ParallelSelfAttention.from_attention(module, n_head, group)


@dataclass(frozen=True)
class FeedForwardParallel:
    """The transformer MLP: ``c_fc`` column-parallel, ``c_proj`` row-parallel."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, FeedForward)
        return tp.ParallelMLP.from_feedforward(module, group)


@dataclass(frozen=True)
class LossParallel:
    """The model's loss module (a char-GPT's ``criterion``) replaced by
    :class:`~dmlbook.advanced.tensor_parallel.vocab_parallel.VocabParallelCrossEntropy`, which
    takes vocabulary-split logits, so the logits are never gathered."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, TokenCrossEntropy, tp.VocabParallelCrossEntropy)
        return tp.VocabParallelCrossEntropy(group)


CHAR_GPT_PLAN: dict[str, Style] = {
    "wte": VocabParallel(),
    "blocks.*.attn": AttentionParallel(),
    "blocks.*.mlp": FeedForwardParallel(),
    "lm_head": ColwiseParallel(gather_output=False),  # (B, T, V / p): the loss takes it split
    "criterion": LossParallel(),
}


# --------------------------------------------------------------------------- applying


def apply_plan(model: nn.Module, plan: Mapping[str, Style], group=None) -> nn.Module:
    """Replace, in place, every module that ``plan`` names by its shard on this rank of
    ``group``; returns ``model`` (or its replacement, for a root entry ``""``)."""
    names = [name for name, _ in model.named_modules()]
    for pattern, style in plan.items():
        matches = [n for n in names if _matches(n, pattern)]
        if not matches:
            raise ValueError(f"the plan's {pattern!r} matches no module of {type(model).__name__}")
        for name in matches:
            if name == "":
                model = style(model, group)
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, style(getattr(parent, child), group))
    return model


def _matches(name: str, pattern: str) -> bool:
    """``*`` stands for exactly one name or index: ``blocks.*.attn`` is ``blocks.3.attn``."""
    depth = name.count(".") if name else -1
    return fnmatch.fnmatchcase(name, pattern) and depth == (pattern.count(".") if pattern else -1)


def tensor_parallel_char_gpt(model: nn.Module, group=None) -> nn.Module:
    """This rank's shard of a char-GPT over ``group``: a copy with :data:`CHAR_GPT_PLAN` applied.

    The vocabulary, ``n_head`` and ``4 * n_embd`` must divide by the TP size (pad the vocabulary
    with :func:`~dmlbook.advanced.tensor_parallel.padded_vocab_size`). Dropout is refused: each
    rank would drop different activations of what must be one computation.
    """
    if model.config.dropout:
        raise ValueError(f"tensor parallelism here needs dropout=0.0, got {model.config.dropout}")
    return apply_plan(copy.deepcopy(model), CHAR_GPT_PLAN, group)
