"""Who trains on what when clients come and go: FedAvg rounds, secure aggregation's masks and
elastic training's samples.

Chapter 10 draws a FedAvg round and secure aggregation's pairwise masks with ``fedavg_round`` and
``pairwise_masks``; chapter 11 which rank trains which sample across a resize with
``sample_owners``.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = [
    "fedavg_round",
    "pairwise_masks",
    "sample_owners",
]


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
