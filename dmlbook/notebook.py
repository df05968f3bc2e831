"""Small helpers that several chapters' notebooks share, so that no notebook redefines them.

* :func:`digits_mlp`: the 64-64-10 MLP for the 8x8 digits that chapters 2 and 3 train;
* :func:`max_difference`: the largest elementwise difference between two state dicts, the number
  chapters 7, 9 and 9b print when they compare a parallel run with one process.

Algorithms live in their own modules; this one only keeps the notebooks short.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dmlbook.models import MLP, mlp

__all__ = ["digits_mlp", "max_difference"]


def digits_mlp(seed: int = 0) -> MLP:
    """An MLP for the 8x8 digits, 64 -> 64 -> 10, with weights fixed by ``seed`` (chapters 2, 3)."""
    return mlp(seed=seed, in_features=64, hidden=(64,), out_features=10)


def max_difference(
    ours: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> float:
    """The largest ``|ours[k] - reference[k]|`` over every tensor of ``reference`` (chapters 7, 9,
    9b). A key of ``reference`` missing from ``ours`` is a KeyError, not a silent pass."""
    if not reference:
        raise ValueError("max_difference of an empty reference compares nothing")
    return max(
        (ours[name].detach().double() - ref.detach().double()).abs().max().item()
        for name, ref in reference.items()
    )
