"""Layer split: a model as a chain of layers, cut into consecutive pipeline stages (chapter 6).

Chapter 6 ("Pipeline input and layer split") cuts a model this way before it pipelines it:
``layers_of`` lists a model's layers, ``even_partition`` says how many go to each stage and
``split_model`` cuts them into ``nn.Sequential`` stages whose parameters stay shared with the
model. Stage ``s`` lives on rank ``s``; :func:`~dmlbook.models.next_token_loss` (the model
contract's loss) is the last stage's loss for CharGPT.

Chapter 5 estimates and measures each stage's memory with the same cut
(:mod:`dmlbook.model_parallel.memory`), chapter 7 trains and serves the stages
(:mod:`dmlbook.model_parallel.pipeline_workflows`) and moves the cut to balance them
(:mod:`dmlbook.model_parallel.stage_balancing`), and chapter 13 composes it with the other
parallelisms (:mod:`dmlbook.advanced.composition.compose`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dmlbook.model_parallel.schedules import check_sizes
from dmlbook.models import CNN, MLP, CharGPT

__all__ = ["even_partition", "layers_of", "split_model"]


class _CharGPTEmbedding(nn.Module):
    """CharGPT's first layer, token ids (B, T) -> residual stream (B, T, C), as a module."""

    def __init__(self, gpt: CharGPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop  # shared, not copied
        object.__setattr__(self, "gpt", gpt)  # not a submodule: its other layers live elsewhere

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt.embed(idx)  # (B, T) -> (B, T, C)


class _CharGPTHead(nn.Module):
    """CharGPT's last layer, residual stream (B, T, C) -> logits (B, T, V), as a module."""

    def __init__(self, gpt: CharGPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head
        object.__setattr__(self, "gpt", gpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt.head(x)  # (B, T, C) -> (B, T, V)


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The model as a chain of layers to cut into stages; they share parameters with ``model``.

    CharGPT: ``[embedding, *blocks, head]``. MLP: its Linear(+ReLU) units (the first flattens its
    input, as ``MLP.forward`` does). CNN: the layers of ``.layers``. nn.Sequential: its children.
    """
    if isinstance(model, CharGPT):
        return [_CharGPTEmbedding(model), *model.blocks, _CharGPTHead(model)]
    if isinstance(model, MLP):
        units: list[list[nn.Module]] = []  # each Linear with the ReLU after it
        for layer in model.layers:
            if isinstance(layer, nn.Linear) or not units:
                units.append([])
            units[-1].append(layer)
        units[0].insert(0, nn.Flatten())
        return [nn.Sequential(*unit) for unit in units]
    if isinstance(model, CNN):
        return list(model.layers)
    if isinstance(model, nn.Sequential):
        return list(model)
    raise TypeError(f"no layer list for {type(model).__name__}; pass a list of modules instead")


def even_partition(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, as equal as can be (sizes differ by at most one, longer ones first)."""
    check_sizes(stages, 1)
    if n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers into {stages} non-empty stages")
    short, longer = divmod(n_layers, stages)
    return [short + 1] * longer + [short] * (stages - longer)


def split_model(layers: Sequence[nn.Module], counts: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``layers`` into consecutive stages of ``counts[s]`` layers each (shared, not copied)."""
    if any(c < 1 for c in counts) or sum(counts) != len(layers):
        raise ValueError(f"counts {list(counts)} must be >= 1 and sum to {len(layers)} layers")
    stages, start = [], 0
    for count in counts:
        stages.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return stages


def stage_for_rank(model: nn.Module, counts: Sequence[int] | None, rank: int, size: int):
    """This rank's stage module and the split, checked against the group's size."""
    layers = layers_of(model)
    counts = list(counts) if counts is not None else even_partition(len(layers), size)
    if len(counts) != size:
        raise ValueError(f"counts {counts} name {len(counts)} stages, but the group has {size}")
    return split_model(layers, counts)[rank], counts
