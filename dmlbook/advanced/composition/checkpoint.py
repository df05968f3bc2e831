"""Checkpoints that move between layouts: chapter 13's composed model and its ZeRO-1 optimizer
state saved through ``torch.distributed.checkpoint`` (DCP) at one layout and loaded at another
(chapter 13).

A real job is resumed on the machines it has now, not on the ones it had: fewer hosts, another
TP degree, another number of stages. So a checkpoint must not be a picture of one layout. Here
each tensor is saved under **its name in the unmodified model** with **its global shape**, and
each rank says which slice of it it holds; DCP writes the slices and, on load, gives every rank
of the new layout the slices it asks for, read from whichever saved pieces overlap them (DCP's
resharding; chapter 3 loads a data-parallel checkpoint at another world size the same way,
:mod:`dmlbook.data_parallel.checkpoint.sharded`).

What each dimension of :class:`~dmlbook.advanced.composition.layout.Layout` does to a tensor
decides what a rank reports:

* ``tp`` cuts a tensor: a rank holds one block along one dimension (:data:`TP_CUTS`, read from
  the layer types of :mod:`dmlbook.advanced.tensor_parallel`). It is saved as a ``DTensor`` with
  placement ``Shard(dim)`` over a one-dimensional ``DeviceMesh`` made from the TP group, which
  is all DCP needs to know the block's offset in the global tensor;
* ``pp`` chooses which tensors a rank holds (its stage's), and ``ep`` which experts (renumbered
  back to their global index); neither cuts a tensor;
* ``dp`` and ``cp`` copy tensors: the ranks of a ``dp x cp`` group hold the same slices. Each
  copy reports the same slice, and DCP's planner keeps one writer per slice;
* ZeRO-1 shards the optimizer state by whole parameters over ``dp x cp``: the owner of a
  parameter saves its Adam moments, cut like the parameter (same shape, same placement); on
  load each rank of the new layout reads the moments of the parameters it owns now.

One exception to "the unmodified model's shape": attention's fused ``c_attn`` (q, k and v in
one weight, :data:`FUSED`) is stored as ``(3, C, C_in)``, because tensor parallelism gives a rank
its heads' block of *each* of q, k and v, which is one block of dimension 1 of that view and no
single block of the ``(3 C, C_in)`` weight.

:func:`save_composed` writes to a temporary folder, and rank 0 renames it into place once DCP
has written its ``.metadata``, so the final path never holds a half-written checkpoint.
:func:`load_composed` first compares, on every rank, the whole model's keys and global shapes
(one all-gather) with the checkpoint's, so a checkpoint of another model raises the same
``ValueError``, naming the key and both shapes, on every rank. :func:`train_and_save` and
:func:`load_and_train` are the rank functions chapter 13 and the tests move a run with.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.composition.compose import Composed, compose
from dmlbook.advanced.composition.layout import Axis, Layout, ProcessGroups
from dmlbook.advanced.composition.training import compare_with_reference, composed_step, cut_batch
from dmlbook.advanced.context_parallel.styles import (
    ContextParallelAttention,
    ContextParallelPositions,
)
from dmlbook.advanced.expert_parallel import ExpertParallelMoE
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward
from dmlbook.advanced.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dmlbook.advanced.tensor_parallel.vocab_parallel import VocabParallelEmbedding
from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel.checkpoint.sharded import quiet_dcp, save_folder_atomically
from dmlbook.model_parallel.pipeline import PipelineStage
from dmlbook.models import Batch

__all__ = [
    "checkpoint_state",
    "load_and_train",
    "load_composed",
    "pieces",
    "save_composed",
    "saved_chunks",
    "train_and_save",
]

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


def checkpoint_state(composed: Composed) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint, as DCP takes it: ``model.<name>`` for each tensor it
    holds, and ``optimizer.state.<name>.<key>`` for the optimizer state of each parameter it
    owns under ZeRO-1 (a state tensor shaped like its parameter is cut like it; one that is
    not, such as Adam's ``step``, is whole). The tensors are this rank's own (views, not
    copies): DCP saves from them and loads into them."""
    mesh = tp_mesh(composed)
    held = pieces(composed)
    state = {f"model.{p.name}": p.checkpointed(p.tensor.detach(), mesh) for p in held}
    by_param = {id(p.tensor): p for p in held}
    for optimizer in composed.optimizers:  # dense over dp_cp, experts over edp
        for param, values in optimizer.state.items():  # the parameters this rank owns
            piece = by_param[id(param)]
            for key, value in values.items():
                cut = torch.is_tensor(value) and value.shape == param.shape
                state[f"optimizer.state.{piece.name}.{key}"] = (
                    piece.checkpointed(value, mesh) if cut else value
                )
    return state


