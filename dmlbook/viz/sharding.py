"""Pictures of splitting and sharding: a GEMM split two ways, where f and g sit in a transformer
block (chapter 9), and one training step of each ZeRO stage as a timeline (chapter 9b).

Each is drawn from a small table (``tp_block_ops``, ``zero_step_ops``) that says what runs in
which order, so the picture and the text read the same data.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from dmlbook.viz.layouts import gemm_split

__all__ = ["gemm_splits", "tp_block", "tp_block_ops", "zero_step", "zero_step_ops"]


def gemm_splits(world_size: int = 2) -> plt.Figure:
    """The column and the row split of ``Y = X W`` (chapter 9), one above the other, with one
    legend of the ranks' colours under both panels."""
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 5.2))
    for split, ax in zip(("column", "row"), axes, strict=True):
        gemm_split(split, world_size=world_size, ax=ax)
        ax.get_legend().remove()  # one legend for both, below
    colours = plt.get_cmap("tab10")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in range(world_size)]
    labels = [f"rank {r}" for r in range(world_size)]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.8"))
    labels.append("every rank")
    fig.legend(handles, labels, loc="lower center", ncol=world_size + 1, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ------------------------------------------------------------------ f and g in a block (ch. 9)

# What each kind of box is, and its colour.
_TP_KINDS = {
    "replicated": ("whole on every rank", "0.85"),
    "column": ("column-parallel: my block of the outputs", "#4c8bd6"),
    "local": ("on my block only (no communication)", "#a6c8ef"),
    "row": ("row-parallel: a partial sum", "#e8913a"),
    "f": ("f: identity forward, all-reduce backward", "#59a14f"),
    "g": ("g: all-reduce forward, identity backward", "#b07aa1"),
}


def tp_block_ops() -> list[tuple[str, str]]:
    """A Megatron transformer block as (label, kind), in forward order: each half is
    ``f -> column-parallel -> local op -> row-parallel -> g``."""
    ops = []
    for name, inner in (("attention", "attention\non my heads"), ("MLP", "GeLU")):
        first, second = ("c_attn", "c_proj") if name == "attention" else ("c_fc", "c_proj")
        ops += [("LayerNorm", "replicated"), ("f", "f"), (first, "column"), (inner, "local"),
                (second, "row"), ("g", "g"), ("+ residual", "replicated")]  # fmt: skip
    return ops


def tp_block(ax: plt.Axes | None = None) -> plt.Axes:
    """Where f and g sit in one tensor-parallel transformer block (chapter 9): boxes in forward
    order, coloured by what each does; the block's only communication is at f and g."""
    ops = tp_block_ops()
    ax = ax or plt.subplots(figsize=(12, 2.4))[1]
    x = 0.0
    for label, kind in ops:
        width = 0.55 if kind in ("f", "g") else 1.4
        colour = _TP_KINDS[kind][1]
        if kind in ("f", "g"):
            ax.add_patch(plt.Circle((x + width / 2, 0.5), 0.27, color=colour))
            ax.text(x + width / 2, 0.5, label, ha="center", va="center", fontsize=11,
                    color="white", weight="bold")  # fmt: skip
        else:
            ax.add_patch(plt.Rectangle((x, 0.2), width, 0.6, color=colour, ec="k", lw=0.5))
            ax.text(x + width / 2, 0.5, label, ha="center", va="center", fontsize=7)
        ax.annotate("", (x + width + 0.12, 0.5), (x + width, 0.5),
                    arrowprops={"arrowstyle": "->", "lw": 0.8})  # fmt: skip
        x += width + 0.15
    ax.text(0, 1.0, "attention half", fontsize=8)
    ax.text(x / 2 + 0.1, 1.0, "MLP half", fontsize=8)
    ax.set_xlim(-0.1, x + 0.1)
    ax.set_ylim(-0.05, 1.15)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in _TP_KINDS.values()]
    ax.legend(handles, [t for t, _ in _TP_KINDS.values()], fontsize=7.5, ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, -0.02), frameon=False)  # fmt: skip
    ax.set_title("One tensor-parallel transformer block, forward left to right", fontsize=9)
    return ax


# ------------------------------------------------------------------ a ZeRO step (ch. 9b)

_ZERO_KINDS = {
    "F": ("forward of a unit", "#4c8bd6"),
    "B": ("backward of a unit", "#e8913a"),
    "AR": ("all-reduce of gradients", "#59a14f"),
    "RS": ("reduce-scatter of gradients", "#8cd17d"),
    "AG": ("all-gather of parameters", "#b07aa1"),
    "Adam": ("Adam step", "0.55"),
}


def zero_step_ops(stage: int, units: int = 3) -> list[tuple[str, str]]:
    """One training step of ZeRO ``stage`` on a model of ``units`` units, as (label, kind) in
    the order a rank runs them: the order the engines of :mod:`dmlbook.advanced.zero` follow."""
    names = [str(u) for u in range(units)]
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage!r}")
    ops: list[tuple[str, str]] = []
    for u in names:  # forward, unit by unit
        if stage == 3:
            ops.append((f"gather {u}", "AG"))
        ops.append((f"F {u}", "F"))
    for u in reversed(names):  # backward, last unit first
        if stage == 3:
            ops.append((f"gather {u}", "AG"))
        ops.append((f"B {u}", "B"))
        if stage >= 2:
            ops.append((f"RS {u}", "RS"))  # as soon as the unit's gradient is complete
    for u in names:  # the optimizer step, unit by unit
        if stage == 0:
            ops += [(f"AR {u}", "AR"), (f"Adam {u}", "Adam")]  # every element
        elif stage == 1:
            ops += [(f"RS {u}", "RS"), (f"Adam {u}", "Adam"), (f"gather {u}", "AG")]
        elif stage == 2:
            ops += [(f"Adam {u}", "Adam"), (f"gather {u}", "AG")]  # my shard only
        else:
            ops.append((f"Adam {u}", "Adam"))  # my shard; the next forward gathers
    return ops


def zero_step(units: int = 3, ax: plt.Axes | None = None) -> plt.Axes:
    """One training step of each ZeRO stage, a row per stage, one box per operation in the
    order a rank runs them (a schedule, not measured times): where each stage communicates."""
    ax = ax or plt.subplots(figsize=(12, 3.2))[1]
    titles = ["stage 0 (plain DP)", "stage 1 (P_os)", "stage 2 (P_os+g)", "stage 3 (P_os+g+p)"]
    for stage in range(4):
        x = 0.0
        for label, kind in zero_step_ops(stage, units):
            width = 1.0
            ax.barh(stage, width, left=x, height=0.7, color=_ZERO_KINDS[kind][1], ec="k", lw=0.5)
            ax.text(x + width / 2, stage, label, ha="center", va="center", fontsize=6.5)
            x += width + 0.08
    ax.set_yticks(range(4), titles, fontsize=8)
    ax.set_ylim(3.5, -0.5)
    ax.set_xticks([])
    ax.set_xlabel("one training step, in order (box widths are not times)", fontsize=8)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in _ZERO_KINDS.values()]
    ax.legend(handles, [t for t, _ in _ZERO_KINDS.values()], fontsize=7, ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)  # fmt: skip
    ax.set_title(f"One step of each ZeRO stage, {units} units, as one rank runs it", fontsize=9)
    return ax
