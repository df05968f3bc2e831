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
    "all_to_all_dispatch",
    "bars",
    "chunk_grid",
    "curves",
    "expert_load",
    "gantt",
    "rank_grid",
    "ring_attention_blocks",
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


def all_to_all_dispatch(
    experts: Sequence[Sequence[Sequence[int]]],
    expert_ranges: Sequence[tuple[int, int]],
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Where an all-to-all dispatch sends each token: one block of rows per source rank (one row
    per routing choice, first choice on top), one column per token, the cell naming the token's
    expert and coloured by the rank that holds it. ``experts[r][t]`` lists token t's experts on
    rank r (``Routing.expert``); ``expert_ranges[d]`` is rank d's ``[start, stop)`` of experts."""
    world = len(experts)
    k = max((len(choices) for rank in experts for choices in rank), default=1)
    n = max((len(rank) for rank in experts), default=0)
    ax = ax or plt.subplots(figsize=(0.42 * n + 2.6, 0.32 * world * k + 1.2))[1]
    colours = plt.get_cmap("tab10")

    def holder(expert: int) -> int:
        return next(d for d, (lo, hi) in enumerate(expert_ranges) if lo <= expert < hi)

    ticks, names = [], []
    for src, tokens in enumerate(experts):
        for choice in range(k):
            y = src * (k + 0.5) + choice
            ticks.append(y)
            names.append(f"rank {src}, choice {choice + 1}")
            for t, choices in enumerate(tokens):
                if choice >= len(choices):
                    continue
                e = int(choices[choice])
                ax.add_patch(plt.Rectangle((t - 0.45, y - 0.45), 0.9, 0.9,
                                           color=colours(holder(e) % 10), alpha=0.45))  # fmt: skip
                ax.text(t, y, f"e{e}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(ticks[-1] + 0.6 if ticks else 1, -0.6)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xticks(range(n), [f"t{t}" for t in range(n)], fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(d % 10), alpha=0.45)
               for d in range(len(expert_ranges))]  # fmt: skip
    legend = [f"to rank {d} (experts {lo}-{hi - 1})" for d, (lo, hi) in enumerate(expert_ranges)]
    ax.legend(handles, legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xlabel("token (its position on its own rank)")
    ax.set_title(title or "all-to-all dispatch: each token's experts, coloured by their rank",
                 fontsize=9)  # fmt: skip
    return ax


def ring_attention_blocks(
    blocks: Sequence[Sequence[object]],
    layout: Sequence[Sequence[tuple[int, int]]],
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Which query chunk meets which key/value chunk, on which rank and at which ring step.
    ``blocks[r]``: the blocks rank r computed, in order (each with ``q_chunk`` and ``k_chunk``,
    ``[start, stop)`` positions, as :class:`dmlbook.advanced.context_parallel.AttentionBlock`);
    ``layout[r]``: rank r's chunks. A cell (query chunk, key chunk) is coloured by the rank
    that computed it and names the ring step: the step at which rank r holds the K/V block of
    rank (r - step) mod p. Blank cells were never computed (wholly in the causal future).
    Chapter 13 draws ring attention's zigzag with it."""
    world = len(layout)
    chunks = sorted(c for mine in layout for c in mine)
    index = {c: i for i, c in enumerate(chunks)}
    owner = {c: r for r, mine in enumerate(layout) for c in mine}
    ax = ax or plt.subplots(figsize=(0.5 * len(chunks) + 2.4, 0.5 * len(chunks) + 1.0))[1]
    colours = plt.get_cmap("tab10")
    for rank, done in enumerate(blocks):
        for block in done:
            q, k = index[block.q_chunk], index[block.k_chunk]
            step = (rank - owner[block.k_chunk]) % world
            ax.add_patch(plt.Rectangle((k - 0.45, q - 0.45), 0.9, 0.9, color=colours(rank % 10),
                                       alpha=0.45))  # fmt: skip
            ax.text(k, q, f"s{step}", ha="center", va="center", fontsize=7)
    names = [f"{a}-{b - 1}" for a, b in chunks]
    ax.set_xticks(range(len(chunks)), names, fontsize=7, rotation=90)
    ax.set_yticks(range(len(chunks)), [f"{n} (rank {owner[c]})" for n, c in zip(names, chunks,
                  strict=True)], fontsize=7)  # fmt: skip
    ax.set_xlim(-0.6, len(chunks) - 0.4)
    ax.set_ylim(len(chunks) - 0.4, -0.6)
    ax.set_xlabel("key/value positions")
    ax.set_ylabel("query positions (held by)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r % 10), alpha=0.45) for r in
               range(world)]  # fmt: skip
    ax.legend(handles, [f"rank {r}" for r in range(world)], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), title="computed by", title_fontsize=7)  # fmt: skip
    ax.set_title(title or "ring attention: who computes each block, at which step (s)",
                 fontsize=9)  # fmt: skip
    return ax


class _Grid(Protocol):  # what rank_grid reads of a layout, e.g. dmlbook.advanced.layout.Layout
    pp: int
    dp: int
    cp: int
    tp: int

    def group_ranks(self) -> dict[str, list[list[int]]]: ...


def rank_grid(
    layout: _Grid, groups: str | None = None, title: str = "", ax: plt.Axes | None = None
) -> plt.Axes:
    """The rank grid ``(pp, dp, cp, tp)`` of a layout, ``tp`` fastest: ``tp`` and then ``cp``
    along the row, ``dp`` and then ``pp`` down the page (a gap between pipeline stages), each box
    its rank and coordinates. ``groups`` names one kind of group of ``layout.group_ranks()``
    (``"tp"``, ``"ep"``, ...), drawn as a coloured line through the ranks of each.
    Chapter 13 draws its layouts with it."""
    pp, dp, cp, tp = layout.pp, layout.dp, layout.cp, layout.tp
    where = {}
    for rank in range(pp * dp * cp * tp):
        rest, t = divmod(rank, tp)
        rest, c = divmod(rest, cp)
        p, d = divmod(rest, dp)
        where[rank] = (c * (tp + 0.4) + t, p * (dp + 0.4) + d, (p, d, c, t))
    width = cp * (tp + 0.4) - 0.4
    height = pp * (dp + 0.4) - 0.4
    ax = ax or plt.subplots(figsize=(1.1 * width + 1.2, 0.8 * height + 1.0))[1]
    for rank, (x, y, (p, d, c, t)) in where.items():
        ax.add_patch(plt.Rectangle((x + 0.06, y + 0.08), 0.88, 0.84, fc="0.93", ec="0.5"))
        ax.text(x + 0.5, y + 0.5, f"rank {rank}\npp{p} dp{d}\ncp{c} tp{t}", ha="center",
                va="center", fontsize=6.5)  # fmt: skip
    if groups is not None:
        colours = plt.get_cmap("tab10")
        for g, ranks in enumerate(layout.group_ranks()[groups]):
            xs = [where[r][0] + 0.86 - 0.05 * (g % 3) for r in ranks]  # right of the text
            ys = [where[r][1] + 0.86 - 0.05 * (g % 3) for r in ranks]  # below it
            ax.plot(xs, ys, "-o", color=colours(g % 10), lw=1.8, ms=3.5)
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(height + 0.1, -0.1)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("tp fastest, then cp  →", fontsize=8)
    ax.set_ylabel("↓  dp, then pp (stages apart)", fontsize=8)
    default = f"{groups} groups" if groups else "the rank grid"
    ax.set_title(title or default, fontsize=9)
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
