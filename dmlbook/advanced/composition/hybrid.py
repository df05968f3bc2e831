"""Hybrid data and tensor parallelism on a DP x TP grid of ranks (chapter 9).

Hybrid parallelism gives every rank several jobs at once. On a DP x TP grid, rank r holds one
tensor-parallel shard of the model (its TP coordinate) for one slice of the batch (its DP
coordinate): the ranks of a *row* split a layer between them (Megatron), the ranks of a *column*
hold the same shard and average its gradients (data parallelism). Mesh-TensorFlow calls this the
batch x model mesh; torch calls it ``init_device_mesh``.

The grid is chapter 13's rank grid in two dimensions: ``Layout(dp=2, tp=2)``
(:class:`~dmlbook.advanced.composition.layout.Layout`), whose
:meth:`~dmlbook.advanced.composition.layout.Layout.group_ranks` is the pure table of each axis's
groups and whose :class:`~dmlbook.advanced.composition.layout.ProcessGroups` creates the ones
this rank is in. The last axis varies fastest: the TP groups are neighbouring ranks, which on
GPUs are the GPUs of one machine, joined by NVLink, as Megatron-LM places them.

:func:`hybrid_step` is one training step on such a grid: forward and backward of the rank's
tensor-parallel shard (chapter 9's plan, communicating inside its TP group), then the gradients
averaged over its DP group, then the optimizer's step. :func:`train_hybrid` runs it on the
char-GPT of :mod:`dmlbook.models`, each rank on its DP share of every batch, and averages the
shares' losses over DP into the whole batch's. (Chapter 13's
:func:`~dmlbook.advanced.composition.compose.compose` builds the same thing with more
dimensions, and ZeRO-1 over DP.)
:func:`~dmlbook.data_parallel.loop.train_reference` (Adam, whole batches) is the single-process
run it equals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.composition.layout import ProcessGroups
from dmlbook.advanced.composition.plan import tensor_parallel_char_gpt
from dmlbook.comm.groups import local_rows
from dmlbook.models import CharGPT

__all__ = ["hybrid_step", "shard_of", "train_hybrid"]


@dataclass
class HybridResult:
    """What :func:`train_hybrid` returns on each rank."""

    losses: list[float]  # the global batch's mean loss at each step
    model: nn.Module  # this rank's trained TP shard


def hybrid_step(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer, dp_group
) -> float:
    """One DP x TP training step (chapter 9): forward and backward of this rank's tensor-parallel
    shard on its DP share of the batch (the layers' f and g all-reduce inside the TP group), the
    gradients averaged over the DP group, then the optimizer's step. Returns the loss of this
    rank's share (the same on every rank of its TP group)."""
    idx, targets = batch  # (B / dp, T): this rank's rows of the global batch
    optimizer.zero_grad()
    _, loss = model(idx, targets)  # forward: g all-reduces each block's halves over TP
    loss.backward()  # backward: f all-reduces the input gradients over TP
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    if dp > 1:
        for p in model.parameters():  # communication: average each shard's gradient over DP
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp
    optimizer.step()  # plain Adam on this rank's shard
    return loss.item()


def train_hybrid(
    make_model: Callable[[], CharGPT],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    groups: ProcessGroups,
    lr: float = 1e-2,
) -> HybridResult:
    """DP x TP training on ``groups = ProcessGroups(Layout(dp=..., tp=...))``: every rank builds
    the whole model from the same seed, keeps its TP shard (chapter 9's plan) and runs
    :func:`hybrid_step` with Adam on its DP share of each batch. Returns the whole batch's mean
    loss per step and this rank's shard."""
    dp = groups.layout.dp
    model = tensor_parallel_char_gpt(make_model(), group=groups.tp)  # this rank's TP shard
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        mine = local_rows(tuple(batch), groups.dp)  # rows [d B/dp, (d+1) B/dp) at DP coordinate d
        losses.append(hybrid_step(model, mine, optimizer, groups.dp))
    losses = torch.tensor(losses, dtype=torch.float64)  # the mean loss of my DP share, per step
    if dp > 1:  # communication: the mean of the DP shares' equal-sized means = the batch's mean
        dist.all_reduce(losses, group=groups.dp)
        losses /= dp
    return HybridResult(losses.tolist(), model)


def shard_of(model: CharGPT, groups: ProcessGroups) -> nn.Module:
    """This rank's TP shard of an unsplit model (to compare a hybrid run with the reference)."""
    return tensor_parallel_char_gpt(model, group=groups.tp)
