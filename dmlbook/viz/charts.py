"""Bars, stacked bars and curves with labelled axes, and profiler intervals on a time line: the
plots every chapter draws from its measurements.

``bars`` is used by chapters 1-10 and 12 (bandwidths, times, memory, ratios), ``stacked_bars`` by
chapters 3, 9b, 10 and 12 (a total split into its parts), ``curves`` by chapters 1, 8, 9, 9b and 10
(loss and accuracy against steps or time), ``spans`` by chapter 12 (profiler intervals, which
shows communication against computation).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = [
    "bars",
    "curves",
    "spans",
    "stacked_bars",
]


def bars(
    values: dict[str, float],
    ylabel: str,
    title: str = "",
    log: bool = False,
    ax: plt.Axes | None = None,
    annotate: str = "{:.3g}",
    colors: dict[str, str] | None = None,
) -> plt.Axes:
    """One labelled bar per entry of ``values``, each annotated with its number. ``colors`` maps
    a bar's name to its colour (default: C0, C1, ... in order)."""
    ax = ax or plt.subplots(figsize=(6, 3.2))[1]
    names = list(values)
    heights = [values[n] for n in names]
    colours = [(colors or {}).get(n, f"C{i}") for i, n in enumerate(names)]
    drawn = ax.bar(names, heights, color=colours)
    ax.bar_label(drawn, labels=[annotate.format(h) for h in heights], fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=15)
    return ax


def stacked_bars(
    parts: dict[str, dict[str, float]],
    ylabel: str,
    title: str = "",
    ax: plt.Axes | None = None,
    limit: tuple[float, str] | None = None,
    colors: dict[str, str] | None = None,
) -> plt.Axes:
    """One bar per entry of ``parts`` (label -> {part: value}), its parts stacked in the order of
    the first entry's parts (the legend), the total annotated on top. ``limit`` = (value, label)
    draws a dashed line, such as a device's memory. ``colors`` maps a part to its colour (default:
    C0, C1, ... in order), so that several plots can give one part one colour."""
    ax = ax or plt.subplots(figsize=(7, 3.4))[1]
    names = list(parts)
    order = list(dict.fromkeys(part for shares in parts.values() for part in shares))
    bottom = [0.0] * len(names)
    for i, part in enumerate(order):
        heights = [parts[n].get(part, 0.0) for n in names]
        ax.bar(names, heights, bottom=bottom, label=part, color=(colors or {}).get(part, f"C{i}"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=8)
    if limit is not None:
        ax.axhline(limit[0], color="r", ls="--", lw=1, label=limit[1])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=15)
    ax.legend(fontsize=7)
    return ax


def curves(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    ax: plt.Axes | None = None,
    marker: str = "o",
) -> plt.Axes:
    """One line per entry of ``series``, which maps a label to its (x values, y values)."""
    ax = ax or plt.subplots(figsize=(6, 3.2))[1]
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker=marker, markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def spans(
    rows: dict[str, Sequence[tuple[float, float]]],
    shade: Sequence[tuple[float, float]] = (),
    title: str = "",
    unit: float = 1.0,
    ax: plt.Axes | None = None,
    colors: dict[str, str] | None = None,
) -> plt.Axes:
    """Interval lists as rows of bars (chapter 12's profiler spans): ``rows[name]`` is a list of
    ``(start, end)``, drawn divided by ``unit``; ``shade`` intervals are greyed behind them.
    ``colors`` maps a row's name to its colour (default: C0, C1, ... in order)."""
    ax = ax or plt.subplots(figsize=(9, 0.45 * len(rows) + 1))[1]
    for y, (name, intervals) in enumerate(rows.items()):
        ax.broken_barh([(s / unit, (e - s) / unit) for s, e in intervals], (y - 0.4, 0.8),
                       color=(colors or {}).get(name, f"C{y}"))  # fmt: skip
    for s, e in shade:
        ax.axvspan(s / unit, e / unit, color="0.9", zorder=-1)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_title(title, fontsize=9)
    return ax
