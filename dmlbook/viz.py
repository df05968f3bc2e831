"""Plots drawn from real runs: bars and curves with labelled axes, shared by every chapter.

Chapter 1 draws its bandwidth bars, time-to-accuracy curves, the accuracy-against-global-batch
sweep and the synchronisation-scheme curves with these two helpers; later chapters add timelines.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = ["bars", "curves"]


def bars(
    values: dict[str, float],
    ylabel: str,
    title: str = "",
    log: bool = False,
    ax: plt.Axes | None = None,
    annotate: str = "{:.3g}",
) -> plt.Axes:
    """One labelled bar per entry of ``values``, each annotated with its number."""
    ax = ax or plt.subplots(figsize=(6, 3.2))[1]
    names = list(values)
    heights = [values[n] for n in names]
    drawn = ax.bar(names, heights, color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(drawn, labels=[annotate.format(h) for h in heights], fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=15)
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
