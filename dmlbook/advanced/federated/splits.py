"""Client splits for federated learning: IID, Dirichlet non-IID, and who hosts whom (ch. 10)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def _check_clients(num_clients: int, num_samples: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if num_clients > num_samples:
        raise ValueError(
            f"num_clients={num_clients} is larger than the data ({num_samples} samples): "
            "some client would get nothing"
        )


def iid_split(num_samples: int, num_clients: int, seed: int = 0) -> list[torch.Tensor]:
    """Each client's sample indices: one seeded shuffle dealt out in near-equal contiguous parts
    (sizes differ by at most one). Every index is used exactly once."""
    _check_clients(num_clients, num_samples)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    return [part.sort().values for part in torch.tensor_split(order, num_clients)]


def dirichlet_split(
    labels: torch.Tensor, num_clients: int, alpha: float, seed: int = 0, min_size: int = 1
) -> list[torch.Tensor]:
    """Each client's sample indices under label skew: for every class, the shares of its samples
    that go to the clients are drawn from Dirichlet(alpha, ..., alpha). alpha -> infinity is
    IID; alpha = 0.1 gives each client a few classes. Draws again (up to 100 times) until
    every client has at least ``min_size`` samples. Every index is used exactly once."""
    labels = torch.as_tensor(labels)
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D, got shape {tuple(labels.shape)}")
    _check_clients(num_clients, len(labels))
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if min_size < 0 or min_size * num_clients > len(labels):
        raise ValueError(f"min_size={min_size} is impossible for {num_clients} clients")
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for cls in np.unique(y):
            members = rng.permutation(np.flatnonzero(y == cls))
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        splits = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in splits) >= min_size:
            return [torch.from_numpy(s).long() for s in splits]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw in 100 gave every one of {num_clients} clients "
        f"{min_size} samples: use fewer clients or a larger alpha"
    )


def label_histograms(
    labels: torch.Tensor, splits: Sequence[torch.Tensor], classes: int | None = None
) -> torch.Tensor:
    """(clients, classes) counts: how many samples of each label every client holds."""
    labels = torch.as_tensor(labels)
    classes = int(labels.max()) + 1 if classes is None else classes
    return torch.stack([torch.bincount(labels[s], minlength=classes) for s in splits])


def label_skew(labels: torch.Tensor, splits: Sequence[torch.Tensor]) -> float:
    """Mean over clients of the total-variation distance between the client's label
    distribution and the whole dataset's: 0 for identical mixes, near 1 when clients hold
    labels the others lack."""
    hist = label_histograms(labels, splits).double()
    overall = hist.sum(0) / hist.sum()
    per_client = hist / hist.sum(1, keepdim=True).clamp_min(1)
    return (0.5 * (per_client - overall).abs().sum(1)).mean().item()


def sample_clients(num_clients: int, fraction: float, round_index: int, seed: int = 0) -> list[int]:
    """The clients that take part in round ``round_index``: max(1, round(fraction * C)) of them,
    drawn from a generator seeded by (seed, round), so every rank computes the same list."""
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    chosen = max(1, round(fraction * num_clients))
    g = torch.Generator().manual_seed(seed * 1_000_003 + round_index)
    return sorted(torch.randperm(num_clients, generator=g)[:chosen].tolist())


def client_owner(client: int, world_size: int) -> int:
    """The rank that hosts ``client``: rank 0 is the server, clients go round ranks 1.."""
    return 1 + client % (world_size - 1)
