"""Bars, stacked bars and curves with labelled axes, and profiler intervals on a time line: the
plots every chapter draws from its measurements.

``bars`` is used by chapters 1-10 and 12 (bandwidths, times, memory, ratios), ``stacked_bars`` by
chapters 3, 9b, 10 and 12 (a total split into its parts), ``curves`` by chapters 1, 8, 9, 9b and 10
(loss and accuracy against steps or time), ``spans`` by chapter 12 (profiler intervals, which
shows communication against computation). ``bench_figures`` draws the records of
``python -m dmlbook.bench all --json`` for the site's Benchmarks guide.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = [
    "bars",
    "bench_figures",
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


def _bench_ratios(records: Sequence[dict]) -> list[tuple[str, str, float]]:
    """(bench, label, ours / torch's time) for every record of ``python -m dmlbook.bench all
    --json`` that has a torch baseline, but the all-reduce's (``bench_figures`` draws those on
    their own). Records are tagged with their ``bench``; each bench has its own fields."""
    rows: list[tuple[str, str, float]] = []
    recompute: dict[str, dict[str, float]] = {}
    for r in records:
        bench = r.get("bench", "")
        if bench in ("launch", "data-parallel") and r.get("ratio") is not None and "name" in r:
            label = r["name"].replace("launch + all-reduce, ", "").replace("DP step, ", "")
            rows.append((bench, label, float(r["ratio"])))
        elif bench == "ddp" and r.get("implementation") != "torch":
            rows.append((bench, f"{r['model']}, {r['implementation']}", float(r["ratio_vs_torch"])))
        elif bench == "pipeline" and r.get("ratio_vs_torch") is not None:
            label = f"{r['schedule']}, M={r['microbatches']}"
            rows.append((bench, label, float(r["ratio_vs_torch"])))
        elif bench == "recompute":
            recompute.setdefault(r["model"], {})[r["implementation"]] = float(r["step_s"])
    for model, step_s in recompute.items():
        if "ours" in step_s and "torch" in step_s:
            ratio = step_s["ours"] / step_s["torch"]  # both checkpointed, at sqrt(n) segments
            rows.append(("recompute", f"{model}, checkpointed step", ratio))
    return rows


def bench_figures(results: Sequence[dict]) -> dict[str, plt.Figure]:
    """The figures of a ``python -m dmlbook.bench all --json FILE`` run, by key: ``results`` is
    the file's list of records, each tagged with its ``bench``.

    * ``"ratios"``: one horizontal bar per comparison with torch (launch, data-parallel step,
      DDP, recomputation, pipeline schedules): our time over torch's on a log scale, 1 marked,
      so that a bar left of the line is faster than torch and one right of it slower;
    * ``"allreduce"``: every all-reduce algorithm's median time against the message size, beside
      gloo's (torch's ``all_reduce``), and each one's ratio to gloo.

    A key is left out when the run has no records for it. The site saves each figure as
    ``bench-<key>.png`` beside the Benchmarks guide.
    """
    figures: dict[str, plt.Figure] = {}
    rows = _bench_ratios(results)
    if rows:
        benches = list(dict.fromkeys(bench for bench, _, _ in rows))
        colour = {bench: f"C{i}" for i, bench in enumerate(benches)}
        fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
        ys = range(len(rows))
        ratios = [ratio for _, _, ratio in rows]
        drawn = ax.barh(ys, ratios, color=[colour[bench] for bench, _, _ in rows])
        ax.bar_label(drawn, labels=[f"{r:.2f}x" for r in ratios], fontsize=7, padding=2)
        ax.set_xscale("log")
        ax.axvline(1.0, color="0.3", lw=1, ls="--")
        ax.set_yticks(list(ys), [f"{bench}: {label}" for bench, label, _ in rows], fontsize=7)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        low, high = min(ratios + [1.0]), max(ratios + [1.0])
        ax.set_xlim(low / 1.6, high * 2.2)  # room for the numbers right of each bar
        ax.set_xlabel("our time / torch's (log scale; left of the dashed line: faster)")
        ax.set_title("dmlbook against torch, each benchmark", fontsize=10)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colour[b]) for b in benches]
        ax.legend(handles, benches, fontsize=7, loc="lower right")
        fig.tight_layout()
        figures["ratios"] = fig
    allreduce = [r for r in results if r.get("bench") == "allreduce"]
    if allreduce:
        fig, (times, ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
        sizes = sorted({r["bytes"] for r in allreduce})
        gloo = {r["bytes"]: r["baseline_median_s"] for r in allreduce}  # one per size
        times.plot(sizes, [1e3 * gloo[s] for s in sizes], "k-o", lw=2, ms=4, label="gloo (torch)")
        for i, algorithm in enumerate(dict.fromkeys(r["algorithm"] for r in allreduce)):
            mine = sorted((r["bytes"], r) for r in allreduce if r["algorithm"] == algorithm)
            xs = [nbytes for nbytes, _ in mine]
            style = dict(marker="o", ms=3, color=f"C{i}", label=algorithm)
            times.plot(xs, [1e3 * r["median_s"] for _, r in mine], **style)
            ratio.plot(xs, [r["ratio"] for _, r in mine], **style)
        for ax in (times, ratio):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [_bytes_label(s) for s in sizes])
            ax.set_xlabel("message size")
            ax.grid(alpha=0.3)
        world = allreduce[0].get("world_size")
        times.set_yscale("log")
        times.set_ylabel("median time (ms, log scale)")
        times.set_title(f"all-reduce, float32, world size {world}", fontsize=10)
        ratio.set_yscale("log")
        ratio.axhline(1.0, color="k", lw=1.5, ls="--")
        ratio.set_ylabel("time / gloo's (log scale)")
        ratio.set_title("each algorithm over gloo", fontsize=10)
        times.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        figures["allreduce"] = fig
    return figures


def _bytes_label(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"
