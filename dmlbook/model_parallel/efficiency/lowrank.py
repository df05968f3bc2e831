"""Model decomposition: replace a weight matrix by the product of two thin ones (truncated SVD).

Chapter 8 ("Achieving higher throughput and lower latency") decomposes a model to serve it
faster. A Linear layer's ``W`` (out x in) is factorised as ``W = U S V^T`` (singular value
decomposition) and only the ``r`` largest singular values are kept:

    W ~ (U_r S_r^1/2) (S_r^1/2 V_r^T)   =   up (out x r)  @  down (r x in)

so one ``out x in`` product becomes two thin ones costing ``r (in + out)`` multiply-adds per
input instead of ``in * out``: fewer parameters and less time whenever ``r`` is below
``in * out / (in + out)`` (:func:`breakeven_rank`). By the Eckart-Young theorem no rank-r matrix
is closer to ``W`` (in the Frobenius norm): the error is the root of the dropped ``sigma_i^2``.
:func:`energy_rank` picks the rank that keeps a fraction of that "energy".
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from dmlbook.notebook import interleaved_medians

__all__ = [
    "LowRankLinear",
    "breakeven_rank",
    "decompose",
    "energy_rank",
    "factorize",
    "time_ranks",
]


class LowRankLinear(nn.Module):
    """``x -> up(down(x))``: a rank-``r`` stand-in for an ``in -> out`` Linear layer."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(
                f"rank must be in [1, {min(in_features, out_features)}] for a "
                f"{in_features} -> {out_features} layer, got {rank}"
            )
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False)  # S_r^1/2 V_r^T: (r, in)
        self.up = nn.Linear(rank, out_features, bias=bias)  # U_r S_r^1/2: (out, r), the bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))  # (..., in) -> (..., r) -> (..., out)

    def weight(self) -> torch.Tensor:
        """The rank-r matrix the layer applies, ``up @ down`` (out x in)."""
        return self.up.weight @ self.down.weight


def breakeven_rank(in_features: int, out_features: int) -> int:
    """Largest rank whose factors hold fewer numbers (and multiply-adds) than the full matrix."""
    return (in_features * out_features - 1) // (in_features + out_features)


def energy_rank(weight: torch.Tensor, keep: float = 0.99) -> int:
    """Smallest rank ``r`` with ``sum(sigma_1..r^2) >= keep * sum(sigma^2)``: the truncation
    whose squared Frobenius error is at most ``1 - keep`` of ``||W||^2``."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if weight.dim() != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(weight.shape)}")
    energy = torch.linalg.svdvals(weight.detach().double()) ** 2
    kept = energy.cumsum(0) / energy.sum()  # fraction kept by the first r, r = 1, 2, ...
    # The first r whose kept fraction reaches `keep` (a hair of slack for float64 rounding).
    return int((kept < keep - 1e-12).sum().item()) + 1


def factorize(linear: nn.Linear, rank: int) -> LowRankLinear:
    """The rank-``rank`` truncated SVD of ``linear``'s weight as a :class:`LowRankLinear`."""
    out_features, in_features = linear.weight.shape
    low = LowRankLinear(in_features, out_features, rank, bias=linear.bias is not None)
    weight = linear.weight.detach().double()  # the SVD in float64, rounded to float32 once
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)  # (out, k), (k,), (k, in)
    root = s[:rank].sqrt()  # split S evenly: both factors get entries of similar size
    dtype = linear.weight.dtype
    with torch.no_grad():
        low.up.weight.copy_((u[:, :rank] * root).to(dtype))  # (out, r)
        low.down.weight.copy_((root[:, None] * vh[:rank]).to(dtype))  # (r, in)
        if linear.bias is not None:
            low.up.bias.copy_(linear.bias)
    return low.to(linear.weight.device)


def decompose(
    model: nn.Module, rank: int | None = None, keep: float | None = None, min_saving: float = 0.0
) -> nn.Module:
    """A copy of ``model`` with its Linear layers factorised, at a fixed ``rank`` (capped at each
    layer's smaller side) or at each layer's :func:`energy_rank` for ``keep``. A layer is left
    whole unless the factors save more than ``min_saving`` of its weights (0: any saving)."""
    if (rank is None) == (keep is None):
        raise ValueError("give exactly one of rank= or keep=")
    if rank is not None and rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    decomposed = copy.deepcopy(model)
    for name, layer in list(decomposed.named_modules()):
        if not isinstance(layer, nn.Linear):
            continue
        out_features, in_features = layer.weight.shape
        r = min(rank, in_features, out_features) if rank else energy_rank(layer.weight, keep)
        if r * (in_features + out_features) >= (1 - min_saving) * in_features * out_features:
            continue  # the factors would not be smaller: keep the layer as it is
        parent, _, child = name.rpartition(".")
        owner = decomposed.get_submodule(parent) if parent else decomposed
        setattr(owner, child, factorize(layer, r))
    return decomposed


def time_ranks(
    in_features: int,
    out_features: int,
    ranks: Sequence[int],
    batch: int = 256,
    rounds: int = 7,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of one forward through a dense ``in -> out`` Linear and through a
    :class:`LowRankLinear` at each rank, on a ``(batch, in)`` input; rounds interleave the
    variants so that load on the machine hits them all alike. ``clock`` is wall time by default;
    with one intra-op thread, ``time.thread_time`` leaves out the moments the thread waited for
    a core (chapter 8)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=g)
    variants: dict[str, nn.Module] = {"dense": nn.Linear(in_features, out_features)}
    variants |= {f"rank {r}": LowRankLinear(in_features, out_features, r) for r in ranks}
    with torch.no_grad():
        return interleaved_medians(
            {name: partial(layer, x) for name, layer in variants.items()}, rounds, clock
        )
