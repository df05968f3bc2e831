"""Parallel hyper-parameter search: one trial per rank, the best chosen by all-gather.

Chapter 3's "evaluation and hyper-parameter tuning": trials are independent, so they are the
easiest parallelism of all. Each rank trains with its own settings (rank r takes trials r,
r + world, r + 2 world, ...), scores them, and one all-gather of the scores lets every rank agree
on the best, with no coordinator. Ties go to the lower trial index, so all ranks pick the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["search"]


@dataclass
class SearchResult:
    """Every trial's score (in the order of ``configs``), the best index and its settings."""

    scores: list[float]
    best: int
    config: Any
    ran_here: list[int]  # the trial indices this rank ran


def search(
    trial: Callable[[Any], float],
    configs: Sequence[Any],
    maximize: bool = True,
    group=None,
) -> SearchResult:
    """Run ``trial(config)`` for this rank's share of ``configs``; return every score, and the
    best trial, identical on all ranks. Outside a process group it runs every trial in turn."""
    if not configs:
        raise ValueError("search needs at least one config")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    mine = list(range(rank, len(configs), world))
    scores = torch.full((len(configs),), float("nan"), dtype=torch.float64)
    for i in mine:
        score = float(trial(configs[i]))
        if score != score:  # NaN would make every comparison false
            raise ValueError(f"trial {i} ({configs[i]!r}) returned NaN")
        scores[i] = score
    if world > 1:
        everyone = [torch.empty_like(scores) for _ in range(world)]
        dist.all_gather(everyone, scores, group=group)
        for r, theirs in enumerate(everyone):
            scores[r::world] = theirs[r::world]
    values = scores.tolist()
    key = (lambda i: (-values[i], i)) if maximize else (lambda i: (values[i], i))
    best = min(range(len(values)), key=key)
    return SearchResult(values, best, configs[best], mine)
