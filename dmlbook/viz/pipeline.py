"""Time lines of a step: what each stage runs when, where it idles, what recomputation reruns.

Chapter 4 draws what recomputation keeps and reruns with ``checkpoint_segments``; chapters 6 and 7
draw the per-stage timeline of a pipelined step with ``gantt`` (the idle bubble shows as white
space), and chapter 6 hatches and totals each stage's idle time with ``idle_gaps`` to derive the
bubble, and draws with ``held_activations`` how many micro-batches' activations each stage holds
through a step (``schedule_and_held`` draws both on one time axis); chapter 13 draws one composed
step of every rank with ``gantt`` (its gradient sync and optimizer step in their own colours).
:mod:`dmlbook.model_parallel.schedules` draws its schedules with ``gantt`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt

__all__ = [
    "checkpoint_segments",
    "gantt",
    "held_activations",
    "idle_gaps",
    "pipeline_sweep",
    "schedule_and_held",
]


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


# forward blue, backward orange, gradient sync green, optimizer step purple, the weight gradient
# of a split backward (zero-bubble schedules) yellow; others grey
GANTT_COLOURS = {
    "F": "#4c8bd6",
    "B": "#e8913a",
    "W": "#edc948",
    "sync": "#59a14f",
    "step": "#b07aa1",
}


_GANTT_NAMES = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradient",
    "sync": "gradient sync",
    "step": "optimizer step",
}


def gantt(
    timelines: Sequence[Sequence[_Op]],
    title: str = "",
    ax: plt.Axes | None = None,
    unit: str = "ms",
    labels: Sequence[str] | None = None,
    legend_present_only: bool = False,
) -> plt.Axes:
    """Per-stage timeline of a pipelined step: one row per stage (stage 0 on top), one box per
    op from its start to its end, F and B in different colours, the micro-batch number inside.
    White space is idle time: the pipeline bubble, measured rather than drawn from a formula.
    Where ops carry a model ``chunk`` (interleaved schedules), the number reads micro-batch.chunk,
    as :func:`dmlbook.model_parallel.schedules.format_schedule` writes it, in smaller type (the
    boxes are 1/v as wide), and a later chunk's boxes are paler, as the legend says.
    The legend names forward and backward always, or with ``legend_present_only`` (serving, which
    has no backward) only the kinds of op drawn; where a W op is drawn (a zero-bubble schedule),
    it names B "B: input gradient" and W "W: weight gradient".
    """
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    rows = len(timelines)
    ax = ax or plt.subplots(figsize=(8, 0.55 * rows + 1.1))[1]
    starts = [r.start for timeline in timelines for r in timeline]
    t0 = min(starts, default=0.0)
    span = max((r.end for timeline in timelines for r in timeline), default=t0) - t0
    chunks = 1 + max((getattr(r, "chunk", 0) for t in timelines for r in t), default=0)

    def name(r: _Op) -> str:
        return f"{r.microbatch}.{r.chunk}" if chunks > 1 else str(r.microbatch)

    inside = 5.5 if chunks > 1 else 7  # the type size of a number inside its box

    def paler(colour: str, chunk: int) -> tuple:  # chunk c of v: 0.6 c / (v - 1) to white
        rgb = mcolors.to_rgb(colour)
        return tuple(x + (1 - x) * 0.6 * chunk / max(chunks - 1, 1) for x in rgb)

    for row, timeline in enumerate(timelines):
        small_at = -float("inf")  # the last number put above a box in this row
        for r in timeline:
            left, width = (r.start - t0) * scale, (r.end - r.start) * scale
            colour = paler(GANTT_COLOURS.get(r.op, "0.6"), getattr(r, "chunk", 0))
            ax.barh(row, width, left=left, height=0.8, color=colour, edgecolor="k", lw=0.5)
            # -1: not a micro-batch's op (sync, step); a narrow box gets its number smaller,
            # above the box, unless it would run into the last one; a sliver too thin to point
            # at gets none
            middle = (r.start - t0 + (r.end - r.start) / 2) * scale
            if r.microbatch >= 0 and r.end - r.start >= 0.012 * span:
                ax.text(middle, row, name(r), ha="center", va="center", fontsize=inside)
            elif (r.microbatch >= 0 and r.end - r.start >= 0.002 * span
                  and middle - small_at >= 0.03 * span * scale):  # fmt: skip
                ax.text(middle, row - 0.42, name(r), ha="center", va="bottom",
                        fontsize=5)  # fmt: skip
                small_at = middle
    ax.set_yticks(range(rows), labels or [f"stage {s}" for s in range(rows)], fontsize=8)
    ax.set_ylim(
        rows - 0.5, -0.62
    )  # stage 0 on top, as in the book's figures; room for small labels
    ax.set_xlabel(f"time since the step started ({unit})")
    present = {r.op for timeline in timelines for r in timeline}
    always = () if legend_present_only else ("F", "B")
    ops = [op for op in GANTT_COLOURS if op in present or op in always]
    handles = [plt.Rectangle((0, 0), 1, 1, color=GANTT_COLOURS[op]) for op in ops]
    # Where the backward is split, its colours name its two halves
    split = {"B": "B: input gradient", "W": "W: weight gradient"} if "W" in present else {}
    names = [split.get(op, _GANTT_NAMES[op]) for op in ops]
    for chunk in range(1, chunks):  # the paler boxes: a later model chunk of the stage
        handles.append(plt.Rectangle((0, 0), 1, 1, color=paler("0.35", chunk)))
        names.append(f"paler: chunk {chunk}")
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
        slots = "slot" if idle == 1 else "slots"
        total = f"{idle:g} {slots}" if unit == "slot" else f"{idle * scale:.0f} {unit}"
        ax.text((t1 - t0) * scale, row, f" {total} idle", va="center", fontsize=7)
    ax.set_xlim(0, (t1 - t0) * scale * 1.2)  # room for the idle totals
    if unit == "slot":
        ax.set_xlabel("time slot (every op lasts one)")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    legend = ax.get_legend()
    handles = [*legend.legend_handles, plt.Rectangle((0, 0), 1, 1, fc="w", ec="0.55", hatch="///")]
    names = [t.get_text() for t in legend.get_texts()] + ["idle"]
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def held_activations(
    timelines: Sequence[Sequence[_Op]],
    caps: Sequence[int] | None = None,
    title: str = "",
    cap_label: str = "at most",
    ax: plt.Axes | None = None,
    unit: str = "slot",
) -> plt.Axes:
    """How many micro-batches' activations each stage holds through a step: one step line per
    stage, up by one when a forward starts (its input and what autograd saves stay), down by one
    when that micro-batch's backward ends (its W, where backward is split). ``caps[s]``, drawn
    dashed in the stage's colour and labelled with ``cap_label``, is a bound to compare with
    (chapter 6: 1F1B's P - s)."""
    scale = {"slot": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    ax = ax or plt.subplots(figsize=(8, 2.8))[1]
    records = [r for timeline in timelines for r in timeline]
    t0, t1 = min(r.start for r in records), max(r.end for r in records)
    for stage, timeline in enumerate(timelines):
        release = "W" if any(r.op == "W" for r in timeline) else "B"  # split: held until W
        events = sorted(
            [(r.start, 1) for r in timeline if r.op == "F"]
            + [(r.end, -1) for r in timeline if r.op == release]
        )
        times, held, level = [0.0], [0], 0
        for time, change in events:
            level += change
            if times[-1] == (time - t0) * scale:  # a backward ends as the next forward starts:
                held[-1] = level  # one step to the net count, not a dip to draw
            else:
                times.append((time - t0) * scale)
                held.append(level)
        times.append((t1 - t0) * scale)
        held.append(level)
        # drawn at their true level; where stages hold the same count, the later stage's thinner
        # line runs inside the earlier one's wider one, so both stay visible
        width = 1.5 + 2.5 * (len(timelines) - 1 - stage)
        ax.step(times, held, where="post", color=f"C{stage}", lw=width, label=f"stage {stage}",
                solid_capstyle="butt", zorder=2 + stage)  # fmt: skip
        if caps is not None:
            ax.axhline(caps[stage], color=f"C{stage}", ls="--", lw=1.2, zorder=1,
                       label=f"stage {stage}: {cap_label} {caps[stage]}")  # fmt: skip
    ax.set_xlim(0, (t1 - t0) * scale)
    top = max(len({r.microbatch for r in timeline}) for timeline in timelines)
    ax.set_ylim(-0.2, top + 0.6)
    ax.set_yticks(range(top + 1))  # whole micro-batches
    ax.set_xlabel("time slot (every op lasts one)" if unit == "slot" else f"time ({unit})")
    if unit == "slot":
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_ylabel("micro-batches held")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=9)
    return ax


def schedule_and_held(
    timelines: Sequence[Sequence[_Op]],
    title: str,
    caps: Sequence[int] | None = None,
    cap_label: str = "at most",
    unit: str = "slot",
) -> tuple[plt.Axes, plt.Axes]:
    """A step drawn twice on one time axis: :func:`idle_gaps` above (what each stage runs, its
    idle time hatched), :func:`held_activations` below (how many micro-batches' activations each
    stage holds, ``caps`` dashed). Chapter 6 draws GPipe and 1F1B this way, one slot per op."""
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 4.6), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]}
    )
    idle_gaps(timelines, f"{title}: what each stage runs", ax=top, unit=unit)
    top.set(xlabel="", ylabel="pipeline stage")
    room = top.get_xlim()  # idle_gaps leaves room on the right for each stage's idle total
    held = f"{title}: micro-batches whose activations each stage holds"
    held_activations(timelines, caps=caps, cap_label=cap_label, ax=bottom, unit=unit, title=held)
    bottom.set_xlim(room)
    fig.tight_layout()
    return top, bottom


