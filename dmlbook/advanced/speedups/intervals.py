"""Interval arithmetic on a trace's time spans: union, intersection, difference, overlap (ch. 12).

Plain Python on ``(start, end)`` pairs, tested on hand-made intervals; chapter 12's overlap of
communication with backward is :func:`overlap_fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The same time covered by sorted, disjoint intervals (touching ones merged)."""
    merged: list[list[float]] = []
    for start, end in sorted(_checked(intervals)):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _checked(intervals: Iterable[Interval]) -> list[Interval]:
    out = []
    for interval in intervals:
        if len(interval) != 2:
            raise ValueError(f"an interval is (start, end), got {interval!r}")
        start, end = float(interval[0]), float(interval[1])
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"interval {interval!r} must be finite with start <= end")
        out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total time covered, each moment counted once."""
    return sum(end - start for start, end in union(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by both ``a`` and ``b``, as disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:  # the one that ends first cannot meet anything later
            i += 1
        else:
            j += 1
    return out


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by ``a`` but not by ``b``."""
    out = []
    b = union(b)
    for start, end in union(a):
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def overlap_fraction(communication: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Share of the communication time that ran while ``compute`` did (0.0 if none ran)."""
    communication = union(communication)
    total = length(communication)
    return length(intersection(communication, compute)) / total if total > 0 else 0.0
