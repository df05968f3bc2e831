"""A device mesh: the ranks laid out as a grid, one process group per row and column (chapter 9).

Hybrid parallelism gives every rank several jobs at once. On a DP x TP mesh, rank r holds one
tensor-parallel shard of the model (its TP coordinate) for one slice of the batch (its DP
coordinate): the ranks of a *row* split a layer between them (Megatron), the ranks of a *column*
hold the same shard and average its gradients (data parallelism). Mesh-TensorFlow calls this the
batch x model mesh; torch calls it ``init_device_mesh``.

:func:`mesh_groups` is the pure layout: for each named dimension, the lists of ranks that vary
along it. :class:`DeviceMesh` creates those process groups. ``dist.new_group`` is collective over
the whole world (every rank must create every group, in the same order, even the groups it is not
in), so each rank creates all of them and keeps the ones it belongs to. The last dimension varies
fastest: with ``("dp", "tp")`` the TP groups are neighbouring ranks, which on GPUs are the GPUs of
one machine, joined by NVLink, as Megatron-LM places them.

:func:`train_hybrid` trains the char-GPT of :mod:`dmlbook.models` on such a mesh, parallelised by
:func:`dmlbook.advanced.parallelize.parallelize`: the tensor-parallel plan inside each TP group,
the batch split over the DP groups, gradients averaged over DP by chapter 3's bucketed DDP.
:func:`train_reference` is the single-process run it equals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.parallelize import CHAR_GPT_PLAN, parallelize, tensor_parallel_char_gpt
from dmlbook.data_parallel.loop import train_reference as _reference_loop
from dmlbook.models import CharGPT

__all__ = [
    "DeviceMesh",
    "TrainResult",
    "mesh_groups",
    "shard_of",
    "train_hybrid",
    "train_reference",
]


def _check_shape(shape: Sequence[int], dim_names: Sequence[str]) -> None:
    if len(shape) != len(dim_names):
        raise ValueError(
            f"mesh shape {tuple(shape)} has {len(shape)} dimensions but the names "
            f"{tuple(dim_names)} are {len(dim_names)}"
        )
    if len(set(dim_names)) != len(dim_names):
        raise ValueError(f"mesh dimension names must differ, got {tuple(dim_names)}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh sizes must be integers >= 1, got {tuple(shape)}")


def mesh_groups(
    shape: Sequence[int], dim_names: Sequence[str] = ("dp", "tp")
) -> dict[str, list[list[int]]]:
    """For each dimension, the groups of ranks that differ only in that coordinate.

    ``mesh_groups((2, 2))`` is ``{"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}``: rank
    ``r`` sits at ``(r // 2, r % 2)`` (row-major, the last dimension fastest).
    """
    _check_shape(shape, dim_names)
    grid = torch.arange(math.prod(shape)).reshape(tuple(shape))
    groups = {}
    for d, name in enumerate(dim_names):
        moved = grid.movedim(d, -1).reshape(-1, shape[d])  # one row per group along dimension d
        groups[name] = [row.tolist() for row in moved]
    return groups


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
        self.layout = mesh_groups(shape, dim_names)
        self.coordinate = self.coordinate_of(rank)
        self._groups = {}
        for name in dim_names:  # same order on every rank, as dist.new_group requires
            for ranks in self.layout[name]:
                group = dist.new_group(ranks) if world > 1 else None
                if rank in ranks:
                    self._groups[name] = group

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
        return next(g for g in self.layout[name] if self.rank in g)

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


def train_reference(
    make_model: Callable[[], CharGPT],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-2,
) -> TrainResult:
    """Single-process training: Adam on each whole batch, the run :func:`train_hybrid` equals."""
    done = _reference_loop(make_model, batches, optimizer=torch.optim.Adam, lr=lr)
    return TrainResult(done.losses, done.model)


def train_hybrid(
    make_model: Callable[[], CharGPT],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    mesh: DeviceMesh,
    lr: float = 1e-2,
) -> TrainResult:
    """DP x TP training on ``mesh`` (dimensions "dp" and "tp"): every rank builds the whole model
    from the same seed and :func:`~dmlbook.advanced.parallelize.parallelize` keeps its TP shard and
    averages its gradients over its DP group; each rank trains on its DP slice of each batch.
    Returns the global loss per step and this rank's shard."""
    dp_rank, dp_size = mesh.local_rank("dp"), mesh.size("dp")
    model = parallelize(make_model(), mesh, CHAR_GPT_PLAN)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step, (idx, targets) in enumerate(batches):
        if len(idx) % dp_size:
            raise ValueError(
                f"batch {step} has {len(idx)} sequences, not divisible by the DP size {dp_size}"
            )
        rows = slice(dp_rank * len(idx) // dp_size, (dp_rank + 1) * len(idx) // dp_size)
        optimizer.zero_grad()
        _, loss = model(idx[rows], targets[rows])
        loss.backward()  # compute, and the DP all-reduces overlapped with it
        global_loss = loss.detach().reshape(1)
        if dp_size > 1:
            dist.all_reduce(global_loss, group=mesh.group("dp"))  # communication: for the curve
            global_loss /= dp_size
        losses.append(global_loss.item())
        optimizer.step()
    return TrainResult(losses, getattr(model, "module", model))  # the shard, without DDP


def shard_of(model: CharGPT, mesh: DeviceMesh) -> nn.Module:
    """This rank's TP shard of an unsplit model (to compare a hybrid run with the reference)."""
    return tensor_parallel_char_gpt(model, group=mesh.group("tp"))
