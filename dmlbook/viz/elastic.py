"""torchrun's elastic job as a picture: machines, their agents, the rendezvous, the workers, a
failure and the restart at a new world size (chapter 11, ``agents_and_workers``); and which
samples of an epoch each generation's steps trained (``epoch_by_generation``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt

__all__ = ["Generation", "agents_and_workers", "epoch_by_generation", "serving_pool"]


@dataclass(frozen=True)
class Generation:
    """One group of workers the agents started: on ``machines`` (their numbers), ``per_machine``
    workers each; ``fails`` is the machine lost during it, if any, and ``note`` says how."""

    machines: Sequence[int]
    per_machine: int
    fails: int | None = None
    note: str = ""


def agents_and_workers(
    generations: Sequence[Generation],
    total_machines: int | None = None,
    unit: str = "machine",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """One panel per generation: every machine (grey once it is gone) with its torchrun agent on
    top and the workers the agent started below, numbered by their global rank; the rendezvous
    above, joined to each live agent by its heartbeats (dashed); a red cross on the machine that
    fails, and an arrow to the next generation, which the surviving agents start together.
    ``unit`` names the boxes ("node" where several play machines on one computer)."""
    total = total_machines or max(m for g in generations for m in g.machines) + 1
    box_w, gap_m, panel_gap = 1.6, 0.3, 1.4
    panel_w = total * box_w + (total - 1) * gap_m
    ax = ax or plt.subplots(figsize=(2.6 * total * len(generations) + 1, 4.2))[1]
    for g, gen in enumerate(generations):
        x0 = g * (panel_w + panel_gap)
        world = len(gen.machines) * gen.per_machine
        ax.text(x0 + panel_w / 2, 5.05, f"generation {g}: world size {world}", ha="center",
                fontsize=10, weight="bold")  # fmt: skip
        ax.add_patch(plt.Rectangle((x0 + panel_w / 2 - 1.6, 3.85), 3.2, 0.75, fc="#fde9c4", ec="k"))
        ax.text(x0 + panel_w / 2, 4.22, f"rendezvous: a c10d store\nserved by {unit} "
                f"{min(gen.machines)}'s agent", ha="center", va="center", fontsize=8)  # fmt: skip
        rank = 0
        for m in range(total):
            x = x0 + m * (box_w + gap_m)
            here = m in gen.machines
            fc, ec, ls = ("#eef3fa", "k", "-") if here else ("0.93", "0.7", ":")
            ax.add_patch(plt.Rectangle((x, 0), box_w, 3.0, fc=fc, ec=ec, ls=ls))
            ax.text(x + box_w / 2, -0.3, f"{unit} {m}" + ("" if here else " (gone)"),
                    ha="center", fontsize=8, color="k" if here else "0.5")  # fmt: skip
            if not here:
                continue
            ax.add_patch(plt.Rectangle((x + 0.15, 2.2), box_w - 0.3, 0.6, fc="#cfe0f3", ec="k"))
            ax.text(x + box_w / 2, 2.5, "torchrun agent", ha="center", va="center", fontsize=8)
            ax.plot([x + box_w / 2, x0 + panel_w / 2], [2.8, 3.9], "k--", lw=0.8)  # heartbeats
            height = 1.8 / gen.per_machine
            for local in range(gen.per_machine):
                y = 2.0 - (local + 1) * height
                ax.add_patch(plt.Rectangle((x + 0.25, y + 0.08), box_w - 0.5, height - 0.16,
                                           fc=f"C{rank % 10}", alpha=0.45, ec="k"))  # fmt: skip
                ax.text(x + box_w / 2, y + height / 2, f"worker\nrank {rank}", ha="center",
                        va="center", fontsize=7)  # fmt: skip
                rank += 1
            if m == gen.fails:
                ax.plot([x, x + box_w], [0, 3.0], color="tab:red", lw=3)
                ax.plot([x, x + box_w], [3.0, 0], color="tab:red", lw=3)
        if gen.note:
            ax.text(x0 + panel_w / 2, -0.85, gen.note, ha="center", va="top", fontsize=8,
                    color="tab:red" if gen.fails is not None else "k")  # fmt: skip
        if g + 1 < len(generations):
            ax.annotate("", xy=(x0 + panel_w + panel_gap - 0.15, 1.5),
                        xytext=(x0 + panel_w + 0.15, 1.5),
                        arrowprops=dict(arrowstyle="-|>", lw=1.5))  # fmt: skip
            ax.text(x0 + panel_w + panel_gap / 2, 1.75, "restart", ha="center", fontsize=8)
    ax.plot([], [], "k--", lw=0.8, label="heartbeats: agent to rendezvous")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=8, frameon=False)
    ax.set_xlim(-0.3, len(generations) * (panel_w + panel_gap) - panel_gap + 0.3)
    ax.set_ylim(-1.5, 5.4)
    ax.set_axis_off()
    return ax


def epoch_by_generation(
    rows: dict[str, Sequence[tuple[int, int, int, bool]]],
    window: tuple[int, int] | None = None,
    marks: dict[str, float] | None = None,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """One row per generation over an epoch's sample positions: each global step a box from its
    first to its last sample (``(start, stop, step, lost)``, stop exclusive), numbered by its
    global step, hatched when the step was lost (run again by the next generation); ``marks``
    draws a labelled dashed line at each position (a checkpoint, say)."""
    ax = ax or plt.subplots(figsize=(11, 0.8 * len(rows) + 1.2))[1]
    lo, hi = window or (0, max(stop for row in rows.values() for _, stop, _, _ in row))
    for y, row in enumerate(rows.values()):
        for start, stop, step, lost in row:
            if stop <= lo or start >= hi:
                continue
            ax.add_patch(plt.Rectangle((start, -y - 0.35), stop - start, 0.7, fc=f"C{y}",
                                       alpha=0.25 if lost else 0.55, ec="k", lw=0.6,
                                       hatch="///" if lost else None))  # fmt: skip
            middle = (max(start, lo) + min(stop, hi)) / 2
            if (min(stop, hi) - max(start, lo)) / (hi - lo) > 0.02:  # room for the number
                ax.text(middle, -y, str(step), ha="center", va="center", fontsize=7)
    for k, (label, position) in enumerate((marks or {}).items()):
        ax.axvline(position, color=f"C{k + 3}", ls="--", lw=1.5, label=label)
    ax.add_patch(plt.Rectangle((0, 0), 0, 0, fc="w", ec="k", hatch="///", label="lost step"))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=8, frameon=False, ncol=3)
    ax.set_xlim(lo, hi)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.set_yticks([-y for y in range(len(rows))], list(rows))
    ax.set_xlabel("position in the epoch's shuffled order (samples); numbers: global steps")
    return ax


def serving_pool(
    workers: int = 3,
    max_workers: int = 6,
    interval: float = 0.2,
    window: float = 0.6,
    target: float = 0.7,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """An elastic serving pool: requests join one queue, and whichever worker is free takes the
    next; every ``interval`` seconds the autoscaler counts the arrivals of the last ``window``
    seconds and starts or stops workers (``workers`` running, dashed slots up to
    ``max_workers``)."""
    ax = ax or plt.subplots(figsize=(10, 4.2))[1]
    ax.annotate("", xy=(2.0, 1.5), xytext=(0.2, 1.5), arrowprops=dict(arrowstyle="-|>", lw=1.5))
    ax.text(1.1, 1.35, "requests arrive\n(rate r per second)", ha="center", va="top", fontsize=8)
    ax.add_patch(plt.Rectangle((2.0, 1.1), 2.2, 0.8, fc="#fde9c4", ec="k"))
    for k in range(6):  # waiting requests
        ax.add_patch(plt.Rectangle((3.85 - k * 0.3, 1.25), 0.22, 0.5, fc="tab:orange", alpha=0.6))
    ax.text(3.1, 0.95, "one queue: requests that wait\n(the next free worker takes the first)",
            ha="center", va="top", fontsize=8)  # fmt: skip
    slot_h, top = 3.0 / max_workers, 3.0
    for w in range(max_workers):
        y = top - (w + 1) * slot_h
        live = w < workers
        fc, ec, ls = ("#cfe0f3", "k", "-") if live else ("w", "0.6", "--")
        ax.add_patch(plt.Rectangle((5.4, y + 0.05), 1.8, slot_h - 0.1, fc=fc, ec=ec, ls=ls))
        ax.text(6.3, y + slot_h / 2, f"worker {w}: a process" if live else "(can start)",
                ha="center", va="center", fontsize=7, color="k" if live else "0.5")  # fmt: skip
        ax.annotate(
            "",
            xy=(5.4, y + slot_h / 2),
            xytext=(4.2, 1.5),
            arrowprops=dict(arrowstyle="-|>", lw=0.6, color="k" if live else "0.8"),
        )
        if live:
            ax.annotate("", xy=(8.3, 1.5), xytext=(7.2, y + slot_h / 2),
                        arrowprops=dict(arrowstyle="-", lw=0.6))  # fmt: skip
    ax.annotate("", xy=(9.4, 1.5), xytext=(8.3, 1.5), arrowprops=dict(arrowstyle="-|>", lw=1.5))
    ax.text(8.85, 1.65, "answers", ha="center", va="bottom", fontsize=8)
    ax.add_patch(plt.Rectangle((1.0, 3.35), 6.2, 0.95, fc="#e4f2e1", ec="k"))
    ax.text(4.1, 3.82, f"autoscaler, every {interval} s:  r = (arrivals in the last {window} s) "
            f"/ {window} s\nworkers = ceil(r x service_s / {target}), "
            f"between min_workers and max_workers = {max_workers}",
            ha="center", va="center", fontsize=8)  # fmt: skip
    ax.annotate(
        "",
        xy=(1.1, 3.35),
        xytext=(1.1, 1.55),
        arrowprops=dict(arrowstyle="-|>", lw=1, ls="--", color="tab:green"),
    )
    ax.text(1.0, 2.45, "counts\narrivals", ha="right", va="center", fontsize=7, color="tab:green")
    ax.annotate(
        "",
        xy=(6.9, 3.02),
        xytext=(6.9, 3.35),
        arrowprops=dict(arrowstyle="-|>", lw=1, color="tab:green"),
    )
    ax.text(7.35, 3.82, "starts a new worker process,\nor tells one to stop after\n"
            "the request it holds", fontsize=7, color="tab:green", va="center")  # fmt: skip
    ax.set_xlim(-0.5, 9.6)
    ax.set_ylim(-0.1, 4.45)
    ax.set_axis_off()
    return ax
