"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), readable at any world size
(chapter 3, idea 3; see :mod:`dmlbook.data_parallel.checkpoint`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.data_parallel.checkpoint.files import (
    fsync_directory,
    shape_mismatches,
)


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns on every call outside a process group (even with ``no_dist=True``); here that
    single-process use is deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_folder_atomically(directory: str | os.PathLike, state: dict, group=None) -> Path:
    """Collective: ``dcp.save`` of ``state`` to the folder ``directory``, all or nothing.

    DCP writes many files, so no single rename replaces them all: the ranks write a temporary
    folder beside it, and rank 0 renames the folder into place once DCP has written its
    ``.metadata`` (every rank's files are then complete). A save killed earlier left its
    temporary folder; rank 0 removes it first. Chapter 3's and chapter 13's checkpoints both
    save this way."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: costs ~1 s per rank

    directory = Path(directory)
    partial = directory.with_name(f".{directory.name}.partial")
    first = group_rank_size(group)[0] == 0
    if first:
        shutil.rmtree(partial, ignore_errors=True)  # what a save killed earlier left
    barrier(group)
    with quiet_dcp():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=group)
    if first:
        old = directory.with_name(f".{directory.name}.old")
        if directory.exists():  # a folder cannot be renamed over a non-empty one
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
        fsync_directory(directory.parent)  # the rename itself on disk
    barrier(group)
    return directory


def save_sharded(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    group=None,
) -> Path:
    """Collective: every rank writes its own shard with ``torch.distributed.checkpoint`` (ch. 3),
    all or nothing (:func:`save_folder_atomically`).
    Beware: to save an optimizer that has not stepped yet, ``get_state_dict`` creates its state
    by stepping it with zero gradients at lr 0, which for Adam counts as a step.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # Keyed by parameter name; a sharded model's tensors are DTensors that know their part.
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else [optimizer])
    state = {"model": model_state, "optimizer": optim_state}
    return save_folder_atomically(directory, state, group)


def load_sharded(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    group=None,
) -> None:
    """Collective: load a :func:`save_sharded` folder at any world size and any sharding.

    Each rank asks for the shards it holds *now*; DCP reads the overlapping pieces of the saved
    shards (resharding). A plain, unsharded model loads the whole tensors.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(
            f"no DCP checkpoint at {directory} (no .metadata: never saved, or the save did not end)"
        )
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    _check_sharded_fits(directory, saved, model, optimizer)
    optimizers = [] if optimizer is None else [optimizer]
    model_state, optim_state = get_state_dict(model, optimizers)  # this run's layout
    state = {"model": model_state} | ({} if optimizer is None else {"optimizer": optim_state})
    with quiet_dcp():
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), process_group=group)
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
    )


def _check_sharded_fits(directory: Path, saved: dict, model: nn.Module, optimizer) -> None:
    # DCP's metadata keys are flattened paths ("model.layers.0.weight"), sizes global shapes.
    theirs = {k: tuple(getattr(m, "size", ())) for k, m in saved.items() if k.startswith("model.")}
    ours = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}  # global too
    problems = shape_mismatches(theirs, ours)
    if optimizer is not None and not any(k.startswith("optimizer.") for k in saved):
        problems.append("no optimizer state was saved: load with optimizer=None")
    if problems:
        raise ValueError(f"{directory} does not fit this model:\n  " + "\n  ".join(problems))
