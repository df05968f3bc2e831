"""Who holds which chunk, and who sends to whom: collectives drawn step by step (chapter 2).

Chapter 2 draws a parameter server's layout with ``ps_layout``, its workers' steps in time with
``ps_timeline`` (its key: ``ps_timeline_legend``), which chunk of a ring all-reduce sits where
with ``chunk_grid`` (a slider steps through it) and who sends to whom at each step of the tree,
recursive doubling and the ring with ``message_schedule`` (its key: ``schedule_legend``).
Chapter 13 draws an expert-parallel round trip with :func:`dmlbook.viz.layouts.moe_round_trip`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = [
    "chunk_grid",
    "message_schedule",
    "ps_layout",
    "ps_timeline",
    "ps_timeline_legend",
    "schedule_legend",
]


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


def schedule_legend(fig: plt.Figure) -> None:
    """The key to :func:`message_schedule`'s arrows, once for a whole figure, below its panels."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color="C0", marker="v", lw=1.5, label="message to a higher rank (down)"),
        Line2D([], [], color="C3", marker="^", lw=1.5, label="message to a lower rank (up)"),
        Line2D([], [], ls="none", label="label: its size, n = the whole tensor"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)


def ps_layout(servers: int, workers: int, ax: plt.Axes | None = None) -> plt.Axes:
    """A parameter server's layout: ``servers`` boxes on top, each holding 1/S of the model,
    ``workers`` boxes below, each a whole copy; every worker pulls each server's shard (down) and
    pushes it the matching slice of its gradient (up)."""
    from matplotlib.patches import FancyBboxPatch

    ax = ax or plt.subplots(figsize=(5, 3))[1]
    width = max(servers, workers)
    top = [(i + 0.5) * width / servers for i in range(servers)]
    bottom = [(i + 0.5) * width / workers for i in range(workers)]
    box = dict(boxstyle="round,pad=0.02", lw=1.2)
    for s, x in enumerate(top):
        ax.add_patch(FancyBboxPatch((x - 0.4, 2.0), 0.8, 0.55, fc="#fde2c8", ec="k", **box))
        shard = "the whole model" if servers == 1 else f"shard {s}: 1/{servers}"
        ax.text(x, 2.275, f"server {s}\n{shard}", ha="center", va="center", fontsize=7)
    for w, x in enumerate(bottom):
        ax.add_patch(FancyBboxPatch((x - 0.4, 0.0), 0.8, 0.55, fc="#d7e7f5", ec="k", **box))
        ax.text(x, 0.275, f"worker {w}\nmodel copy", ha="center", va="center", fontsize=7)
    for xs in top:
        for xw in bottom:  # pull down on the left, push up on the right of each pair
            for d, colour, a, b in (
                (-0.07, "C0", (xs, 2.0), (xw, 0.55)),
                (0.07, "C3", (xw, 0.55), (xs, 2.0)),
            ):
                ax.annotate(
                    "",
                    xy=(b[0] + d, b[1]),
                    xytext=(a[0] + d, a[1]),
                    arrowprops=dict(arrowstyle="-|>", color=colour, lw=1, alpha=0.85),
                )
    part = "the whole model" if servers == 1 else f"1/{servers} of the model"
    ax.plot([], [], color="C0", label=f"pull: parameters, {part} per arrow")
    ax.plot([], [], color="C3", label=f"push: gradient (slice), {part} per arrow")
    ax.set(xlim=(-0.1, width + 0.1), ylim=(-0.75, 2.65))
    ax.legend(loc="lower center", fontsize=7, ncol=1, frameon=False, bbox_to_anchor=(0.5, -0.02))
    ax.set_title(f"{servers} server(s), {workers} workers", fontsize=9)
    ax.axis("off")
    return ax


def ps_timeline(
    timeline: Sequence[tuple[int, str, float]],
    pauses: Sequence[Sequence[float]] = (),
    until: float | None = None,
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Each worker's steps in time, as a parameter server saw them (chapter 2).

    ``timeline`` is ``ServerResult.timeline``: (worker rank, "pull" | "reply" | "push", seconds)
    events, each request timed when the server took it up, each answer when the server decided
    to send it. Drawn: a grey bar from a pull to its answer (a pull held back: the worker
    waits), a blue bar from the answer to the push (the answer in flight, computing, and the
    push in flight), an orange end to it where ``pauses[w][step % len]`` says worker w paused
    (it sleeps just before pushing), and above a push the worker's clock after it, where there
    is room for the number. Time counts from the first request; ``until`` cuts the axis there."""
    ax = ax or plt.subplots(figsize=(11, 2))[1]
    start = min(t for _, _, t in timeline)
    ranks = sorted({w for w, _, _ in timeline})
    for lane, w in enumerate(ranks):
        mine = {kind: [t - start for v, k, t in timeline if v == w and k == kind]
                for kind in ("pull", "reply", "push")}  # fmt: skip
        steps = zip(mine["pull"], mine["reply"], mine["push"], strict=False)
        labelled = -1.0  # where the last clock label went: none closer than ``gap``
        gap = 0.025 * (until or max(t for _, _, t in timeline) - start)
        for step, (asked, answered, pushed) in enumerate(steps):
            if until is not None and asked > until:
                break
            ax.barh(lane, answered - asked, left=asked, height=0.5, color="0.6")
            ax.barh(lane, pushed - answered, left=answered, height=0.5, color="#9ecae1")
            pattern = pauses[lane] if lane < len(pauses) else ()
            pause = pattern[step % len(pattern)] if pattern else 0.0
            if pause:
                ax.barh(lane, pause, left=pushed - pause, height=0.5, color="C1")
            ax.plot([pushed, pushed], [lane - 0.3, lane + 0.3], color="k", lw=0.8)
            if pushed - labelled >= gap and (until is None or pushed < until):
                ax.text(pushed, lane - 0.3, str(step + 1), ha="center", va="bottom", fontsize=6)
                labelled = pushed
    ax.set_yticks(range(len(ranks)), [f"worker {i}" for i in range(len(ranks))], fontsize=8)
    ax.text(1.0, 1.02, "blank: a request in flight, or the server busy", fontsize=7, ha="right",
            va="bottom", transform=ax.transAxes, color="0.4")  # fmt: skip
    ax.set_ylim(len(ranks) - 0.4, -0.75)
    if until is not None:
        ax.set_xlim(0, until)
    ax.set_title(title, fontsize=9, loc="left")
    return ax


def ps_timeline_legend(fig: plt.Figure) -> None:
    """The key to :func:`ps_timeline`'s bars, once for a whole figure, below its panels."""
    from matplotlib.patches import Patch

    handles = [
        Patch(color="0.6", label="its pull held back by the server"),
        Patch(color="#9ecae1", label="computing its gradient"),
        Patch(color="C1", label="pausing"),
        plt.Line2D([], [], color="k", lw=0.8, label="push; the number: its clock after it"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
