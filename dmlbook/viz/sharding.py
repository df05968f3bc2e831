"""Pictures of splitting and sharding: a GEMM split two ways, where f and g sit in a transformer
block forward and backward, attention's rows by head, the vocabulary by rank (chapter 9), and one
training step of each ZeRO stage as a timeline (chapter 9b).

Each is drawn from a small table (``tp_block_ops``, ``zero_step_ops``) that says what runs in
which order, so the picture and the text read the same data.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from dmlbook.viz.layouts import gemm_split

__all__ = [
    "attention_heads",
    "gemm_splits",
    "tp_block",
    "vocab_split",
    "zero_step",
    "zero_step_ops",
]


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
    """Where f and g sit in one tensor-parallel transformer block (chapter 9), twice: forward
    left to right above, backward right to left below. Boxes are coloured by what each does; the
    block's only communication is at f and g, solid where it all-reduces in that direction, pale
    where it passes the tensor on unchanged."""
    ops = tp_block_ops()
    ax = ax or plt.subplots(figsize=(12, 3.6))[1]
    lanes = {"forward": (1.3, "g"), "backward": (0.0, "f")}  # y, the operator that all-reduces
    x_end = 0.0
    for direction, (y0, talks) in lanes.items():
        x = 0.0
        for label, kind in ops:
            width = 0.55 if kind in ("f", "g") else 1.4
            colour = _TP_KINDS[kind][1]
            if kind in ("f", "g"):
                solid = kind == talks
                ax.add_patch(plt.Circle((x + width / 2, y0 + 0.5), 0.27, color=colour,
                                        alpha=1.0 if solid else 0.3))  # fmt: skip
                ax.text(x + width / 2, y0 + 0.5, label, ha="center", va="center", fontsize=11,
                        color="white" if solid else "k", weight="bold")  # fmt: skip
                ax.text(x + width / 2, y0 + 0.1, "all-reduce" if solid else "identity",
                        ha="center", va="top", fontsize=6.5)  # fmt: skip
            else:
                ax.add_patch(plt.Rectangle((x, y0 + 0.2), width, 0.6, color=colour, ec="k",
                                           lw=0.5))  # fmt: skip
                ax.text(x + width / 2, y0 + 0.5, label, ha="center", va="center", fontsize=7)
            tail, head = (x + width, x + width + 0.12)
            if direction == "backward":
                tail, head = head, tail
            ax.annotate("", (head, y0 + 0.5), (tail, y0 + 0.5),
                        arrowprops={"arrowstyle": "->", "lw": 0.8})  # fmt: skip
            x += width + 0.15
        x_end = x
        arrow = "→" if direction == "forward" else "←"
        ax.text(-0.1, y0 + 0.93, f"{direction} {arrow}", fontsize=8, weight="bold")
    ax.text(x_end / 4, 2.35, "attention half", fontsize=8, ha="center")
    ax.text(3 * x_end / 4, 2.35, "MLP half", fontsize=8, ha="center")
    ax.set_xlim(-0.15, x_end + 0.1)
    ax.set_ylim(-0.15, 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in _TP_KINDS.values()]
    ax.legend(handles, [t for t, _ in _TP_KINDS.values()], fontsize=7.5, ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, -0.02), frameon=False)  # fmt: skip
    ax.set_title("One tensor-parallel transformer block: forward above, backward below", fontsize=9)
    return ax


def attention_heads(
    c_attn_rows: list, c_proj_columns: list, n_embd: int, n_head: int, ax: plt.Axes | None = None
) -> plt.Axes:
    """Which rows of attention's fused ``c_attn`` weight ``(3C, C)`` and which input columns of
    its ``c_proj`` weight ``(C, C)`` each rank holds (chapter 9): ``c_attn_rows[r]`` is rank r's
    row indices (its q, its k and its v rows: not one contiguous block), ``c_proj_columns[r]``
    its ``(start, stop)``. Head boundaries are marked in every part."""
    ax = ax or plt.subplots(figsize=(11, 2.6))[1]
    colours = plt.get_cmap("tab10")
    head = n_embd // n_head
    bars = {
        "c_attn weight rows\n(outputs: q | k | v)": (1.4, 3 * n_embd),
        "c_proj weight columns\n(inputs: the heads' outputs)": (0.0, n_embd),
    }
    owner_attn = {int(i): r for r, rows in enumerate(c_attn_rows) for i in rows}
    owner_proj = {i: r for r, (a, b) in enumerate(c_proj_columns) for i in range(a, b)}
    for (name, (y, size)), owner in zip(bars.items(), (owner_attn, owner_proj), strict=True):
        for i in range(size):
            r = owner.get(i)
            ax.add_patch(plt.Rectangle((i, y), 1, 0.8, fc="0.85" if r is None else colours(r),
                                       ec="none"))  # fmt: skip
        for part in range(size // n_embd):
            for h in range(n_head):
                start = part * n_embd + h * head
                ax.plot([start, start], [y, y + 0.8], color="white", lw=0.8)
                ax.text(start + head / 2, y + 0.4, f"h{h}", ha="center", va="center",
                        fontsize=7, color="white")  # fmt: skip
            if size > n_embd:
                ax.plot([part * n_embd] * 2, [y - 0.05, y + 0.85], color="k", lw=1.5)
                ax.text(part * n_embd + n_embd / 2, y + 0.95, "qkv"[part], ha="center",
                        va="bottom", fontsize=9, weight="bold")  # fmt: skip
        starts = [i for i in range(size) if i == 0 or owner.get(i) != owner.get(i - 1)]
        for i in [*starts, size]:  # the row (or column) index where each rank's block starts
            ax.text(i, y - 0.05, str(i), ha="center", va="top", fontsize=6.5)
        ax.text(-1, y + 0.4, name, ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.5 * n_embd * 3 / 2, 3 * n_embd + 4)
    ax.set_ylim(-0.1, 2.6)
    ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r)) for r in range(len(c_attn_rows))]
    ax.legend(handles, [f"rank {r}" for r in range(len(c_attn_rows))], fontsize=8,
              ncol=len(c_attn_rows), loc="upper center", bbox_to_anchor=(0.6, -0.02),
              frameon=False)  # fmt: skip
    ax.set_title(f"Attention split by heads: {n_head} heads of {head} channels", fontsize=9)
    return ax


def vocab_split(vocab_ranges: list[tuple[int, int]], vocab: int, ax: plt.Axes | None = None):
    """The vocabulary split across ranks (chapter 9): the embedding table's rows and the logits'
    columns, each rank's block of token ids in its colour, and what the loss all-reduces per
    token. ``vocab_ranges[r]`` is rank r's ``(start, stop)``."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8)) if ax is None else (None, ax)
    colours = plt.get_cmap("tab10")
    left, right = axes
    for r, (a, b) in enumerate(vocab_ranges):
        left.add_patch(plt.Rectangle((0, a), 1, b - a, fc=colours(r), alpha=0.6, ec="k"))
        left.text(0.5, (a + b) / 2, f"rank {r}\nrows {a}-{b - 1}", ha="center", va="center",
                  fontsize=8)  # fmt: skip
        right.add_patch(plt.Rectangle((a, 0), b - a, 1, fc=colours(r), alpha=0.6, ec="k"))
        right.text((a + b) / 2, 0.5, f"rank {r}: logits {a}-{b - 1}\nmax, sum exp over mine;\n"
                   "the target's logit if I own it", ha="center", va="center",
                   fontsize=7.5)  # fmt: skip
    left.set(xlim=(-0.1, 1.1), ylim=(vocab, 0), xticks=[], ylabel="token id")
    left.set_title("embedding table (V, C): rows by rank;\nforeign ids give zeros, "
                   "then one all-reduce", fontsize=8)  # fmt: skip
    right.set(xlim=(0, vocab), ylim=(0, 1), yticks=[], xlabel="vocabulary (logit columns)")
    right.set_title("one token's logits (V): all-reduce max, then all-reduce (sum exp, target "
                    "logit):\nloss = log(sum exp) - target logit, no rank holds all V",
                    fontsize=8)  # fmt: skip
    if fig is not None:
        fig.tight_layout()
    return axes


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
