"""Plots drawn from real runs: bars and curves with labelled axes, shared by every chapter.

Chapter 1 draws its bandwidth bars, time-to-accuracy curves, the accuracy-against-global-batch
sweep and the synchronisation-scheme curves with ``bars`` and ``curves``; chapter 2 draws which
chunk of a ring all-reduce sits where with ``chunk_grid`` (a slider steps through it); chapters 6
and 7 draw the per-stage timeline of a pipelined step with ``gantt`` (the idle bubble shows as
white space); chapter 13 draws the tokens each expert of a mixture of experts received, kept and
dropped, against its capacity with ``expert_load``, which rank holds what on a 5-D layout with
``who_holds_what`` and one composed step of every rank with ``gantt`` (its gradient sync and
optimizer step in their own colours).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import matplotlib.pyplot as plt

__all__ = [
    "bars",
    "chunk_grid",
    "curves",
    "expert_load",
    "gantt",
    "stacked_bars",
    "who_holds_what",
]


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


def stacked_bars(
    parts: dict[str, dict[str, float]],
    ylabel: str,
    title: str = "",
    ax: plt.Axes | None = None,
    limit: tuple[float, str] | None = None,
) -> plt.Axes:
    """One bar per entry of ``parts`` (label -> {part: value}), its parts stacked in the order of
    the first entry's parts (the legend), the total annotated on top. ``limit`` = (value, label)
    draws a dashed line, such as a device's memory."""
    ax = ax or plt.subplots(figsize=(7, 3.4))[1]
    names = list(parts)
    order = list(dict.fromkeys(part for shares in parts.values() for part in shares))
    bottom = [0.0] * len(names)
    for i, part in enumerate(order):
        heights = [parts[n].get(part, 0.0) for n in names]
        ax.bar(names, heights, bottom=bottom, label=part, color=f"C{i}")
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


