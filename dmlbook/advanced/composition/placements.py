"""Which slice of which tensor of the unmodified model a rank of a composed model holds, and how
``torch.distributed.checkpoint`` (DCP) is told (chapter 13): the pieces that
:mod:`~dmlbook.advanced.composition.checkpoint` saves and loads.

A checkpoint that moves between layouts names each tensor as the **unmodified model** does, with
its **global shape**, and each rank says which slice of it it holds. What each dimension of
:class:`~dmlbook.advanced.composition.layout.Layout` does to a tensor decides what a rank says:

* ``tp`` cuts a tensor: a rank holds one block along one dimension (:data:`TP_CUTS`, read from
  the layer types of :mod:`dmlbook.advanced.tensor_parallel`). DCP is given a ``DTensor`` with
  placement ``Shard(dim)`` over a one-dimensional ``DeviceMesh`` made from the TP group
  (:meth:`Piece.checkpointed`), which is all it needs to know the block's offset;
* ``pp`` chooses which tensors a rank holds (its stage's), and ``ep`` which experts (renumbered
  back to their global index); neither cuts a tensor;
* ``dp`` and ``cp`` copy tensors: the ranks of a ``dp x cp`` group hold the same slices, each
  copy reports the same slice, and DCP's planner keeps one writer per slice.

One exception to "the unmodified model's shape": attention's fused ``c_attn`` (q, k and v in
one weight, :data:`FUSED`) is stored as ``(3, C, C_in)``, because tensor parallelism gives a rank
its heads' block of *each* of q, k and v, which is one block of dimension 1 of that view and no
single block of the ``(3 C, C_in)`` weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmlbook.advanced.composition.compose import Composed
from dmlbook.advanced.composition.layout import Axis
from dmlbook.advanced.context_parallel.styles import (
    ContextParallelAttention,
    ContextParallelPositions,
)
from dmlbook.advanced.expert_parallel import ExpertParallelMoE
from dmlbook.advanced.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dmlbook.advanced.tensor_parallel.vocab_parallel import VocabParallelEmbedding

__all__ = ["Piece", "pieces", "tp_mesh"]

# How tensor parallelism cut each layer type: parameter name -> the dimension cut into tp blocks.
TP_CUTS: dict[type, dict[str, int]] = {
    ColumnParallelLinear: {"weight": 0, "bias": 0},  # a block of the outputs
    RowParallelLinear: {"weight": 1},  # a block of the inputs; the bias is whole on every rank
    VocabParallelEmbedding: {"weight": 0},  # a block of the vocabulary
}
# Fused weights, by module name: how many parts they hold (attention's q|k|v).
FUSED: dict[str, int] = {"c_attn": 3}


@dataclass(frozen=True)
class Piece:
    """One tensor of the unmodified model as this rank holds it."""

    name: str  # its name in the unmodified model: its key in the checkpoint
    tensor: torch.Tensor  # this rank's part: the parameter itself, not a copy
    dim: int | None = None  # the dimension tensor parallelism cut (None: whole here)
    parts: int = 1  # a fused weight's parts (q|k|v: 3), stored as (parts, rows / parts, ...)

    def stored(self, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor`` (default: the parameter), or a state tensor shaped like it, as stored: a
        fused weight viewed with its parts first (a view: loading into it fills the tensor)."""
        t = self.tensor if tensor is None else tensor
        return t if self.parts == 1 else t.view(self.parts, -1, *t.shape[1:])

    @property
    def split_dim(self) -> int | None:
        """The dimension of the stored view that tensor parallelism cut."""
        return None if self.dim is None else self.dim + (self.parts > 1)

    def checkpointed(self, tensor: torch.Tensor | None, mesh) -> torch.Tensor:
        """What DCP is given: the stored view, as a ``DTensor`` ``Shard(split_dim)`` over the TP
        ``mesh`` when tensor parallelism cut it (DCP reads the global shape and this rank's
        offset from it), else the plain tensor (a whole tensor, offset 0)."""
        from torch.distributed.tensor import DTensor, Shard

        view = self.stored(tensor)
        if self.dim is None or mesh is None:
            return view
        return DTensor.from_local(view, mesh, [Shard(self.split_dim)], run_check=False)

    def slice_at(self, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` of this rank's part in the stored global tensor, rank
        ``tp_rank`` of its TP group holding block ``tp_rank`` (what ``Shard`` tells DCP)."""
        sizes = tuple(self.stored().shape)
        offsets = [0] * len(sizes)
        if self.dim is not None:
            offsets[self.split_dim] = tp_rank * sizes[self.split_dim]
        return tuple(offsets), sizes


def pieces(composed: Composed) -> list[Piece]:
    """This rank's tensors of ``composed`` (its pipeline stage's), each under its name in the
    unmodified model: context parallelism's wrappers are looked through, expert parallelism's
    local experts numbered back to their global index, tensor parallelism's cuts read from
    :data:`TP_CUTS`."""
    held = {id(p) for p in composed.stage.parameters()}  # only this stage's layers
    found: list[Piece] = []

    def walk(module: nn.Module, path: str) -> None:
        if isinstance(module, ContextParallelPositions):  # wraps the position embedding
            return walk(module.embedding, path)
        if isinstance(module, ContextParallelAttention):  # wraps the attention
            return walk(module.inner, path)
        cuts = next((c for kind, c in TP_CUTS.items() if isinstance(module, kind)), {})
        parts = FUSED.get(path.rpartition(".")[2], 1)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in held:
                found.append(Piece(f"{path}.{name}".lstrip("."), p, cuts.get(name), parts))
        for name, child in module.named_children():
            if isinstance(module, ExpertParallelMoE) and name == "experts":
                first = module.expert_range[0]  # this rank's experts are first, first + 1, ...
                for i, expert in enumerate(child):
                    walk(expert, f"{path}.experts.{first + i}")
            else:
                walk(child, f"{path}.{name}".lstrip("."))

    walk(composed.model, "")
    return found


def tp_mesh(composed: Composed):
    """The TP group as a one-dimensional ``DeviceMesh`` (no new process group), or None
    without tensor parallelism: the only dimension that cuts a tensor."""
    groups = composed.groups
    if groups.layout.tp == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    device = next(composed.stage.parameters()).device.type
    return DeviceMesh.from_group(groups.tp, device, mesh_dim_names=(Axis.tp.value,))
