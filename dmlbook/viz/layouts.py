"""Which rank holds which piece: split matrices, ZeRO shards, rank grids, experts and attention
blocks.

Chapter 9 draws a GEMM's column and row split with ``gemm_split`` and which rank holds what with
``who_holds_what``; chapter 9b the ZeRO stages with ``zero_stages``; chapter 13 which rank holds
what on a 5-D layout with ``who_holds_what``, a layout's rank grid with ``rank_grid``, where
sequence parallelism splits a block's activations with ``sequence_parallel_block``, an
expert-parallel layer's round trip with ``moe_round_trip``, the tokens each expert of a mixture
of experts received, kept and dropped against its capacity with ``expert_load``, ring
attention's blocks with ``ring_attention_blocks``, and which rank of a new layout reads which
saved slice of a checkpoint with ``checkpoint_reads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import matplotlib.pyplot as plt

from dmlbook.viz.charts import stacked_bars

__all__ = [
    "checkpoint_reads",
    "expert_load",
    "gemm_split",
    "moe_round_trip",
    "rank_grid",
    "ring_attention_blocks",
    "sequence_parallel_block",
    "who_holds_what",
    "zero_stages",
]


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
    groups) in one colour and tagged with the group's number (no lines: they would cross the
    boxes between the members of a group)."""
    n = len(labels)
    rows = -(-n // columns)
    ax = ax or plt.subplots(figsize=(1.9 * columns + 0.6, 1.25 * rows + 0.8))[1]
    colours = plt.get_cmap("tab10")
    group_of = {r: g for g, ranks in enumerate(groups) for r in ranks}
    where = {r: (r % columns, rows - 1 - r // columns) for r in range(n)}
    for r, text in enumerate(labels):
        x, y = where[r]
        g = group_of.get(r)
        colour = "0.8" if g is None else colours(g % 10)
        ax.add_patch(plt.Rectangle((x + 0.05, y + 0.08), 0.9, 0.84, fc=colour, alpha=0.3,
                                   ec=colour, lw=2))  # fmt: skip
        kind = "" if group_name == "group" else f"{group_name} "
        tag = "" if g is None else f"\n{kind}group {g}"
        ax.text(x + 0.5, y + 0.5, f"rank {r}{tag}\n{text}", ha="center", va="center", fontsize=7)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"who holds what: one colour per {group_name} group", fontsize=9)
    return ax


# What rank_grid reads of a layout, e.g. dmlbook.advanced.composition.layout.Layout.
class _Grid(Protocol):
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
    (``"tp"``, ``"ep"``, ...): the ranks of each group share a colour and name their group.
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
    colours = plt.get_cmap("tab10")
    group_of = {}
    if groups is not None:
        group_of = {r: g for g, ranks in enumerate(layout.group_ranks()[groups]) for r in ranks}
    for rank, (x, y, (p, d, c, t)) in where.items():
        g = group_of.get(rank)
        fill = "0.93" if g is None else colours(g % 10)
        ax.add_patch(plt.Rectangle((x + 0.06, y + 0.08), 0.88, 0.84, fc=fill, ec="0.5",
                                   alpha=1.0 if g is None else 0.35))  # fmt: skip
        tag = "" if g is None else f"\n{groups} group {g}"
        ax.text(x + 0.5, y + 0.5, f"rank {rank}\npp{p} dp{d}\ncp{c} tp{t}{tag}", ha="center",
                va="center", fontsize=6.5)  # fmt: skip
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(height + 0.1, -0.1)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("tp fastest, then cp  →", fontsize=8)
    ax.set_ylabel("↓  dp, then pp (stages apart)", fontsize=8)
    default = f"{groups} groups" if groups else "the rank grid"
    ax.set_title(title or default, fontsize=9)
    return ax


def sequence_parallel_block(tp: int = 2, ax: plt.Axes | None = None) -> plt.Axes:
    """One transformer block on a TP group of ``tp`` ranks, twice (chapter 13): above with tensor
    parallelism alone, below with sequence parallelism. Each activation ``(B, T, C)`` is a bar
    of T positions: grey where every rank holds all of them, in rank colours where each rank
    holds a slice of the sequence. Between the parts, the collective that joins them: a TP
    region (attention, MLP: heads or columns split) ends in an all-reduce under TP alone, and
    in a reduce-scatter along the sequence under SP, whose next region opens with an all-gather."""
    ax = ax or plt.subplots(figsize=(11, 4.4))[1]
    colours = plt.get_cmap("tab10")
    parts = ["LayerNorm", "attention\n(heads split)", "dropout\n+ residual\nLayerNorm",
             "MLP\n(columns, rows\nsplit)", "dropout\n+ residual"]  # fmt: skip
    region = [False, True, False, True, False]  # inside a TP region: weights split over ranks
    rows = {"tensor parallelism alone": 2.6, "tensor + sequence parallelism": 0.0}
    step = 2.2

    def activation(x: float, y: float, split: bool) -> None:
        for r in range(tp):  # T positions, top to bottom; a slice per rank when split
            h = 1.4 / tp
            colour = colours(r % 10) if split else "0.75"
            ax.add_patch(plt.Rectangle((x, y + 1.4 - (r + 1) * h), 0.22, h, fc=colour,
                                       ec="white", alpha=0.8))  # fmt: skip
        ax.text(x + 0.11, y - 0.12, f"T/{tp} each" if split else "all T", ha="center",
                va="top", fontsize=7)  # fmt: skip

    for name, y in rows.items():
        sp = "sequence" in name
        ax.text(-0.3, y + 1.75, name, fontsize=9, fontweight="bold")
        for i, (part, in_region) in enumerate(zip(parts, region, strict=True)):
            x = i * step
            # the activation entering this part: split along T under SP outside the regions
            activation(x, y, split=sp and not in_region)
            box_x = x + 0.4
            ax.add_patch(plt.Rectangle((box_x, y + 0.1), 1.3, 1.2, fc="0.97",
                                       ec="C3" if in_region else "0.4", lw=1.5 if in_region
                                       else 1.0))  # fmt: skip
            ax.text(box_x + 0.65, y + 0.7, part, ha="center", va="center", fontsize=7)
            arrow = dict(arrowstyle="->", color="0.3")
            ax.annotate("", (box_x, y + 0.7), (x + 0.24, y + 0.7), arrowprops=arrow)
            ax.annotate("", (x + step - 0.02, y + 0.7), (box_x + 1.3, y + 0.7), arrowprops=arrow)
            # the message on the way into this part (above the arrow, clear of the boxes)
            if in_region:
                label = "all-gather" if sp else "(no message)"
                ax.text(x + 0.1, y + 1.5, label, fontsize=7, color="C2" if sp else "0.4")
            # and on the way out of a region: the collective that closes it
            if in_region:
                label = "reduce-scatter" if sp else "all-reduce"
                ax.text(box_x + 1.35, y + 1.5, label, fontsize=7, color="C1" if sp else "C0")
        activation(len(parts) * step, y, split=sp)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(r % 10), alpha=0.8) for r in range(tp)]
    handles += [plt.Rectangle((0, 0), 1, 1, color="0.75"), plt.Rectangle((0, 0), 1, 1, fc="0.97",
                ec="C3", lw=1.5)]  # fmt: skip
    names = [f"rank {r}'s positions" for r in range(tp)]
    names += ["all positions, on every rank", "a TP region (weights split)"]
    ax.legend(handles, names, fontsize=7, loc="upper center", ncol=len(names),
              bbox_to_anchor=(0.5, -0.02), frameon=False)  # fmt: skip
    ax.set_xlim(-0.4, len(parts) * step + 0.5)
    ax.set_ylim(-0.45, 4.7)
    ax.axis("off")
    ax.set_title(f"one block on a TP group of {tp}: each bar is an activation (B, T, C), "
                 "positions T top to bottom", fontsize=9)  # fmt: skip
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
    ax = stacked_bars(parts, "tokens", title, ax=ax, limit=limit)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + 0.12 * (high - low))  # room for the labels above the bars
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