def expert_load(
    routed: Sequence[int],
    capacity: int | None = None,
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Tokens routed to each expert of a mixture of experts (``Routing.routed_per_expert``),
    split into those kept and those dropped beyond ``capacity`` (a dashed line)."""
    cap = capacity if capacity is not None else max(routed, default=0)
    parts = {
        f"expert {e}": {"kept": min(int(n), cap), "dropped": max(0, int(n) - cap)}
        for e, n in enumerate(routed)
    }
    limit = (capacity, "capacity") if capacity is not None else None
    return stacked_bars(parts, "tokens", title, ax=ax, limit=limit)


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


def chunk_grid(
    holdings: Sequence[Sequence[frozenset[int]]], title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """A ranks x chunks grid: each cell lists whose contributions that rank's copy of the chunk
    holds (``holdings[rank][chunk]``, as :func:`dmlbook.comm.collectives.chunk_holdings` replays
    them), darker the more ranks it sums; a complete chunk is outlined.
    """
    world = len(holdings)
    ax = ax or plt.subplots(figsize=(1.1 * world + 1, 0.7 * world + 0.8))[1]
    shade = [[len(cell) / world for cell in row] for row in holdings]
    ax.imshow(shade, cmap="Blues", vmin=0, vmax=1.6, aspect="auto")
    for r, row in enumerate(holdings):
        for c, cell in enumerate(row):
            done = len(cell) == world
            ax.text(
                c,
                r,
                "all" if done else "+".join(map(str, sorted(cell))),
                ha="center",
                va="center",
                fontsize=8,
                fontweight="bold" if done else "normal",
            )
            if done:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, lw=2, ec="k"))
    ax.set_xticks(range(world), [f"chunk {c}" for c in range(world)], fontsize=8)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
    ax.set_title(title, fontsize=9)
    return ax


def message_schedule(
    sends: Sequence,
    world_size: int,
    title: str = "",
    ax: plt.Axes | None = None,
    tensor_bytes: int | None = None,
) -> plt.Axes:
    """Who sends to whom at each step of a collective: one column per step, one row per rank, an
    arrow per message (recorded :class:`dmlbook.comm.trace.Send` events, gathered from every
    rank), labelled with its size as a fraction of ``tensor_bytes`` (default: of the largest
    message), "n" being the whole tensor. Chapter 2 draws the tree and recursive doubling with it.
    """
    steps = sorted({s.step for s in sends})
    column = {step: i for i, step in enumerate(steps)}
    whole = tensor_bytes or max((s.nbytes for s in sends), default=1) or 1
    ax = ax or plt.subplots(figsize=(1.2 * len(steps) + 1.4, 0.55 * world_size + 0.9))[1]
    for r in range(world_size):
        ax.axhline(r, color="0.85", lw=1, zorder=0)
    messages = sorted({(s.step, s.dst < s.src, s.src, s.dst, s.nbytes) for s in sends})
    for step in steps:  # spread a step's messages across its column, so that none overlap
        here = [m for m in messages if m[0] == step]
        for i, (_, up, src, dst, nbytes) in enumerate(here):
            x = column[step] + (i - (len(here) - 1) / 2) * min(0.7 / max(len(here) - 1, 1), 0.25)
            ax.annotate(
                "",
                xy=(x, dst),
                xytext=(x, src),
                arrowprops=dict(arrowstyle="-|>", color="C3" if up else "C0", lw=1.5),
            )
            size = nbytes / whole
            ax.text(
                x + 0.03,
                (src + dst) / 2,
                "n" if size == 1 else f"{size:.2g}n",
                fontsize=7,
                ha="left",
                va="center",
            )
    ax.set_xlim(-0.6, len(steps) - 0.4)
    ax.set_ylim(world_size - 0.5, -0.5)
    ax.set_xticks(range(len(steps)), [str(i) for i in range(len(steps))], fontsize=8)
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)], fontsize=8)
    ax.set_xlabel("step (a column's messages travel together)", fontsize=8)
    ax.set_title(title, fontsize=9)
    return ax


def checkpoint_segments(
    segments: Sequence[range], title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """Recomputation's plan for a chain of layers (``segments`` as
    :func:`dmlbook.model_parallel.recompute.split_segments` cuts them): one box per layer's
    activation, coloured by segment; solid where forward keeps it, pale where it is dropped and
    recomputed in backward. Every segment keeps its input; the last one keeps everything (it is
    never recomputed). Chapter 4 draws it before the recomputation code.
    """
    n = sum(len(seg) for seg in segments)
    ax = ax or plt.subplots(figsize=(min(0.3 * n + 1.5, 12), 1.5))[1]
    for k, seg in enumerate(segments):
        last = k == len(segments) - 1
        for layer in seg:
            kept = last or layer == seg.start
            ax.add_patch(
                plt.Rectangle(
                    (layer, 0), 0.9, 0.9, color=f"C{k % 10}", alpha=1.0 if kept else 0.25, lw=0
                )
            )
    ax.set_xlim(-0.2, n + 0.1)
    ax.set_ylim(-0.1, 1.0)
    ax.set_yticks([])
    ax.set_xlabel(
        "layer (solid: activation kept in forward; pale: dropped, recomputed)", fontsize=8
    )
    ax.set_title(title, fontsize=9)
    return ax


class _Op(Protocol):  # what gantt reads of an op, e.g. dmlbook.model_parallel.pipeline.OpRecord
    op: str
    microbatch: int
    start: float
    end: float


# forward blue, backward orange, gradient sync green, optimizer step purple; others grey
GANTT_COLOURS = {"F": "#4c8bd6", "B": "#e8913a", "sync": "#59a14f", "step": "#b07aa1"}
_GANTT_NAMES = {"F": "forward", "B": "backward", "sync": "gradient sync", "step": "optimizer step"}


def gantt(
    timelines: Sequence[Sequence[_Op]],
    title: str = "",
    ax: plt.Axes | None = None,
    unit: str = "ms",
    labels: Sequence[str] | None = None,
) -> plt.Axes:
    """Per-stage timeline of a pipelined step: one row per stage (stage 0 on top), one box per
    op from its start to its end, F and B in different colours, the micro-batch number inside.
    White space is idle time: the pipeline bubble, measured rather than drawn from a formula.
    """
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    rows = len(timelines)
    ax = ax or plt.subplots(figsize=(8, 0.55 * rows + 1.1))[1]
    starts = [r.start for timeline in timelines for r in timeline]
    t0 = min(starts, default=0.0)
    for row, timeline in enumerate(timelines):
        for r in timeline:
            left, width = (r.start - t0) * scale, (r.end - r.start) * scale
            colour = GANTT_COLOURS.get(r.op, "0.6")
            ax.barh(row, width, left=left, height=0.8, color=colour, edgecolor="k", lw=0.5)
            if r.microbatch >= 0:  # -1: not a micro-batch's op (sync, step)
                ax.text(left + width / 2, row, str(r.microbatch), ha="center", va="center",
                        fontsize=7)  # fmt: skip
    ax.set_yticks(range(rows), labels or [f"stage {s}" for s in range(rows)], fontsize=8)
    ax.set_ylim(rows - 0.5, -0.5)  # stage 0 on top, as in the book's figures
    ax.set_xlabel(f"time since the step started ({unit})")
    present = {r.op for timeline in timelines for r in timeline}
    ops = [op for op in GANTT_COLOURS if op in present or op in ("F", "B")]
    handles = [plt.Rectangle((0, 0), 1, 1, color=GANTT_COLOURS[op]) for op in ops]
    names = [_GANTT_NAMES[op] for op in ops]
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=9)
    return ax


def who_holds_what(
    labels: Sequence[str],
    groups: Sequence[Sequence[int]],
    columns: int,
    title: str = "",
    group_name: str = "group",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Ranks as boxes on a grid of ``columns`` (rank r at row r // columns), each box saying what
    that rank holds (``labels[r]``), the ranks of each of ``groups`` (one dimension's process
    groups) in one colour and joined by a line."""
    n = len(labels)
    rows = -(-n // columns)
    ax = ax or plt.subplots(figsize=(1.9 * columns + 0.6, 1.25 * rows + 0.8))[1]
    colours = plt.get_cmap("tab10")
    colour_of = {r: colours(g % 10) for g, ranks in enumerate(groups) for r in ranks}
    where = {r: (r % columns, rows - 1 - r // columns) for r in range(n)}
    for r, text in enumerate(labels):
        x, y = where[r]
        ax.add_patch(plt.Rectangle((x + 0.05, y + 0.08), 0.9, 0.84, color=colour_of.get(r, "0.8"),
                                   alpha=0.3))  # fmt: skip
        ax.text(x + 0.5, y + 0.5, f"rank {r}\n{text}", ha="center", va="center", fontsize=7)
    for g, ranks in enumerate(groups):
        if len(ranks) > 1:
            xs = [where[r][0] + 0.5 for r in ranks]
            ys = [where[r][1] + 0.15 for r in ranks]
            ax.plot(xs, ys, "-o", color=colours(g % 10), lw=1.5, ms=3)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"who holds what: one colour per {group_name} group", fontsize=9)
    return ax
