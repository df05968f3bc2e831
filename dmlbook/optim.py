"""Optimizer steps written out by hand, elementwise, in torch's own order of operations.

Chapter 8's :class:`~dmlbook.model_parallel.efficiency.offload.OffloadedAdam` streams Adam's moments
from CPU memory or disk and steps each parameter with :func:`adam_update_`; chapter 9b's ZeRO steps
each rank's flat shard with the same function. Elementwise is what lets a shard be stepped alone and
still equal an optimizer that sees every parameter; the tests check it against
``torch.optim.Adam`` bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["adam_update_"]


@torch.no_grad()
def adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """One Adam update (Kingma and Ba 2015) of ``param`` in place, step counted from 1, in the
    same order of operations as ``torch.optim.Adam``'s single-tensor path, so results match."""
    if weight_decay:
        grad = grad.add(param, alpha=weight_decay)  # L2 penalty, as Adam (not AdamW) does
    exp_avg.lerp_(grad, 1 - beta1)  # m = beta1 m + (1 - beta1) g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = beta2 v + (1 - beta2) g^2
    step_size = lr / (1 - beta1**step)  # bias corrections: m and v start at zero
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
