"""Pictures for ZeRO (chapter 9b): one unit's flat buffer, its padding and its N shards."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

__all__ = ["draw_flat_buffer"]


def draw_flat_buffer(
    params: dict[str, int], world_size: int, ax: plt.Axes | None = None
) -> plt.Axes:
    """One unit's flat buffer, one box per element numbered by its index: each parameter's slice
    (named above), the zero padding (hatched) up to N x S, and below it the shard
    ``[r*S, (r+1)*S)`` each rank keeps (chapter 9b)."""
    numel = sum(params.values())
    S = -(-numel // world_size)
    total = S * world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.55 * total + 1.5), 2.4))
    shades = ["#dbe7f3", "#f3e3cc", "#dcefd8", "#eadcf0"]
    offset = 0
    spans = [*params.items(), ("padding", total - numel)]
    for k, (name, size) in enumerate(spans):
        if size == 0:
            continue
        pad = name == "padding"
        for i in range(offset, offset + size):
            ax.add_patch(Rectangle((i, 1), 1, 1, facecolor="white" if pad else shades[k % 4],
                                   edgecolor="0.3", hatch="///" if pad else None))  # fmt: skip
            ax.text(i + 0.5, 1.5, str(i), ha="center", va="center", fontsize=8)  # element index
        ax.text(offset + size / 2, 2.25, f"{name} ({size})", ha="center", va="bottom", fontsize=9)
        offset += size
    for r in range(world_size):
        color = plt.get_cmap("tab10")(r)
        ax.add_patch(Rectangle((r * S + 0.08, 0.25), S - 0.16, 0.5, facecolor=color, alpha=0.8))
        ax.text(r * S + S / 2, 0.5, f"rank {r}: [{r * S}, {(r + 1) * S})", ha="center",
                va="center", fontsize=8, color="white")  # fmt: skip
    ax.set_xlim(-0.2, total + 0.2)
    ax.set_ylim(0, 2.8)
    ax.axis("off")
    ax.set_title(f"One unit's flat buffer: {numel} elements padded to N x S = {world_size} x {S}",
                 fontsize=10)  # fmt: skip
    return ax
