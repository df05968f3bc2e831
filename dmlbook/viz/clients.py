"""Federated learning's clients: FedAvg rounds, client drift and secure aggregation's masks.

Chapter 10 draws a FedAvg round, client drift on two quadratic clients and secure aggregation's
pairwise masks with ``fedavg_round``, ``client_drift`` and ``pairwise_masks``.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch

__all__ = [
    "client_drift",
    "fedavg_round",
    "pairwise_masks",
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


def client_drift(
    hessians: Sequence[torch.Tensor],
    optima: Sequence[torch.Tensor],
    optimum: torch.Tensor,
    one_round: object,
    runs: dict[str, object],
    axes: Sequence[plt.Axes] | None = None,
) -> Sequence[plt.Axes]:
    """Client drift (chapter 10) on 2-D quadratic clients, over the contours of each client's
    loss, its optimum c_k and the global optimum. Left: ``one_round`` (a ``DriftRun``), every
    client's local steps from the same w and their average. Right: the global model round by
    round for every run in ``runs`` (label -> ``DriftRun``)."""
    fig = None
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    left, right = axes
    grid = torch.linspace(-2.6, 1.6, 120, dtype=torch.float64)
    gx, gy = torch.meshgrid(grid, grid, indexing="xy")
    points = torch.stack([gx, gy], -1)  # (120, 120, 2)
    for k, (a, c) in enumerate(zip(hessians, optima, strict=True)):
        d = points - c.double()
        loss = 0.5 * torch.einsum("...i,ij,...j->...", d, a.double(), d)
        for ax in axes:
            ax.contour(gx, gy, loss, levels=[0.05, 0.3, 1, 2.5], colors=f"C{k}", alpha=0.35,
                       linewidths=0.8)  # fmt: skip
            ax.plot(*c, "o", color=f"C{k}", ms=8, label=f"client {k}'s optimum c_{k}")
    for ax in axes:
        ax.plot(*optimum, "k*", ms=14, label="global optimum (both clients' data)", zorder=5)
        ax.set(xlabel="w[0]", ylabel="w[1]", aspect="equal")
    for k, walk in enumerate(one_round.first_round):
        left.plot(walk[:, 0], walk[:, 1], ".-", color=f"C{k}", lw=1, ms=4,
                  label=f"client {k}'s local steps")  # fmt: skip
    left.plot(*one_round.global_path[1], "D", color="tab:red", ms=8, zorder=6,
              label="their average: w after the round")  # fmt: skip
    steps = len(one_round.first_round[0]) - 1
    left.set_title(f"One round of {steps} local steps, starting at the global optimum", fontsize=9)
    for i, (name, run) in enumerate(runs.items()):
        path = run.global_path
        right.plot(path[:, 0], path[:, 1], ["-", "--", ":"][i % 3], marker="o", ms=3,
                   color=["tab:green", "tab:red", "tab:purple"][i % 3], lw=1,
                   label=f"global w round by round, {name}")  # fmt: skip
    right.set_title("FedAvg from a far start: where the global model settles", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    if fig is not None:
        fig.tight_layout()
    return axes
