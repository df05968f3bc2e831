"""Vanilla model parallelism drawn: the layers cut into stages, and who waits (chapter 5)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from dmlbook.viz.pipeline import gantt

__all__ = ["model_split"]


def model_split(
    layer_names: Sequence[str], counts: Sequence[int], timelines: Sequence[Sequence] = ()
) -> plt.Figure:
    """The layers as boxes coloured by stage (stage ``s`` on rank ``s``), the activation that
    crosses each cut forward and the gradient that crosses it backward; below, when
    ``timelines`` (one list of ``pipeline.OpRecord`` per stage) are given, the measured step's
    forward and backward of every stage on one time axis: white space is a rank waiting."""
    rows = 2 if timelines else 1
    fig, axes = plt.subplots(
        rows, 1, figsize=(9, 2.2 + 1.5 * (rows - 1)), height_ratios=[1.4, 1][:rows], squeeze=False
    )
    ax = axes[0, 0]
    n, gap = len(layer_names), 0.6  # a gap between stages leaves room for the arrows
    x, edges = 0.0, []
    for s in range(len(counts)):
        start = x
        for name in layer_names[sum(counts[:s]) : sum(counts[: s + 1])]:
            ax.add_patch(plt.Rectangle((x, 0), 0.9, 1, color=f"C{s}", alpha=0.35, lw=0))
            ax.text(x + 0.45, 0.5, name.replace(" ", "\n"), ha="center", va="center", fontsize=7)
            x += 1
        ax.text((start + x - 0.1) / 2, 1.12, f"stage {s} on rank {s}", ha="center", fontsize=8)
        edges.append(x)
        x += gap
    for cut in edges[:-1]:  # arrows in the gap after each stage but the last
        ax.annotate("", (cut + gap, 0.72), (cut - 0.1, 0.72),
                    arrowprops=dict(arrowstyle="-|>", color="C2", lw=1.5))  # fmt: skip
        ax.annotate("", (cut - 0.1, 0.28), (cut + gap, 0.28),
                    arrowprops=dict(arrowstyle="-|>", color="C3", lw=1.5))  # fmt: skip
    ax.plot([], [], color="C2", label="forward: send(output activation)")
    ax.plot([], [], color="C3", label="backward: send(gradient of the stage's input)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, frameon=False)
    ax.set_xlim(-0.2, n + gap * (len(counts) - 1) + 0.1)
    ax.set_ylim(-0.05, 1.3)
    ax.axis("off")
    ax.set_title("Vanilla model parallelism: the layers cut into stages", fontsize=9)
    if timelines:
        gantt(timelines, "One measured training step: each rank waits while the other works",
              ax=axes[1, 0], labels=[f"rank {s}" for s in range(len(timelines))])  # fmt: skip
    fig.tight_layout()
    return fig