def save_composed(composed: Composed, directory: str | os.PathLike) -> Path:
    """Collective (every rank of the world): save ``composed``'s model and ZeRO-1 optimizer
    state to the folder ``directory`` with DCP, readable at any layout (see the module). The
    ranks write a temporary folder beside it, which rank 0 renames into place at the end
    (:func:`~dmlbook.data_parallel.checkpoint.sharded.save_folder_atomically`, as chapter 3's
    checkpoints do)."""
    return save_folder_atomically(directory, checkpoint_state(composed))


def load_composed(composed: Composed, directory: str | os.PathLike) -> None:
    """Collective: load a :func:`save_composed` folder, saved at any layout, into ``composed``
    at its own layout: each rank reads the slices it holds now, and the state of the parameters
    it owns now under ZeRO-1. A checkpoint of another model (a key missing or extra, a global
    shape that differs) raises the same ``ValueError`` on every rank before anything is read."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(
            f"no checkpoint at {directory} (no DCP .metadata: never saved, or the save did not end)"
        )
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    mesh = tp_mesh(composed)
    held = pieces(composed)
    state = {f"model.{p.name}": p.checkpointed(p.tensor.detach(), mesh) for p in held}
    check_fits(directory, saved, state, bool(composed.optimizers))
    by_param = {id(p.tensor): p for p in held}
    for optimizer in composed.optimizers:
        for param in optimizer.partition[optimizer.rank]:  # the parameters this rank owns now
            piece = by_param[id(param)]
            optimizer.state[param] = values = {}  # filled in place by the load below
            prefix = f"optimizer.state.{piece.name}."
            for key in [k for k in saved if k.startswith(prefix)]:  # Adam: step, exp_avg, ...
                meta, name = saved[key], key.removeprefix(prefix)
                if tuple(meta.size) == state[f"model.{piece.name}"].shape:  # cut like param
                    values[name] = torch.empty_like(param)
                    state[key] = piece.checkpointed(values[name], mesh)
                else:  # whole: a scalar step
                    values[name] = state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with quiet_dcp():  # DCP warns in one process (no group): that is meant here
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))


def saved_chunks(directory: str | os.PathLike, key: str) -> list[tuple[tuple[int, ...], ...]]:
    """The slices of ``key`` (e.g. ``"model.wte.weight"``) that a checkpoint holds, as DCP's
    metadata lists them: ``(offsets, sizes)`` in the stored shape, one per slice written."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(Path(directory)).read_metadata().state_dict_metadata
    if key not in meta:
        raise KeyError(f"no {key!r} in the checkpoint at {directory}")
    return [(tuple(c.offsets), tuple(c.sizes)) for c in meta[key].chunks]


