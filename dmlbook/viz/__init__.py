"""Plots drawn from real runs: bars and curves with labelled axes, shared by every chapter.

Chapter 1 draws its bandwidth bars, time-to-accuracy curves, the accuracy-against-global-batch
sweep and the synchronisation-scheme curves with ``bars`` and ``curves``; chapter 2 draws which
chunk of a ring all-reduce sits where with ``chunk_grid`` (a slider steps through it) and who
sends to whom at each step of the tree, recursive doubling and the ring with
``message_schedule``; chapter 4 draws what recomputation keeps and reruns with
``checkpoint_segments``; chapters 6
and 7 draw the per-stage timeline of a pipelined step with ``gantt`` (the idle bubble shows as
white space), and chapter 6 hatches and totals each stage's idle time with ``idle_gaps`` to derive
the bubble; chapter 13 draws the tokens each expert of a mixture of experts received, kept and
dropped, against its capacity with ``expert_load``, which rank holds what on a 5-D layout with
``who_holds_what`` and one composed step of every rank with ``gantt`` (its gradient sync and
optimizer step in their own colours). Chapter 9 draws a GEMM's column and row split with
``gemm_split``, chapter 9b the ZeRO stages with ``zero_stages``, chapter 10 a FedAvg round and
secure aggregation's masks with ``fedavg_round`` and ``pairwise_masks``, chapter 11 which rank
trains which sample across a resize with ``sample_owners``, and chapter 12 profiler intervals
with ``spans``. Chapter 13 also draws an all-to-all dispatch with ``all_to_all_dispatch``, ring
attention's blocks with ``ring_attention_blocks`` and a layout's rank grid with ``rank_grid``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import matplotlib.pyplot as plt

__all__ = [
    "all_to_all_dispatch",
    "bars",
    "checkpoint_segments",
    "chunk_grid",
    "curves",
    "expert_load",
    "fedavg_round",
    "gantt",
    "gemm_split",
    "idle_gaps",
    "message_schedule",
    "pairwise_masks",
    "rank_grid",
    "ring_attention_blocks",
    "sample_owners",
    "spans",
    "stacked_bars",
    "who_holds_what",
    "zero_stages",
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


def idle_gaps(
    timelines: Sequence[Sequence[_Op]],
    title: str = "",
    ax: plt.Axes | None = None,
    unit: str = "ms",
) -> plt.Axes:
    """A :func:`gantt` chart with each stage's idle time hatched: every stretch between the step's
    first start and its last end in which the stage computes nothing, its total written at the
    end of the row. Chapter 6 derives the pipeline bubble by counting these gaps on a schedule
    whose ops each last one time slot (``unit="slot"``, timelines in slots).
    """
    ax = gantt(timelines, title, ax, "s" if unit == "slot" else unit)
    scale = {"slot": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    records = [r for timeline in timelines for r in timeline]
    if not records:
        raise ValueError("no ops: nothing ran")
    t0, t1 = min(r.start for r in records), max(r.end for r in records)
    for row, timeline in enumerate(timelines):
        edge, idle = t0, 0.0
        for start, end in sorted((r.start, r.end) for r in timeline) + [(t1, t1)]:
            if start > edge:  # nothing ran on this stage from edge to start
                ax.barh(row, (start - edge) * scale, left=(edge - t0) * scale, height=0.8,
                        color="w", edgecolor="0.55", hatch="///", lw=0.5)  # fmt: skip
                idle += start - edge
            edge = max(edge, end)
        total = f"{idle:g} slots" if unit == "slot" else f"{idle * scale:.0f} {unit}"
        ax.text((t1 - t0) * scale, row, f" {total} idle", va="center", fontsize=7)
    ax.set_xlim(0, (t1 - t0) * scale * 1.2)  # room for the idle totals
    if unit == "slot":
        ax.set_xlabel("time slot (every op lasts one)")
    legend = ax.get_legend()
    handles = [*legend.legend_handles, plt.Rectangle((0, 0), 1, 1, fc="w", ec="0.55", hatch="///")]
    names = [t.get_text() for t in legend.get_texts()] + ["idle"]
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
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


def gemm_split(split: str, world_size: int = 2, n: int = 4, ax: plt.Axes | None = None) -> plt.Axes:
    """``X @ W = Y`` as three n x n grids, each element coloured by the rank that holds or
    computes it under a ``"column"`` or ``"row"`` split of W (chapter 9): grey is held by every
    rank, hatched is a partial sum that every rank computes and an all-reduce adds up."""
    if split not in ("column", "row") or n % world_size:
        raise ValueError(f"split must be 'column' or 'row' and divide {n}, got {split!r}")
    ax = ax or plt.subplots(figsize=(7.5, 2.4))[1]
    block = n // world_size
    colours = plt.get_cmap("tab10")

    def owner(matrix: str, i: int, j: int) -> int | None:  # None: every rank
        if split == "column":
            return None if matrix == "X" else j // block
        return {"X": j // block, "W": i // block}.get(matrix)

    for k, matrix in enumerate(("X", "W", "Y")):
        x0 = k * (n + 2)
        for i in range(n):
            for j in range(n):
                if split == "row" and matrix == "Y":  # a sliver of each rank's partial sum
                    for r in range(world_size):
                        ax.add_patch(plt.Rectangle((x0 + j + r / world_size, n - 1 - i),
                                                   1 / world_size, 1, fc=colours(r), alpha=0.5,
                                                   hatch="//", ec="white"))  # fmt: skip
                    continue
                r = owner(matrix, i, j)
                ax.add_patch(plt.Rectangle((x0 + j, n - 1 - i), 1, 1, ec="white", alpha=0.8,
                                           fc="0.8" if r is None else colours(r)))  # fmt: skip
        ax.text(x0 + n / 2, n + 0.3, matrix, ha="center", fontsize=11)
    ax.text(n + 1, n / 2, "@", ha="center", va="center", fontsize=14)
    ax.text(2 * n + 3, n / 2, "=", ha="center", va="center", fontsize=14)
    ax.set_xlim(-0.2, 3 * n + 4.2)
    ax.set_ylim(-0.8, n + 1)
    ax.set_aspect("equal")
    ax.axis("off")
    note = (
        "grey: every rank holds all of X; an all-gather joins Y's columns"
        if split == "column"
        else "hatched: every rank computes a whole partial Y; an all-reduce adds them"
    )
    ax.text(0, -0.6, note, fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in range(world_size)]
    ax.legend(
        handles,
        [f"rank {r}" for r in range(world_size)],
        fontsize=8,
        loc="upper right",
        bbox_to_anchor=(1.0, 1.15),
        ncol=world_size,
    )
    ax.set_title(f"{split} split of W on {world_size} ranks", fontsize=9)
    return ax


def zero_stages(blocks: Sequence[tuple[int, int]], numel: int) -> plt.Figure:
    """Four panels, ZeRO stages 0-3 (chapter 9b): for each rank, three strips (parameters,
    gradients, optimizer state) across the flat model of ``numel`` elements, coloured where that
    rank holds them. ``blocks[r]`` is rank r's shard ``(start, stop)``, the same in every strip."""
    fig, axes = plt.subplots(1, 4, figsize=(12, 2.6), sharey=True)
    parts = ["parameters", "gradients", "optimizer state"]
    titles = ["stage 0: plain DP", "stage 1: P_os", "stage 2: P_os+g", "stage 3: P_os+g+p"]
    for stage, ax in enumerate(axes):
        for r, (start, stop) in enumerate(blocks):
            for i in range(len(parts)):
                y = r * 4 + (2 - i)
                ax.broken_barh([(0, numel)], (y, 0.8), color="0.9")
                sharded = stage >= 3 - i  # optimizer state from stage 1, gradients 2, params 3
                span = (start, min(stop, numel) - start) if sharded else (0, numel)
                ax.broken_barh([span], (y, 0.8), color=f"C{i}")
        ax.set_title(titles[stage], fontsize=9)
        ax.set_xticks([])
        ax.set(xlabel="flat model buffer (elements)")
    axes[0].set_yticks([r * 4 + 1.4 for r in range(len(blocks))],
                       [f"rank {r}" for r in range(len(blocks))])  # fmt: skip
    axes[0].set(ylabel="rank")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(3)]
    fig.legend(handles, parts, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def fedavg_round(clients_of_rank: dict[int, Sequence[int]], ax: plt.Axes | None = None) -> plt.Axes:
    """One FedAvg round (chapter 10): the server, rank 0, above the client ranks, each box listing
    the clients it hosts; arrows down carry the global model w, arrows up each client's update
    n_k (w_k - w) and its count n_k. The data never leaves the lower boxes."""
    ranks = sorted(clients_of_rank)
    ax = ax or plt.subplots(figsize=(2.6 * len(ranks) + 1, 3.2))[1]
    mid = (len(ranks) - 1) * 1.3 + 0.5
    ax.add_patch(plt.Rectangle((mid - 0.7, 2.2), 1.4, 0.7, color="tab:gray", alpha=0.3))
    ax.text(mid, 2.55, "rank 0: server\nholds w, a test set", ha="center", va="center", fontsize=8)
    for k, rank in enumerate(ranks):
        x = k * 2.6
        ax.add_patch(plt.Rectangle((x, 0), 1.0 + 0.6 * (len(ranks) > 1), 0.8,
                                   color=f"C{k}", alpha=0.3))  # fmt: skip
        names = ", ".join(str(c) for c in clients_of_rank[rank])
        ax.text(
            x + 0.8,
            0.4,
            f"rank {rank}\nclients {names}\n(their data stays here)",
            ha="center",
            va="center",
            fontsize=8,
        )
        ax.annotate("", (x + 0.5, 0.85), (mid - 0.2, 2.15),
                    arrowprops=dict(arrowstyle="->", color="tab:blue"))  # fmt: skip
        ax.annotate("", (mid + 0.2, 2.15), (x + 1.1, 0.85),
                    arrowprops=dict(arrowstyle="->", color="tab:red"))  # fmt: skip
    ax.text(mid - 1.2, 1.55, "1. global model w", color="tab:blue", fontsize=8, ha="right")
    ax.text(mid + 1.2, 1.55, "3. n_k (w_k - w) and n_k\nper client", color="tab:red", fontsize=8)
    ax.text(mid, -0.35, "2. each client trains w for E local epochs on its own data: w_k",
            ha="center", fontsize=8)  # fmt: skip
    ax.text(mid, 3.1, "4. server: w <- w + sum n_k (w_k - w) / sum n_k", ha="center", fontsize=8)
    ax.set_xlim(-0.3, 2.6 * len(ranks) - 0.6)
    ax.set_ylim(-0.6, 3.4)
    ax.axis("off")
    return ax


def pairwise_masks(participants: Sequence[int], ax: plt.Axes | None = None) -> plt.Axes:
    """Secure aggregation's pairwise masks (chapter 10) as a table: a row per client, a column per
    pair (i, j), ``+m_ij`` for the lower-numbered client and ``-m_ij`` for the other, so that every
    column, hence the server's sum of the uploads, adds up to zero."""
    pairs = [(i, j) for i in participants for j in participants if i < j]
    ax = ax or plt.subplots(figsize=(1.1 * len(pairs) + 2.2, 0.45 * len(participants) + 1.2))[1]
    for c, (i, j) in enumerate(pairs):
        for r, client in enumerate(participants):
            sign = "+" if client == i else "-" if client == j else ""
            if sign:
                ax.add_patch(plt.Rectangle((c, -r - 1), 1, 1, ec="white",
                                           color="tab:green" if sign == "+" else "tab:red",
                                           alpha=0.3))  # fmt: skip
                ax.text(c + 0.5, -r - 0.5, f"{sign}m{i}{j}", ha="center", va="center", fontsize=8)
        ax.text(c + 0.5, -len(participants) - 0.5, "0", ha="center", va="center", fontsize=9,
                fontweight="bold")  # fmt: skip
        ax.text(c + 0.5, 0.4, f"pair ({i}, {j})", ha="center", fontsize=7)
    for r, client in enumerate(participants):
        ax.text(-0.1, -r - 0.5, f"client {client} adds", ha="right", va="center", fontsize=8)
    ax.text(-0.1, -len(participants) - 0.5, "server's sum", ha="right", va="center", fontsize=8,
            fontweight="bold")  # fmt: skip
    ax.axhline(-len(participants), color="k", lw=0.8)
    ax.set_xlim(-2.2, len(pairs))
    ax.set_ylim(-len(participants) - 1, 0.9)
    ax.axis("off")
    ax.set_title("Pairwise masks: each column cancels in the sum", fontsize=9)
    return ax


def sample_owners(
    owners: dict[str, Sequence[int | None]],
    edges: dict[str, Sequence[int]] | None = None,
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """A strip per row of ``owners`` across an epoch's sample positions (chapter 11), each
    position coloured by the rank that trains it (grey: ``None``, trained before), with the
    global batches' boundaries from ``edges`` as black ticks."""
    ax = ax or plt.subplots(figsize=(10, 0.7 * len(owners) + 0.9))[1]
    colours = plt.get_cmap("tab10")
    for y, (name, row) in enumerate(owners.items()):
        for pos, rank in enumerate(row):
            colour = "0.85" if rank is None else colours(rank)
            ax.add_patch(plt.Rectangle((pos, -y - 0.4), 1, 0.8, ec="white", lw=0.3, color=colour))
        for edge in (edges or {}).get(name, []):
            ax.plot([edge, edge], [-y - 0.5, -y + 0.5], color="k", lw=1.2)
    ranks = sorted({r for row in owners.values() for r in row if r is not None})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in ranks]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.85"))
    ax.legend(handles, [f"rank {r}" for r in ranks] + ["trained before"], fontsize=7,
              ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, -0.35))  # fmt: skip
    ax.set_xlim(0, max(len(row) for row in owners.values()))
    ax.set_ylim(-len(owners) + 0.4, 0.6)
    ax.set_yticks([-y for y in range(len(owners))], list(owners))
    ax.set_xlabel("position in the epoch's shuffled order")
    ax.set_title(title, fontsize=9)
    return ax


def spans(
    rows: dict[str, Sequence[tuple[float, float]]],
    shade: Sequence[tuple[float, float]] = (),
    title: str = "",
    unit: float = 1.0,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Interval lists as rows of bars (chapter 12's profiler spans): ``rows[name]`` is a list of
    ``(start, end)``, drawn divided by ``unit``; ``shade`` intervals are greyed behind them."""
    ax = ax or plt.subplots(figsize=(9, 0.45 * len(rows) + 1))[1]
    for y, intervals in enumerate(rows.values()):
        ax.broken_barh([(s / unit, (e - s) / unit) for s, e in intervals], (y - 0.4, 0.8),
                       color=f"C{y}")  # fmt: skip
    for s, e in shade:
        ax.axvspan(s / unit, e / unit, color="0.9", zorder=-1)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_title(title, fontsize=9)
    return ax
