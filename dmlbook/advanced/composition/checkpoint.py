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
decides what a rank reports (:mod:`~dmlbook.advanced.composition.placements`: ``tp`` cuts, as a
``DTensor`` ``Shard(dim)``; ``pp`` and ``ep`` choose; ``dp`` and ``cp`` copy). ZeRO-1 shards the
optimizer state by whole parameters over ``dp x cp``: the owner of a parameter saves its Adam
moments, cut like the parameter (same shape, same placement); on load each rank of the new
layout reads the moments of the parameters it owns now.

:func:`save_composed` writes to a temporary folder, and rank 0 renames it into place once DCP
has written its ``.metadata``, so the final path never holds a half-written checkpoint.
:func:`load_composed` first compares, on every rank, the whole model's keys and global shapes
(one all-gather) with the checkpoint's, so a checkpoint of another model raises the same
``ValueError``, naming the key and both shapes, on every rank, and returns the reads DCP planned
for the rank (:class:`Read`: which saved slice, from which rank's file). :func:`train_and_save`
and :func:`load_and_train` are the rank functions chapter 13 and the tests move a run with.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.composition.compose import Composed, compose
from dmlbook.advanced.composition.layout import Axis, Layout, ProcessGroups
from dmlbook.advanced.composition.placements import pieces, tp_mesh
from dmlbook.advanced.composition.training import compare_with_reference, composed_step, cut_batch
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward
from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel.checkpoint.sharded import quiet_dcp, save_folder_atomically
from dmlbook.model_parallel.pipeline import PipelineStage
from dmlbook.models import Batch

__all__ = [
    "Read",
    "SavedSlice",
    "checkpoint_state",
    "load_and_train",
    "load_composed",
    "save_composed",
    "saved_slices",
    "train_and_save",
]

Slice = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a tensor's stored shape


class SavedSlice(NamedTuple):
    """One slice a checkpoint holds, as DCP's metadata lists it."""

    offsets: tuple[int, ...]  # where it starts in the stored global tensor
    sizes: tuple[int, ...]
    writer: int  # the rank whose file holds it (one writer per slice, however many copies)


class Read(NamedTuple):
    """One read DCP planned for a loading rank: part or all of one saved slice."""

    key: str  # e.g. "model.blocks.0.mlp.c_fc.weight"
    saved: tuple[int, ...]  # the saved slice it comes from, by its offsets (a SavedSlice's)
    writer: int  # the rank whose file holds that slice: the rank that saved it


def writer_of(file: str) -> int:
    """The saving rank of a DCP file: ``FileSystemWriter`` names rank r's files ``__r_n.distcp``,
    r being the rank in the group that saved (here the whole world: every save is a job's)."""
    return int(file.split("_")[2])


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


def held_slices(composed: Composed) -> dict[str, Slice]:
    """The slice of each tensor this rank holds, by its name in the unmodified model."""
    tp_rank = composed.groups.coords[Axis.tp]
    return {p.name: p.slice_at(tp_rank) for p in pieces(composed)}


def save_composed(composed: Composed, directory: str | os.PathLike) -> Path:
    """Collective (every rank of the world): save ``composed``'s model and ZeRO-1 optimizer
    state to the folder ``directory`` with DCP, readable at any layout (see the module). The
    ranks write a temporary folder beside it, which rank 0 renames into place at the end
    (:func:`~dmlbook.data_parallel.checkpoint.sharded.save_folder_atomically`, as chapter 3's
    checkpoints do)."""
    return save_folder_atomically(directory, checkpoint_state(composed))


def load_composed(composed: Composed, directory: str | os.PathLike) -> list[Read]:
    """Collective: load a :func:`save_composed` folder, saved at any layout, into ``composed``
    at its own layout: each rank reads the slices it holds now, and the state of the parameters
    it owns now under ZeRO-1. A checkpoint of another model (a key missing or extra, a global
    shape that differs) raises the same ``ValueError`` on every rank before anything is read.
    Returns the reads DCP planned for this rank: its record of which saved slices it read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Recording(DefaultLoadPlanner):  # DCP's own planner, keeping this rank's final plan
        def finish_plan(self, new_plan):
            self.plan = super().finish_plan(new_plan)
            return self.plan

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(
            f"no checkpoint at {directory} (no DCP .metadata: never saved, or the save did not end)"
        )
    metadata = dcp.FileSystemReader(directory).read_metadata()
    saved = metadata.state_dict_metadata
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
    planner = Recording()
    with quiet_dcp():  # DCP warns in one process (no group): that is meant here
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=planner)
    files = metadata.storage_data  # saved slice -> the file that holds it
    return [
        Read(i.storage_index.fqn, tuple(i.storage_index.offset),
             writer_of(files[i.storage_index].relative_path))
        for i in planner.plan.items
    ]  # fmt: skip


def saved_slices(directory: str | os.PathLike, key: str) -> list[SavedSlice]:
    """The slices of ``key`` (e.g. ``"model.wte.weight"``) that a checkpoint holds, as DCP's
    metadata lists them, one per slice written: offsets and sizes in the stored shape, and the
    rank whose file holds it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = dcp.FileSystemReader(Path(directory)).read_metadata()
    if key not in metadata.state_dict_metadata:
        raise KeyError(f"no {key!r} in the checkpoint at {directory}")
    return [
        SavedSlice(tuple(c.offsets), tuple(c.sizes),
              writer_of(metadata.storage_data[MetadataIndex(key, c.offsets)].relative_path))
        for c in metadata.state_dict_metadata[key].chunks
    ]  # fmt: skip


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
    slices: dict[str, Slice] = field(default_factory=dict)  # each tensor's slice held here
    reads: list[Read] = field(default_factory=list)  # the saved slices it read them from


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
) -> dict[str, Slice]:
    """Rank function: train ``make_model()`` composed at ``layout`` (AdamW, ZeRO-1) on
    ``batches``, one composed step each, then :func:`save_composed` it to ``directory``.
    Returns the slices this rank held (:func:`held_slices`)."""
    composed, pipeline = _composed(make_model, batches, layout, microbatches, lr, group_cache)
    _train(composed, pipeline, batches, microbatches)
    save_composed(composed, directory)
    return held_slices(composed)


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
    reads = load_composed(composed, directory)
    _train(composed, pipeline, batches, microbatches)
    max_diff = None
    if reference_state is not None:
        reference = make_model()
        reference.load_state_dict(reference_state)
        max_diff = compare_with_reference(composed.stage, reference, composed.groups)
    rank = group_rank_size()[0]
    return Resumed(rank, composed.groups.coords, max_diff, held_slices(composed), reads)