def pipeline_sweep(records: Sequence[dict], schedules: Sequence[str] = ("gpipe", "1f1b")):
    """:func:`dmlbook.bench.pipeline.bench_pipeline`'s records as two panels against the number of
    micro-batches M (M = 1: vanilla model parallelism): the median idle fraction beside the
    theory (P-1)/(M+P-1), and the median step beside vanilla's x (M+P-1)/(M P), the step that
    the bubble alone would leave if every op kept its length. Returns the two axes."""
    from dmlbook.model_parallel.schedules import bubble_theory

    by_case = {(r["schedule"], r["microbatches"]): r for r in records}
    stages = records[0]["stages"]
    ms = [1] + sorted({m for s, m in by_case if s != "vanilla"})
    vanilla = by_case["vanilla", 1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for schedule in schedules:
        label = {"gpipe": "GPipe", "1f1b": "1F1B"}.get(schedule, schedule)
        cases = [vanilla] + [by_case[schedule, m] for m in ms[1:]]
        axes[0].plot(ms, [r["bubble_measured"] for r in cases], "o-", label=f"{label}, measured")
        axes[1].plot(ms, [1e3 * r["median_step_s"] for r in cases], "o-", label=label)
    axes[0].plot(ms, [bubble_theory(stages, m) for m in ms], "k--", label="(P-1)/(M+P-1)")
    ideal = [1e3 * vanilla["median_step_s"] * (m + stages - 1) / (m * stages) for m in ms]
    axes[1].plot(ms, ideal, "k--", label="vanilla x (M+P-1)/(M P)")
    axes[0].set(xscale="log", xlabel="micro-batches M (count)", ylabel="idle fraction of the step",
                title=f"Pipeline bubble, {stages} stages", ylim=(0, 0.65))  # fmt: skip
    axes[1].set(xscale="log", xlabel="micro-batches M (count)", ylabel="median step (ms)",
                title=f"Step time, {stages} stages (M = 1: vanilla)", ylim=(0, None))  # fmt: skip
    for ax in axes:
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xticks([], minor=True)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return axes