def check_fits(directory: Path, saved: dict, state: dict, optimizer: bool) -> None:
    """The whole model's keys and global shapes (every rank's, by one all-gather) against the
    checkpoint's: every rank reaches the same verdict, so none waits in DCP for one that
    raised."""
    mine = {k: tuple(v.shape) for k, v in state.items()}  # a DTensor's shape is the global one
    everyone = [mine]
    if group_rank_size()[1] > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # communication
    ours = {k: v for shapes in everyone for k, v in shapes.items()}
    theirs = {k: tuple(m.size) for k, m in saved.items() if k.startswith("model.")}
    problems = [
        f"{key}: saved {theirs[key]}, this model {ours[key]}"
        for key in ours  # in the model's order
        if key in theirs and ours[key] != theirs[key]
    ]
    problems += [f"{key}: not in the checkpoint" for key in ours if key not in theirs]
    problems += [f"{key}: not in this model" for key in sorted(theirs.keys() - ours.keys())]
    if optimizer and not any(k.startswith("optimizer.") for k in saved):
        problems.append("no optimizer state was saved, but this model has an optimizer")
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValueError(
            f"the checkpoint {directory} does not fit this model:\n  "
            + "\n  ".join(problems[:8])
            + more
        )


# --------------------------------------------------------------------------- moving a run


@dataclass
class Resumed:
    """What a rank of :func:`load_and_train` returns."""

    rank: int
    coords: dict[Axis, int]
    max_diff: float | None  # against the reference's slice, when one was given
    slices: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # each tensor this rank read: (offsets, sizes) in its stored shape


def _composed(make_model, batches, layout, microbatches, lr, group_cache):
    """``make_model()`` composed at ``layout`` with AdamW ZeRO-1, and its pipeline stage."""
    groups = ProcessGroups(layout, group_cache)
    model = make_model()
    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    rows, seq = batches[0][0].shape
    layout.validate_model(
        model.config, seq, rows, microbatches, max((len(m.experts) for m in moes), default=0)
    )
    composed = compose(model, groups, None, torch.optim.AdamW, lr=lr)
    pipeline = PipelineStage(composed.stage, groups.coords[Axis.pp], layout.pp, groups.pp,
                             device="cpu")  # fmt: skip
    return composed, pipeline


def _train(composed: Composed, pipeline: PipelineStage, batches, microbatches: int) -> None:
    layout, coords = composed.groups.layout, composed.groups.coords
    for batch in batches:
        composed_step(composed, pipeline, cut_batch(batch, layout, coords), microbatches)


def train_and_save(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    layout: Layout,
    directory: str | os.PathLike,
    microbatches: int = 1,
    lr: float = 1e-2,
    group_cache: dict | None = None,
) -> None:
    """Rank function: train ``make_model()`` composed at ``layout`` (AdamW, ZeRO-1) on
    ``batches``, one composed step each, then :func:`save_composed` it to ``directory``."""
    composed, pipeline = _composed(make_model, batches, layout, microbatches, lr, group_cache)
    _train(composed, pipeline, batches, microbatches)
    save_composed(composed, directory)


def load_and_train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Batch],
    layout: Layout,
    directory: str | os.PathLike,
    microbatches: int = 1,
    lr: float = 1e-2,
    reference_state: dict | None = None,
    group_cache: dict | None = None,
) -> Resumed:
    """Rank function (or one process, with ``Layout()``): a fresh ``make_model()`` composed at
    ``layout`` loads ``directory`` (:func:`load_composed`), then trains on ``batches``.
    ``reference_state``: the state dict of the one-process run that never stopped, to compare
    each parameter this rank holds with (``max_diff``)."""
    composed, pipeline = _composed(make_model, batches, layout, microbatches, lr, group_cache)
    load_composed(composed, directory)
    _train(composed, pipeline, batches, microbatches)
    max_diff = None
    if reference_state is not None:
        reference = make_model()
        reference.load_state_dict(reference_state)
        max_diff = compare_with_reference(composed.stage, reference, composed.groups)
    tp_rank = composed.groups.coords[Axis.tp]
    slices = {}
    for p in pieces(composed):
        sizes = tuple(p.stored().shape)
        offsets = [0] * len(sizes)
        if p.dim is not None:
            offsets[p.split_dim] = tp_rank * sizes[p.split_dim]
        slices[p.name] = (tuple(offsets), sizes)
    rank = group_rank_size()[0]
    return Resumed(rank, composed.groups.coords, max_diff, slices)