def moe_round_trip(
    experts: Sequence[Sequence[Sequence[int]]],
    weights: Sequence[Sequence[Sequence[float]]],
    sent: Sequence[Sequence[tuple[int, int]]],
    send_splits: Sequence[Sequence[int]],
    n_experts: int,
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """An expert-parallel MoE layer's round trip, one lane per rank, four columns: each token's
    experts and gate weights (route); the counts per expert, exchanged first, and the rows it
    sends, in sending order, with how many go to each rank (dispatch); the rows each rank
    received, grouped by its experts (experts); each token's output, the gate-weighted sum of
    its results, back in token order (combine). ``experts[r][i]``, ``weights[r][i]``: token i
    of rank r's k experts and gate weights; ``sent[r]``: the (token, choice) of each row rank r
    sent, in order; ``send_splits[r][j]``: how many of them went to rank j; experts in
    contiguous blocks of ``n_experts / ranks``. Boxes are coloured by the rank whose token they
    carry. Chapter 13 draws one real run."""
    world = len(experts)
    local = n_experts // world
    colours = plt.get_cmap("tab10")
    counts = [[0] * n_experts for _ in range(world)]  # rows rank r sends to expert e
    received: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for src in range(world):
        start = 0
        for dst, n in enumerate(send_splits[src]):
            for token, choice in sent[src][start : start + n]:
                expert = experts[src][token][choice]
                counts[src][expert] += 1
                received[dst].append((expert, src, token))
            start += n
    for rows in received:
        rows.sort(key=lambda row: row[0])  # stable: by expert, each in arrival order
    rows_of = [max(len(sent[r]), len(received[r]), len(experts[r])) for r in range(world)]
    tops = [sum(rows_of[:r]) + 2.4 * r for r in range(world + 1)]
    ax = ax or plt.subplots(figsize=(12.5, 0.3 * tops[-1] + 1.2))[1]
    width, gap = (2.6, 2.4, 2.4, 3.2), 0.9
    left = [sum(width[:c]) + gap * c for c in range(4)]
    heads = ("1. route: each token's experts\n(gate weights)",
             "2. counts exchanged, then dispatch:\nrows sent, sorted by expert",
             "3. experts run on the rows\nreceived, grouped by expert",
             "4. combine: results back home,\nx gate weight, summed per token")  # fmt: skip

    def box(column: int, y: float, text: str, rank: int) -> None:
        x = left[column]
        ax.add_patch(plt.Rectangle((x, y - 0.42), width[column], 0.84, fc=colours(rank % 10),
                                   alpha=0.3, ec=colours(rank % 10)))  # fmt: skip
        ax.text(x + 0.08, y, text, ha="left", va="center", fontsize=7, family="monospace")

    for rank in range(world):
        top = tops[rank]
        ax.text(
            -0.3,
            top,
            f"rank {rank}\nexperts\n{rank * local}-{(rank + 1) * local - 1}",
            ha="right",
            va="top",
            fontsize=8,
            weight="bold",
            color=colours(rank % 10),
        )
        for i, (es, ws) in enumerate(zip(experts[rank], weights[rank], strict=True)):
            pairs = ", ".join(f"e{e} ({w:.3f})" for e, w in zip(es, ws, strict=True))
            box(0, top + i, f"t{i} -> {pairs}", rank)
            terms = " + ".join(f"{w:.3f} e{e}(t{i})" for e, w in zip(es, ws, strict=True))
            box(3, top + i, f"t{i} = {terms}", rank)
        start = 0
        for dst, n in enumerate(send_splits[rank]):
            for j in range(start, start + n):
                token, choice = sent[rank][j]
                box(1, top + j, f"t{token} for e{experts[rank][token][choice]}", rank)
            if n:
                middle = top + start + (n - 1) / 2
                ax.annotate("", (left[1] + width[1] + 0.1, top + start - 0.4),
                            (left[1] + width[1] + 0.1, top + start + n - 0.6),
                            arrowprops=dict(arrowstyle="|-|", lw=0.8, color="0.4",
                                            mutation_scale=2))  # fmt: skip
                ax.text(left[1] + width[1] + 0.2, middle, f"{n} to\nrank {dst}", ha="left",
                        va="center", fontsize=7, color="0.25")  # fmt: skip
            start += n
        for j, (expert, src, token) in enumerate(received[rank]):
            box(2, top + j, f"e{expert}: rank {src}'s t{token}", src)
        mine = range(rank * local, (rank + 1) * local)
        below = top + rows_of[rank] + 0.1
        ax.text(left[1], below, f"counts sent to e0-e{n_experts - 1}: "
                + " ".join(str(c) for c in counts[rank]), fontsize=7, va="center")  # fmt: skip
        ax.text(left[2], below, f"counts received from ranks 0-{world - 1}: "
                + " ".join(str(sum(counts[s][e] for e in mine)) for s in range(world)),
                fontsize=7, va="center")  # fmt: skip
    for c, head in enumerate(heads):
        ax.text(left[c] + width[c] / 2, -0.8, head, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-1.6, left[-1] + width[-1] + 0.1)
    ax.set_ylim(tops[-1] - 1.6, -2.2)
    ax.axis("off")
    ax.set_title(title or "one MoE layer's round trip: route, dispatch, experts, combine",
                 fontsize=9, pad=14)  # fmt: skip
    return ax


def checkpoint_reads(
    shape: tuple[int, int],
    saved: Sequence[Sequence],
    reads: dict[int, tuple[Sequence[int], Sequence[int]]],
    title: str = "",
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """One 2-D tensor of a checkpoint (rows down, columns across): each slice the checkpoint holds
    (``saved``, ``(offsets, sizes)`` as DCP's metadata lists them, or ``(offsets, sizes,
    writer)`` as :func:`~dmlbook.advanced.composition.checkpoint.saved_slices` does) in its own
    colour, named by its index or its writer's rank, and each rank of the loading layout's
    slice (``reads``, rank -> ``(offsets, sizes)``) as a dashed box naming the ranks that read
    it and the saved slices it overlaps. Chapter 13 draws a checkpoint saved at ``tp4`` and
    loaded at ``dp2 x tp2`` with it."""
    rows, cols = shape
    ax = ax or plt.subplots(figsize=(4.2, 3.6))[1]
    colours = plt.get_cmap("Pastel1")

    def box(offsets, sizes):  # (x, y, width, height): columns across, rows down
        return offsets[1], offsets[0], sizes[1], sizes[0]

    def overlap(a, b) -> bool:  # (offsets, sizes, ...) of two slices
        return all(oa < ob + sb and ob < oa + sa
                   for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True))  # fmt: skip

    # A slice is named by its writer's rank when ``saved`` gives it, else by its index.
    writers = [str(c[2]) for c in saved] if len(saved[0]) > 2 else None
    for i, chunk in enumerate(saved):
        x, y, w, h = box(chunk[0], chunk[1])
        ax.add_patch(plt.Rectangle((x, y), w, h, fc=colours(i % 9), ec="0.35", lw=1.2))
        label = f"saved by\nrank {writers[i]}" if writers else f"saved {i}"
        ax.text(x + 0.03 * cols, y + 0.03 * rows, label, fontsize=7, va="top", color="0.3")
    readers: dict[tuple, list[int]] = {}  # copies (dp, cp) read the same slice: one box
    for rank, (offsets, sizes) in sorted(reads.items()):
        readers.setdefault((tuple(offsets), tuple(sizes)), []).append(rank)
    for chunk, ranks in readers.items():
        x, y, w, h = box(*chunk)
        inset = 0.02 * min(rows, cols)
        ax.add_patch(plt.Rectangle((x + inset, y + inset), w - 2 * inset, h - 2 * inset,
                                   fill=False, ec="0.1", ls="--", lw=1.0))  # fmt: skip
        sources = [i for i, c in enumerate(saved) if overlap(c, chunk)]
        if writers:
            label = "reads saved by " + ", ".join(writers[i] for i in sources)
        else:
            label = "reads " + ", ".join(str(i) for i in sources)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        ax.text(x + w / 2, y + h / 2, f"{who}\n{label}", ha="center", va="center", fontsize=7.5,
                bbox=dict(fc="white", ec="none", alpha=0.8, pad=1.5))  # fmt: skip
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel(f"columns (0 to {cols})", fontsize=8)
    ax.set_ylabel(f"rows (0 to {rows})", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=9)
    return ax
