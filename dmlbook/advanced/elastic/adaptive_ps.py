"""A parameter server whose workers join and leave between rounds (chapter 11)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dmlbook.advanced.elastic.training import epoch_order

# --------------------------------------------------------------------------- adaptive PS

WORK, LEAVE = 1, 2


@dataclass
class AdaptiveResult:
    """The server's view (rank 0) or a worker's view of :func:`ps_train_adaptive`."""

    rank: int
    rounds: list[int] = field(default_factory=list)  # worker: the rounds it worked in
    samples: list[list[int]] = field(default_factory=list)  # worker: its samples, per round
    members: list[list[int]] = field(default_factory=list)  # server: who worked each round
    losses: list[float] = field(default_factory=list)  # server: the global batch's mean loss
    state: dict | None = None  # server: the final model


def _check_schedule(members: Sequence[Sequence[int]], workers: int) -> None:
    if not members:
        raise ValueError("members needs at least one round")
    for r, ids in enumerate(members):
        if not ids:
            raise ValueError(f"round {r} has no worker: a parameter server needs at least one")
        if len(set(ids)) != len(ids) or not all(1 <= w <= workers for w in ids):
            raise ValueError(
                f"round {r} lists workers {list(ids)}: each must appear once and be a worker rank "
                f"in 1..{workers} (rank 0 is the server)"
            )


def ps_train_adaptive(
    model_fn: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    members: Sequence[Sequence[int]],
    global_batch: int,
    lr: float,
    seed: int = 0,
) -> AdaptiveResult:
    """A parameter server whose workers join and leave between rounds; every rank calls this.

    Rank 0 is the server, ranks 1.. the workers. ``members[r]`` lists the worker ranks of round
    ``r``. A worker waits until its first round (it has not joined yet) and returns after its last
    (it has left: its process ends). Each round the server splits the next ``global_batch``
    samples of the epoch order among the round's members, sends each its indices and the model,
    and steps with the mean of their gradients: SGD on the global batch, whoever computed it.
    """
    if not dist.is_initialized():
        raise RuntimeError("ps_train_adaptive runs on ranks: dmlbook.launch.run(fn, 1 + workers)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("ps_train_adaptive needs a server and at least one worker (world >= 2)")
    _check_schedule(members, world - 1)
    if not 1 <= global_batch <= len(x) or len(x) != len(y):
        raise ValueError(f"global_batch={global_batch} must be in 1..{len(x)} (x and y alike)")
    model = model_fn()
    params = list(model.parameters())
    result = AdaptiveResult(rank)
    if rank != 0:  # a worker: obey the server until told to leave
        while True:
            header = torch.empty(3, dtype=torch.int64)
            dist.recv(header, 0)
            kind, round_, n = header.tolist()
            if kind == LEAVE:
                return result
            idx = torch.empty(n, dtype=torch.int64)
            flat = parameters_to_vector(params).detach()
            dist.recv(idx, 0)
            dist.recv(flat, 0)
            vector_to_parameters(flat, params)
            loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum")
            model.zero_grad()
            loss.backward()
            grad = parameters_to_vector([p.grad for p in params])
            dist.send(torch.cat([grad, loss.detach().reshape(1)]), 0)
            result.rounds.append(round_)
            result.samples.append(idx.tolist())
    last_round = {w: max((r for r, ids in enumerate(members) if w in ids), default=-1)
                  for w in range(1, world)}  # fmt: skip
    for w, r in last_round.items():
        if r < 0:  # never scheduled: it leaves at once
            dist.send(torch.tensor([LEAVE, -1, 0]), w)
    epoch, position, order = 0, 0, epoch_order(len(x), seed, 0)
    for round_, ids in enumerate(members):
        if position + global_batch > len(order):  # a new epoch (the short tail is dropped)
            epoch, position = epoch + 1, 0
            order = epoch_order(len(x), seed, epoch)
        batch = order[position : position + global_batch]
        position += global_batch
        cuts = [len(batch) * i // len(ids) for i in range(len(ids) + 1)]
        flat = parameters_to_vector(params).detach()
        for i, w in enumerate(ids):
            part = torch.tensor(batch[cuts[i] : cuts[i + 1]])
            dist.send(torch.tensor([WORK, round_, len(part)]), w)
            dist.send(part, w)
            dist.send(flat, w)
        total = torch.zeros(flat.numel() + 1)
        for w in ids:
            got = torch.empty_like(total)
            dist.recv(got, w)
            total += got
        flat -= lr * total[:-1] / global_batch
        vector_to_parameters(flat, params)
        result.members.append(list(ids))
        result.losses.append(total[-1].item() / global_batch)
        for w in ids:
            if last_round[w] == round_:
                dist.send(torch.tensor([LEAVE, round_, 0]), w)
    result.state = {k: v.clone() for k, v in model.state_dict().items()}
    return result
