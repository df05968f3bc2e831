"""A mixture-of-experts feed-forward layer, in one process (chapter 13).

A mixture of experts (MoE) replaces the transformer's one MLP by E of them, the *experts*, and a
small *router* that sends each token to its top k (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch Transformer, Fedus et al. 2021). Parameters grow E-fold while each token's compute
stays that of k MLPs. Three ideas make it trainable:

* **top-k routing** (:class:`Router`): softmax over the router's logits, keep the k largest; the
  token's output is the experts' outputs weighted by those probabilities (renormalised over the
  k, as GShard and Mixtral do, when k > 1);
* **capacity**: an expert takes at most ``ceil(capacity_factor x N x k / E)`` of the N tokens
  routed together, so that every expert's batch has a fixed bound. Tokens beyond it are
  *dropped* (their output from that expert is zero; the residual connection carries them). Places
  are given first-choice-first, in token order, as in GShard; :class:`Routing` counts the drops;
* **load balancing**: the auxiliary loss ``E x sum_e f_e P_e`` (f_e: the share of assignments
  that chose expert e, P_e: the mean router probability of e; Switch Transformer eq. 4) is
  smallest when both are uniform, so adding it to the loss spreads the tokens.

:class:`MoEFeedForward` is the single-process layer, with :class:`dmlbook.models.FeedForward`
experts; :func:`moe_char_gpt` is the char-GPT with an MoE in every block and
:func:`moe_aux_loss` sums the blocks' auxiliary losses. Chapter 13's expert parallelism
(:mod:`dmlbook.advanced.expert_parallel`) spreads the experts over ranks and must equal this layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dmlbook.models import CharGPT, FeedForward, GPTConfig, build_seeded

__all__ = [
    "MoEFeedForward",
    "Router",
    "Routing",
    "expert_capacity",
    "moe_aux_loss",
    "moe_char_gpt",
]


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Most tokens an expert takes of ``tokens`` routed together: ceil(factor x tokens x k / E);
    ``None`` for no limit (every assignment kept)."""
    if capacity_factor is None:
        return tokens
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None), got {capacity_factor}")
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


@dataclass
class Routing:
    """Where a group of N tokens goes: k experts per token, their weights, who fits."""

    expert: torch.Tensor  # (N, k) int64: each token's experts, most probable first
    weight: torch.Tensor  # (N, k): the gate weights its experts' outputs are scaled by
    kept: torch.Tensor  # (N, k) bool: within the expert's capacity (else dropped)
    routed_per_expert: torch.Tensor  # (E,) int64: assignments to each expert, kept or not
    capacity: int  # the most assignments an expert keeps
    aux_loss: torch.Tensor  # () the load-balancing loss

    @property
    def kept_per_expert(self) -> torch.Tensor:
        """(E,) assignments each expert computes: min(routed, capacity)."""
        return self.routed_per_expert.clamp(max=self.capacity)

    @property
    def dropped(self) -> int:
        """Assignments that found their expert full (a token may lose one of its k experts)."""
        return int((~self.kept).sum())

    def order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept assignments sorted by expert (then queue position): their (token, choice)
        indices. Expert e's rows are the ``kept_per_expert[e]`` after those of experts < e."""
        choice_major = self.expert.t().reshape(-1)  # (k N,): every first choice, then second ...
        keep = self.kept.t().reshape(-1)
        assignment = torch.arange(len(choice_major), device=keep.device)[keep]
        by_expert = torch.sort(choice_major[keep], stable=True).indices  # queue order kept
        n_tokens = max(1, self.expert.shape[0])
        picked = assignment[by_expert]
        return picked % n_tokens, picked // n_tokens  # token, choice


class Router(nn.Module):
    """A linear gate: top-k experts per token, their weights, capacity and the auxiliary loss."""

    def __init__(
        self, n_embd: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be between 1 and experts={n_experts}, got {top_k}")
        expert_capacity(1, n_experts, top_k, capacity_factor)  # validates the factor
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.gate = nn.Linear(n_embd, n_experts, bias=False)

    def forward(self, tokens: torch.Tensor) -> Routing:
        n, k, e = tokens.shape[0], self.top_k, self.n_experts
        probs = self.gate(tokens).softmax(dim=-1)  # (N, E)
        weight, expert = probs.topk(k, dim=-1)  # (N, k) each, most probable first
        if k > 1:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        capacity = expert_capacity(n, e, k, self.capacity_factor)
        # Queue position of each assignment at its expert: first choices of all tokens first.
        one_hot = F.one_hot(expert.t().reshape(-1), e)  # (k N, E)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # (k N,)
        kept = (position < capacity).view(k, n).t()  # (N, k)
        routed = one_hot.sum(dim=0)  # (E,)
        share = routed.to(probs.dtype) / max(1, n * k)  # f_e: not differentiable
        aux = e * (share * probs.mean(dim=0)).sum() if n else probs.sum() * 0.0  # P_e carries grad
        return Routing(expert, weight, kept, routed, capacity, aux)


class MoEFeedForward(nn.Module):
    """E :class:`~dmlbook.models.FeedForward` experts behind a :class:`Router`, one process.

    ``forward`` takes ``(..., C)`` and routes all its tokens as one group; ``last_routing`` keeps
    the routing of the last call (its ``aux_loss`` to add to the loss, the counts to plot)."""

    def __init__(
        self,
        config: GPTConfig,
        n_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
    ) -> None:
        super().__init__()
        self.n_embd = config.n_embd
        self.router = Router(config.n_embd, n_experts, top_k, capacity_factor)
        self.experts = nn.ModuleList(FeedForward(config) for _ in range(n_experts))
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.n_embd:
            raise ValueError(f"tokens have n_embd={x.shape[-1]}, the experts take {self.n_embd}")
        tokens = x.reshape(-1, self.n_embd)  # (N, C)
        routing = self.last_routing = self.router(tokens)
        token, choice = routing.order()  # kept assignments, grouped by expert
        rows = tokens[token].split(routing.kept_per_expert.tolist())  # (n_e, C) per expert
        y = torch.cat([expert(r) for expert, r in zip(self.experts, rows, strict=True)])
        y = y * routing.weight[token, choice].unsqueeze(-1)  # (M, C), gate-weighted
        return torch.zeros_like(tokens).index_add(0, token, y).view_as(x)  # combine per token


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the auxiliary losses of every MoE layer's last forward (add it, scaled by a
    coefficient such as 0.01, to the training loss)."""
    losses = [m.last_routing.aux_loss for m in model.modules() if getattr(m, "last_routing", None)]
    if not losses:
        raise ValueError("no MoE layer has run a forward pass: nothing to add")
    return torch.stack(losses).sum()


def moe_char_gpt(
    vocab_size: int,
    seed: int = 0,
    n_experts: int = 4,
    top_k: int = 2,
    capacity_factor: float | None = 1.25,
    **gpt_options,
) -> CharGPT:
    """The char-GPT of :mod:`dmlbook.models` with every block's MLP an :class:`MoEFeedForward`
    (GPT-2 initialisation, as the dense model's), weights determined by ``seed``."""

    def build() -> CharGPT:
        model = CharGPT(GPTConfig(vocab_size=vocab_size, **gpt_options))
        for block in model.blocks:
            block.mlp = MoEFeedForward(model.config, n_experts, top_k, capacity_factor)
            block.mlp.apply(CharGPT._init_weights)
            for expert in block.mlp.experts:
                std = 0.02 / math.sqrt(2 * model.config.n_layer)
                nn.init.normal_(expert.c_proj.weight, mean=0.0, std=std)
        return model

    return build_seeded(build, seed)
