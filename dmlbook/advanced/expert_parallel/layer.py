"""Expert parallelism: a mixture of experts spread over ranks, tokens moved by all-to-all
(chapter 13).

A mixture-of-experts layer (:mod:`dmlbook.advanced.expert_parallel.moe`) has E experts; with
expert parallelism (GShard, Lepikhin et al. 2020) each of the p ranks of a group holds E / p of
them, and each rank routes its own tokens. One forward pass is

1. **route** (compute): this rank's router picks each local token's top-k experts and drops what
   exceeds an expert's capacity, exactly as the single-process layer does with these tokens;
2. **dispatch** (communication): the kept assignments, sorted by expert and so by the rank that
   holds it, go out in one all-to-all (:func:`dmlbook.comm.alltoall.differentiable_all_to_all`),
   after a small all-to-all of the counts, so each rank knows how many rows arrive from whom;
3. **experts** (compute): each local expert runs once on every row it received, from every rank;
4. **combine** (communication, then compute): the reverse all-to-all sends each result home,
   where it is scaled by its gate weight and added into its token's output.

Backward runs the same exchanges in reverse (the all-to-all's conjugate is the reverse
all-to-all), so each expert's gradient sums over the tokens of every rank. The router is
replicated: its gradient covers this rank's tokens only, and is averaged over the data-parallel
ranks like any replicated weight (the training loop's job, as for data parallelism).

:class:`ExpertParallelMoE` is this rank's part of an unsplit :class:`~dmlbook.advanced.
expert_parallel.moe.MoEFeedForward`; :class:`ExpertParallel` is the plan style that makes it, and
:func:`apply_expert_parallel` applies it to every block of an unmodified MoE char-GPT. The EP
group may be the whole world or a subgroup (a dimension of a
:class:`~dmlbook.advanced.composition.layout.ProcessGroups`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmlbook.advanced.composition.plan import apply_plan, expect_module
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward, Routing
from dmlbook.comm.alltoall import all_to_all_single, differentiable_all_to_all, exchange_sizes
from dmlbook.comm.groups import even_block, group_rank_size

__all__ = ["ExpertParallelMoE", "apply_expert_parallel"]


@dataclass
class Trip:
    """One dispatch, what the combine needs to bring the results home: the rows this rank sent,
    as (``token``, ``choice``) indices in sending order; the rows each rank sends to each local
    expert (``incoming``, ranks x local experts); the rows sent to and received from each rank;
    the received rows."""

    token: torch.Tensor
    choice: torch.Tensor
    incoming: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    received: torch.Tensor


class ExpertParallelMoE(nn.Module):
    """This rank's experts of an MoE layer (experts ``expert_range``), the router replicated,
    tokens dispatched to the experts' ranks and combined back by all-to-all over ``group``."""

    def __init__(self, moe: MoEFeedForward, group=None) -> None:
        super().__init__()
        rank, world = group_rank_size(group)
        n_experts = len(moe.experts)
        start, stop = even_block(n_experts, rank=rank, world_size=world, what="experts")
        self.group, self.n_embd, self.n_experts = group, moe.n_embd, n_experts
        self.expert_range = (start, stop)
        self.router = moe.router  # replicated: every rank routes its own tokens
        self.experts = nn.ModuleList(moe.experts[start:stop])  # this rank's experts only
        self.last_routing: Routing | None = None
        self.last_trip: Trip | None = None

    @classmethod
    def from_moe(cls, moe: MoEFeedForward, group=None) -> ExpertParallelMoE:
        """This rank's part of an unsplit layer (shares its modules; the plan deep-copies)."""
        return cls(moe, group)

    def _check(self, x: torch.Tensor) -> None:
        """One all-gather of each rank's token width, so that every rank raises the same error
        when they differ instead of one rank failing while the others wait in the all-to-all."""
        widths = [row[0] for row in exchange_sizes([x.shape[-1]], self.group, x.device)]
        if any(w != self.n_embd for w in widths):
            found = ", ".join(f"rank {r}: {w}" for r, w in enumerate(widths))
            raise ValueError(
                f"expert parallelism: every rank's tokens must have n_embd={self.n_embd}, the "
                f"experts' input width; the ranks of the group passed n_embd {found}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The round trip: route, dispatch, experts, combine (the module's docstring)."""
        self._check(x)
        tokens = x.reshape(-1, self.n_embd)  # (N, C): this rank's tokens
        routing = self.last_routing = self.router(tokens)  # compute: each token's k experts
        trip = self.last_trip = self.dispatch(tokens, routing)  # communication: to the experts
        y = self.run_experts(trip.received, trip.incoming)  # compute: each expert, its rows
        return self.combine(y, trip, routing.weight, len(tokens)).view_as(x)  # communication

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The counts all-to-all, before the rows: ``counts`` (E,) holds how many rows this rank
        sends to each expert; returns ``incoming`` (ranks, local experts): how many rows each
        rank sends to each of this rank's experts. Every rank then knows how many rows arrive
        from whom, so it can allocate the receive buffer and cut it into per-rank blocks."""
        _, world = group_rank_size(self.group)
        incoming = torch.empty_like(counts)  # block r: what rank r sends to my experts
        all_to_all_single(incoming, counts.contiguous(), group=self.group)  # block j -> rank j
        return incoming.view(world, len(self.experts))

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> Trip:
        """Each kept (token, expert) row to the rank that holds the expert: the counts first
        (:meth:`exchange_counts`), then one all-to-all of the rows, sorted by expert (so by rank).
        Backward, the rows' gradients come back by the reverse all-to-all."""
        _, world = group_rank_size(self.group)
        token, choice = routing.order()  # kept assignments, sorted by expert, so by rank
        counts = routing.kept_per_expert  # (E,) rows this rank sends to each expert
        incoming = self.exchange_counts(counts)
        send_splits = counts.view(world, -1).sum(dim=1).tolist()
        recv_splits = incoming.sum(dim=1).tolist()
        received = differentiable_all_to_all(tokens[token], recv_splits, send_splits, self.group)
        return Trip(token, choice, incoming, send_splits, recv_splits, received)

    def run_experts(self, received: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
        """Each local expert once, on all its rows from every rank. The rows arrive in blocks,
        by source rank, then by local expert (``incoming``: rows per (rank, local expert)); each
        expert runs on its block from every rank, and its results take the blocks' places, so
        they leave in arrival order, as the reverse all-to-all needs."""
        world, local = incoming.shape
        blocks = list(received.split(incoming.reshape(-1).tolist()))  # block r * local + j
        for j, expert in enumerate(self.experts):
            mine = [r * local + j for r in range(world)]  # expert j's block from each rank
            results = expert(torch.cat([blocks[b] for b in mine]))
            for b, result in zip(mine, results.split([len(blocks[b]) for b in mine]), strict=True):
                blocks[b] = result
        return torch.cat(blocks)

    def combine(self, y: torch.Tensor, trip: Trip, weight: torch.Tensor, n: int) -> torch.Tensor:
        """The reverse all-to-all sends each result home (the splits swapped), in the order its
        row left; there each is scaled by its gate weight and added into its token's output, row
        ``trip.token[i]``: the ``n`` tokens come back in their original order."""
        home = differentiable_all_to_all(y, trip.send_splits, trip.recv_splits, self.group)
        home = home * weight[trip.token, trip.choice].unsqueeze(-1)  # (rows, C), gate-weighted
        return home.new_zeros(n, home.shape[-1]).index_add(0, trip.token, home)

    def extra_repr(self) -> str:
        start, stop = self.expert_range
        return f"experts={self.n_experts} (this rank: {start}:{stop})"


@dataclass(frozen=True)
class ExpertParallel:
    """Plan style: an :class:`~dmlbook.advanced.expert_parallel.moe.MoEFeedForward` becomes
    this rank's :class:`ExpertParallelMoE` over the group."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        expect_module(self, module, MoEFeedForward)
        return ExpertParallelMoE.from_moe(module, group)


def apply_expert_parallel(model: nn.Module, group=None, pattern: str = "blocks.*.mlp") -> nn.Module:
    """Every MoE layer that ``pattern`` names becomes expert-parallel over ``group``, in place
    (the plan mechanism of :mod:`dmlbook.advanced.composition.plan`); returns ``model``."""
    return apply_plan(model, {pattern: ExpertParallel()}, group)
