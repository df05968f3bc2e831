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

__all__ = ["ExpertParallel", "ExpertParallelMoE", "apply_expert_parallel"]


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
        rank, world = group_rank_size(self.group)
        self._check(x)
        local = len(self.experts)
        tokens = x.reshape(-1, self.n_embd)  # (N, C): this rank's tokens
        routing = self.last_routing = self.router(tokens)  # compute: route
        token, choice = routing.order()  # kept assignments, sorted by expert, so by rank
        counts = routing.kept_per_expert  # (E,) rows this rank sends to each expert
        # Communication: the counts first, so each rank knows how many rows come from whom.
        incoming = torch.empty_like(counts)  # (world * local,): [source rank, local expert]
        all_to_all_single(incoming, counts.contiguous(), group=self.group)
        incoming = incoming.view(world, local)
        send_splits = counts.view(world, local).sum(dim=1).tolist()
        recv_splits = incoming.sum(dim=1).tolist()
        # Communication: dispatch the rows to their experts' ranks.
        received = differentiable_all_to_all(tokens[token], recv_splits, send_splits, self.group)
        # Compute: regroup by local expert (the rows arrive grouped by source rank), run each
        # expert once on all its rows, and put the results back in arrival order.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(world), incoming.reshape(-1)
        )
        by_expert = torch.sort(expert_of_row, stable=True).indices
        rows = received[by_expert].split(incoming.sum(dim=0).tolist())
        y = torch.cat([expert(r) for expert, r in zip(self.experts, rows, strict=True)])
        y = torch.empty_like(y).index_copy(0, by_expert, y)  # arrival order again
        # Communication: combine, each result back to its token's rank.
        y = differentiable_all_to_all(y, send_splits, recv_splits, self.group)
        y = y * routing.weight[token, choice].unsqueeze(-1)  # compute: gate-weighted sum
        return torch.zeros_like(tokens).index_add(0, token, y).view_as(x)

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
