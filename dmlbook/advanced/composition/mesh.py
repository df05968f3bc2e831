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

:func:`train_hybrid` trains the char-GPT of :mod:`dmlbook.models` on such a grid, a
``Layout(dp=..., tp=...)``, parallelised by the one
:func:`~dmlbook.advanced.composition.compose.compose`: chapter 9's tensor-parallel plan inside
each TP group, the batch split over the DP groups, gradients averaged over DP and the optimizer
state sharded over it (ZeRO-1, chapter 9b; the update is plain Adam's, elementwise).
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

from dmlbook.advanced.composition.compose import compose
from dmlbook.advanced.composition.layout import ProcessGroups, _check_shape, mesh_groups
from dmlbook.advanced.composition.plan import CHAR_GPT_PLAN, tensor_parallel_char_gpt
from dmlbook.comm import gloo_thread
from dmlbook.comm.groups import local_rows
from dmlbook.data_parallel.loop import ForwardBackward, train_loop
from dmlbook.models import Batch, CharGPT

__all__ = [
    "DeviceMesh",
    "TrainResult",
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
        _check_shape(shape, dim_names)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if math.prod(shape) != world:
            raise ValueError(
                f"a mesh of shape {tuple(shape)} needs {math.prod(shape)} ranks, "
                f"but the world has {world}"
            )
        self.shape, self.dim_names, self.rank = tuple(shape), tuple(dim_names), rank
        self.rank_lists = mesh_groups(shape, dim_names)  # dimension -> every group's ranks
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


def train_hybrid(
    make_model: Callable[[], CharGPT],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    groups: ProcessGroups,
    lr: float = 1e-2,
) -> TrainResult:
    """DP x TP training on ``groups = ProcessGroups(Layout(dp=..., tp=...))``: every rank builds
    the whole model from the same seed, :func:`~dmlbook.advanced.composition.compose.compose`
    keeps its TP shard (chapter 9's plan) and shards Adam's state over its DP group; each rank
    trains on its DP slice of each batch. Returns the global loss per step and this rank's
    shard."""
    layout = groups.layout
    if (layout.pp, layout.cp, layout.ep) != (1, 1, 1):
        raise ValueError(f"train_hybrid is DP x TP; layout {layout} has pp, cp or ep > 1")
    composed = compose(make_model(), groups, CHAR_GPT_PLAN, torch.optim.Adam, lr=lr)
    plan = [local_rows(Batch(idx, targets), groups.dp) for idx, targets in batches]  # my rows
    # The one training loop: the composed model brings its own loss (on the split logits), the
    # sync averages gradients over the DP group, and ``composed`` steps as ZeRO-1's optimizer.
    state = train_loop(composed.model, composed, None, None, plan, sync=composed.sync,
                       group=groups.dp, forward_backward=ForwardBackward(loss_fn=None))  # fmt: skip
    losses = torch.tensor(state.losses, dtype=torch.float64)  # this rank's, per step
    if layout.dp > 1:
        dist.all_reduce(losses, group=groups.dp)  # communication: the global loss, for the curve
        losses /= layout.dp
    return TrainResult(losses.tolist(), composed.model)


def shard_of(model: CharGPT, groups: ProcessGroups) -> nn.Module:
    """This rank's TP shard of an unsplit model (to compare a hybrid run with the reference)."""
    return tensor_parallel_char_gpt(model, group=groups.tp)
