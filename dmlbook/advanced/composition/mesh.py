"""A device mesh: the ranks laid out as a grid, one process group per row and column (chapter 9).

Hybrid parallelism gives every rank several jobs at once. On a DP x TP mesh, rank r holds one
tensor-parallel shard of the model (its TP coordinate) for one slice of the batch (its DP
coordinate): the ranks of a *row* split a layer between them (Megatron), the ranks of a *column*
hold the same shard and average its gradients (data parallelism). Mesh-TensorFlow calls this the
batch x model mesh; torch calls it ``init_device_mesh``.

:func:`~dmlbook.advanced.composition.layout.mesh_groups` is the pure table: for each named
dimension, the lists of ranks that vary along it. :class:`DeviceMesh` creates those process
groups. ``dist.new_group`` is collective over the whole world (every rank must create every
group, in the same order, even the groups it is not in), so each rank creates all of them and
keeps the ones it belongs to. The last dimension varies
fastest: with ``("dp", "tp")`` the TP groups are neighbouring ranks, which on GPUs are the GPUs of
one machine, joined by NVLink, as Megatron-LM places them.

:func:`hybrid_step` is one training step on such a grid: forward and backward of the rank's
tensor-parallel shard (chapter 9's plan, communicating inside its TP group), then the gradients
averaged over its DP group, then the optimizer's step. :func:`train_hybrid` runs it on the
char-GPT of :mod:`dmlbook.models` on a :class:`DeviceMesh`, each rank on its DP share of every
batch, and averages the shares' losses over DP into the whole batch's. (Chapter 13's
:func:`~dmlbook.advanced.composition.compose.compose` builds the same thing with more
dimensions, and ZeRO-1 over DP.)
:func:`~dmlbook.data_parallel.loop.train_reference` (Adam, whole batches) is the single-process
run it equals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.composition.layout import mesh_groups
from dmlbook.advanced.composition.plan import tensor_parallel_char_gpt
from dmlbook.comm import gloo_thread
from dmlbook.comm.groups import local_rows
from dmlbook.models import CharGPT

__all__ = [
    "DeviceMesh",
    "TrainResult",
    "hybrid_step",
    "mesh_groups",
    "shard_of",
    "train_hybrid",
]


class DeviceMesh:
    """The ranks of the world as an n-D grid with named dimensions, and one process group per
    line of the grid along each dimension.

    ``mesh = DeviceMesh((2, 2), ("dp", "tp"))`` on 4 ranks; then ``mesh.group("tp")`` is this
    rank's TP group, ``mesh.coordinate`` its place, e.g. ``{"dp": 1, "tp": 0}``, and
    ``mesh.size("tp")`` the TP degree. Call it on every rank (group creation is collective).
    """

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str] = ("dp", "tp")) -> None:
        rank_lists = mesh_groups(shape, dim_names)  # dimension -> every group's ranks (checked)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if math.prod(shape) != world:
            raise ValueError(
                f"a mesh of shape {tuple(shape)} needs {math.prod(shape)} ranks, "
                f"but the world has {world}"
            )
        self.shape, self.dim_names, self.rank = tuple(shape), tuple(dim_names), rank
        self.rank_lists = rank_lists
        self.coordinate = self.coordinate_of(rank)
        self._groups = {}
        for name in dim_names:  # same order on every rank, as dist.new_group requires
            for ranks in self.rank_lists[name]:
                group = dist.new_group(ranks) if world > 1 else None
                if rank in ranks:
                    self._groups[name] = group
        gloo_thread.follow_env()  # the new groups' transport threads, as the world's

    def coordinate_of(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits on the mesh, e.g. ``{"dp": 1, "tp": 0}``."""
        if not 0 <= rank < math.prod(self.shape):
            raise ValueError(f"rank {rank} is not on a mesh of {math.prod(self.shape)} ranks")
        place = torch.unravel_index(torch.tensor(rank), self.shape)
        return dict(zip(self.dim_names, (int(i) for i in place), strict=True))

    def group(self, name: str):
        """This rank's process group along dimension ``name`` (None when the world is one rank)."""
        self._check_name(name)
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group along ``name``, in group-rank order."""
        self._check_name(name)
        return next(g for g in self.rank_lists[name] if self.rank in g)

    def size(self, name: str) -> int:
        self._check_name(name)
        return self.shape[self.dim_names.index(name)]

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along ``name`` (its rank inside that group)."""
        self._check_name(name)
        return self.coordinate[name]

    def _check_name(self, name: str) -> None:
        if name not in self.dim_names:
            raise ValueError(f"no mesh dimension {name!r}; this mesh has {self.dim_names}")

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        return f"DeviceMesh({dims}; rank {self.rank} at {self.coordinate})"


# --------------------------------------------------------------------------- 2-D training


@dataclass
class TrainResult:
    losses: list[float]  # the global batch's mean loss at each step
    model: nn.Module  # the trained model (this rank's shard for train_hybrid)


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
    mesh: DeviceMesh,
    lr: float = 1e-2,
) -> TrainResult:
    """DP x TP training on ``mesh = DeviceMesh((dp, tp), ("dp", "tp"))``: every rank builds the
    whole model from the same seed, keeps its TP shard (chapter 9's plan) and runs
    :func:`hybrid_step` with Adam on its DP share of each batch. Returns the whole batch's mean
    loss per step and this rank's shard."""
    tp_group, dp_group, dp = mesh.group("tp"), mesh.group("dp"), mesh.size("dp")
    model = tensor_parallel_char_gpt(make_model(), group=tp_group)  # this rank's TP shard
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        mine = local_rows(tuple(batch), dp_group)  # rows [d B/dp, (d+1) B/dp) at DP coordinate d
        losses.append(hybrid_step(model, mine, optimizer, dp_group))
    losses = torch.tensor(losses, dtype=torch.float64)  # the mean loss of my DP share, per step
    if dp > 1:  # communication: the mean of the DP shares' equal-sized means = the batch's mean
        dist.all_reduce(losses, group=dp_group)
        losses /= dp
    return TrainResult(losses.tolist(), model)


def shard_of(model: CharGPT, mesh: DeviceMesh) -> nn.Module:
    """This rank's TP shard of an unsplit model (to compare a hybrid run with the reference)."""
    return tensor_parallel_char_gpt(model, group=mesh.group("tp"))
