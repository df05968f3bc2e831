"""Small helpers that several chapters' notebooks share, so that no notebook redefines them.

* :func:`digits_mlp`: the 64-64-10 MLP for the 8x8 digits that chapters 2 and 3 train;
* :func:`max_difference`: the largest elementwise difference between two state dicts, the number
  chapters 7, 9 and 9b print when they compare a parallel run with one process;
* :func:`median_by`: the median item of repeated measurements by a key (chapters 1 and 6 keep the
  median round or step whole, so its parts stay consistent);
* :func:`interleaved_medians`: the median time of several callables, timed in interleaved rounds
  so that a busy moment on a shared machine hits all of them alike (chapter 8), on wall time
  or, for one thread's work, on that thread's CPU time (chapter 6).

Algorithms live in their own modules; this one only keeps the notebooks short.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from dmlbook.models import MLP, mlp

__all__ = ["digits_mlp", "interleaved_medians", "max_difference", "median_by"]

T = TypeVar("T")


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


def median_by(items: Sequence[T], key: Callable[[T], float]) -> T:
    """The item whose ``key`` is the median (the upper one of an even count), kept whole."""
    if not items:
        raise ValueError("median_by of no items")
    return sorted(items, key=key)[len(items) // 2]


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]],
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Each callable's median time in seconds over ``rounds`` rounds; each round calls every one
    once, after one warm-up call each, so that a slow moment hits them all alike.

    ``clock`` is wall time by default. Work done on the calling thread alone (one intra-op
    thread) can be timed with ``time.thread_time``: that thread's CPU time, which leaves out
    the moments it waited for a core while other work on the machine ran (chapter 6)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up: first calls allocate
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}
