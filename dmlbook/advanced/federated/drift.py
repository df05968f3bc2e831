"""Client drift at picture size: FedAvg on two clients whose losses are 2-D quadratics
(Zhao et al. 2018, "Federated learning with non-IID data"; chapter 10, see
:mod:`dmlbook.advanced.federated`).

Client k's loss is f_k(w) = 1/2 (w - c_k)^T A_k (w - c_k): a bowl with its bottom at c_k (the
client's own optimum) and curvature A_k. The global loss is the mean of the f_k; its optimum
solves sum_k A_k (w - c_k) = 0. With one local step per round FedAvg is gradient descent on the
global loss and finds that optimum; with many, each client walks to its own c_k and the average
of the walks settles somewhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DriftRun:
    """One FedAvg run on quadratic clients: the global model after every round (``rounds + 1``
    points, the start first) and each client's local path in the first round."""

    global_path: torch.Tensor  # (rounds + 1, 2)
    first_round: list[torch.Tensor]  # per client: (local_steps + 1, 2), from w to w_k


def global_optimum(hessians: list[torch.Tensor], optima: list[torch.Tensor]) -> torch.Tensor:
    """The minimum of the mean of the clients' quadratics: solve sum_k A_k (w - c_k) = 0."""
    hessians, optima = [a.double() for a in hessians], [c.double() for c in optima]
    return torch.linalg.solve(
        sum(hessians), sum(a @ c for a, c in zip(hessians, optima, strict=True))
    )


def quadratic_fedavg(
    hessians: list[torch.Tensor],
    optima: list[torch.Tensor],
    start: torch.Tensor,
    local_steps: int,
    lr: float,
    rounds: int,
) -> DriftRun:
    """FedAvg with equal-sized clients on f_k(w) = 1/2 (w - c_k)^T A_k (w - c_k): each round,
    every client takes ``local_steps`` gradient steps from the global w, and w becomes the mean
    of where they ended."""
    hessians, optima = [a.double() for a in hessians], [c.double() for c in optima]
    w, path, first_round = start.double(), [start.double()], []
    for r in range(rounds):
        ends = []
        for a, c in zip(hessians, optima, strict=True):
            w_k, walk = w.clone(), [w]
            for _ in range(local_steps):
                w_k = w_k - lr * a @ (w_k - c)  # the gradient of f_k is A_k (w - c_k)
                walk.append(w_k)
            ends.append(w_k)
            if r == 0:
                first_round.append(torch.stack(walk))
        w = torch.stack(ends).mean(0)  # the server's average (equal n_k)
        path.append(w)
    return DriftRun(torch.stack(path), first_round)
