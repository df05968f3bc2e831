"""A model as a plain list of layers: the unit chapter 8 freezes, streams from disk and times.

Freezing "the first k layers" and loading "one layer at a time" both need the model cut into a
sequence whose layers own every parameter between them. :func:`as_layers` cuts the book's models
(``dmlbook.models``) that way; the layers share their parameters with the model, so freezing a
layer freezes the model's weights. :func:`run_layers` and :func:`next_token_loss` are the forward
pass and the loss that go with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dmlbook.models import MLP, CharGPT

__all__ = ["as_layers", "layer_loss", "run_layers"]


class GPTEmbedding(nn.Module):
    """A ``CharGPT``'s token and position embeddings: ids ``(B, T)`` -> stream ``(B, T, C)``."""

    def __init__(self, gpt: CharGPT) -> None:
        super().__init__()
        self.config, self.wte, self.wpe, self.drop = gpt.config, gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return CharGPT.embed(self, idx)  # the model's own code, run on the modules held here


class GPTHead(nn.Module):
    """A ``CharGPT``'s final LayerNorm and ``lm_head``: ``(B, T, C)`` -> logits ``(B, T, V)``."""

    def __init__(self, gpt: CharGPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CharGPT.head(self, x)


def as_layers(model: nn.Module) -> nn.ModuleList:
    """``model`` as a list of layers that together hold all its parameters, shared, not copied.

    An ``MLP`` becomes its Linear layers, each with the ReLU after it; a ``CharGPT`` becomes its
    embedding, its blocks and its head. ``run_layers(as_layers(m), x)`` equals ``m(x)`` (the
    logits, for a ``CharGPT``).
    """
    if isinstance(model, MLP):
        units: list[list[nn.Module]] = []
        for layer in model.layers:
            if isinstance(layer, nn.Linear) or not units:
                units.append([])
            units[-1].append(layer)
        return nn.ModuleList(nn.Sequential(*unit) for unit in units)
    if isinstance(model, CharGPT):
        return nn.ModuleList([GPTEmbedding(model), *model.blocks, GPTHead(model)])
    raise TypeError(f"no layer list for {type(model).__name__}; pass an MLP or a CharGPT")


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Apply ``layers`` in order (an MLP's layers take flat ``(N, features)`` inputs)."""
    for layer in layers:
        x = layer(x)
    return x


def layer_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits ``(N, C)`` or token logits ``(B, T, V)`` and targets."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
