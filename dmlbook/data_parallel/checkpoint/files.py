"""Checkpoint files: all or nothing, with every rank's random state (chapter 3, ideas 1 and 2).

:func:`atomic_save` writes, flushes, fsyncs and renames; :func:`save` is collective (rank 0
writes the model, the optimizer, the progress and every rank's RNG state); :func:`load` restores
them on every rank. See :mod:`dmlbook.data_parallel.checkpoint`.
"""

from __future__ import annotations

import os
import random
import re
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.comm.groups import barrier, device, group_rank_size
from dmlbook.runtime.owners import Owner

FORMAT = "dmlbook.data_parallel.checkpoint/1"


_NAME = re.compile(r"step-(\d+)\.pt")  # checkpoint_path's names; temporaries start with a dot
# atomic_save's temporaries: ".<name>.<writer pid>-<its start time>@<host>.<8 hex>.tmp"
_TEMPORARY = re.compile(r"\.(.*)\.(\d+-\d+@[A-Za-z0-9._-]+)\.[0-9a-f]{8}\.tmp")


@dataclass(frozen=True)
class Progress:
    """Where training stands: the next batch is batch ``step_in_epoch`` of epoch ``epoch``."""

    epoch: int = 0  # the epoch being trained: the sampler's set_epoch value
    step_in_epoch: int = 0  # batches of this epoch already done
    step: int = 0  # optimizer steps since training began (the global step)


@dataclass
class Checkpoint:
    """What :func:`load` restored besides the model and optimizer."""

    progress: Progress
    extra: dict  # the caller's own values (learning-rate schedule, best accuracy, ...)
    world_size: int  # how many ranks saved it
    rng_restored: bool  # whether this rank's RNG state came from the checkpoint


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)``, all or nothing: a crash leaves the old file or the new one.

    It first removes what killed saves left beside ``path`` (:func:`remove_killed_saves`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_killed_saves(path.parent)
    # 1. A temporary file in the SAME directory: a rename is atomic only within one filesystem.
    #    The leading dot keeps it out of latest()'s sight if we die before the rename; the
    #    writer's identity in its name lets a later save tell a killed save's file from a live one.
    tmp = path.with_name(f".{path.name}.{Owner.me().token()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()  # Python's buffer -> the kernel's page cache
            os.fsync(f.fileno())  # the page cache -> the disk
        os.replace(tmp, path)  # 2. readers now see the new file, before they saw the old one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # 3. the rename is an entry in the directory: make it durable
    return path


def remove_killed_saves(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of saves killed mid-write in ``directory``; return them.

    A killed save cannot clean up after itself (SIGKILL runs no handler), so its temporary file
    would stay for ever. Each name carries its writer (pid, start time, host): only files whose
    writer on this host is dead are removed, never one that a live save, in this process or
    another, is still writing, and never one written from another host.
    """
    removed = []
    for entry in os.scandir(directory):
        m = _TEMPORARY.fullmatch(entry.name)
        writer = Owner.parse(m[2]) if m else None
        if writer is not None and writer.is_dead():
            Path(entry.path).unlink(missing_ok=True)  # another save may remove it first
            removed.append(Path(entry.path))
    return removed


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename into it) durable: fsync the directory."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """Where :func:`train_resumable` keeps the checkpoint of global step ``step``."""
    return Path(directory) / f"step-{step:08d}.pt"


def latest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint of the highest step in ``directory``; None if there is none (or no folder)."""
    directory = Path(directory)
    found = [p for p in directory.glob("step-*.pt") if _NAME.fullmatch(p.name)]
    return max(found, key=lambda p: int(_NAME.fullmatch(p.name)[1]), default=None)


def _rng_state(cuda: bool) -> dict[str, torch.Tensor]:
    """This process's RNG states as fixed-size tensors (same shapes on every rank, to gather)."""
    version, mt, gauss = random.getstate()  # (3, 625 ints, None or a cached float)
    _, keys, pos, has_gauss, cached = np.random.get_state()  # ("MT19937", 624 uint32, ...)
    state = {
        "torch": torch.get_rng_state(),  # uint8 (5056,)
        "python": torch.tensor([version, *mt], dtype=torch.int64),  # (626,)
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([pos, has_gauss, *keys.tolist()], dtype=torch.int64),  # (626,)
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    version, *mt = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((version, tuple(mt), gauss if has_gauss else None))
    pos, has_gauss, *keys = state["numpy"].tolist()
    keys = np.array(keys, dtype=np.uint32)
    np.random.set_state(("MT19937", keys, pos, has_gauss, state["numpy_gauss"].item()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_rng_states(group=None) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's RNG state, on rank 0 of ``group`` (None elsewhere): one gather per tensor."""
    rank, world = group_rank_size(group)
    # CUDA's generator matters where the rank computes on a GPU. Every rank must agree (same
    # tensors to gather), so in a group that is "the backend is NCCL"; alone, "CUDA is in use".
    mine = _rng_state(device().type == "cuda" if world > 1 else torch.cuda.is_initialized())
    if world == 1:
        return [mine]
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name in sorted(mine):  # the same order on every rank
        t = mine[name].to(device())  # NCCL only moves GPU tensors
        bucket = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
        dist.gather(t, bucket, group=group, group_dst=0)  # communication
        for r, got in enumerate(bucket or []):
            states[r][name] = got.cpu()
    return states if rank == 0 else None


def _check_plain(value: Any, where: str) -> None:
    """Refuse at save time what ``torch.load(weights_only=True)`` would refuse at load time."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, torch.Tensor | int | float | str | bool | type(None)):
        raise TypeError(
            f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, numbers, "
            "strings and lists/tuples/dicts of them, so that loading it cannot run code"
        )


def save(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    extra: dict | None = None,
    group=None,
) -> Path:
    """Collective (chapter 3): every rank's RNG state goes to rank 0, which writes ``path``."""
    extra = {} if extra is None else extra
    _check_plain(extra, "extra")
    rank, world = group_rank_size(group)
    rng = _gather_rng_states(group)  # before anything else can draw a random number
    if rank == 0:
        checkpoint = dict(
            format=FORMAT,
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            progress=asdict(progress),
            world_size=world,
            rng=rng,
            extra=extra,
        )
        atomic_save(checkpoint, path)
    barrier(group)  # nobody moves on (or crashes) before the checkpoint is on disk
    return Path(path)


def _read(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}" + ("" if path.parent.is_dir() else " (no such folder)")
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint: {e}") from e
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a {FORMAT} file (written by "
            "dmlbook.data_parallel.checkpoint.save); for a bare "
            "state_dict use model.load_state_dict(torch.load(path, weights_only=True))"
        )
    return checkpoint


def shape_mismatches(saved: dict[str, tuple], ours: dict[str, tuple]) -> list[str]:
    """What differs between two {name: shape} tables, one line per kind of difference."""
    problems = []
    if missing := sorted(ours.keys() - saved.keys()):
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected := sorted(saved.keys() - ours.keys()):
        problems.append(f"in the checkpoint but not in the model: {unexpected}")
    for k in sorted(ours.keys() & saved.keys()):
        if saved[k] != ours[k]:
            problems.append(f"{k}: {saved[k]} saved, {ours[k]} here")
    return problems


def _check_fits(path: Path, checkpoint: dict, model: nn.Module, optimizer) -> None:
    """Name every mismatch before anything is modified, so a failed load changes nothing."""
    saved = {k: tuple(v.shape) for k, v in checkpoint["model"].items()}
    problems = shape_mismatches(saved, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    if optimizer is not None:
        sizes = [len(g["params"]) for g in checkpoint["optimizer"]["param_groups"]]
        here = [len(g["params"]) for g in optimizer.param_groups]
        if sizes != here:
            problems.append(f"optimizer parameter groups hold {sizes} saved, {here} here")
    if problems:
        raise ValueError(f"{path} does not fit this model:\n  " + "\n  ".join(problems))


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
    group=None,
) -> Checkpoint:
    """Every rank reads ``path`` into its model and optimizer, and its own RNG state (chapter 3).

    The file must be where every rank can read it: one machine, or a shared filesystem.
    ``restore_rng=False`` only serves to show what goes wrong without it.
    """
    path = Path(path)
    checkpoint = _read(path)
    _check_fits(path, checkpoint, model, optimizer)
    model.load_state_dict(checkpoint["model"])  # copies onto the parameters' device
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    rank, world = group_rank_size(group)
    saved_world, rng = checkpoint["world_size"], checkpoint["rng"]
    if saved_world != world:
        what = "restored" if rank < saved_world else "not restored (no such rank was saved)"
        warnings.warn(
            f"{path} was saved by {saved_world} ranks and is loaded by {world}: the model, "
            f"optimizer and progress are restored, and rank {rank}'s RNG state is {what}. "
            "Random draws now differ from a run that kept the old world size, so results will "
            "not match it bitwise.",
            RuntimeWarning,
            stacklevel=2,
        )
    restored = restore_rng and rank < saved_world
    if restored:
        _set_rng_state(rng[rank])
    return Checkpoint(
        Progress(**checkpoint["progress"]), checkpoint["extra"], saved_world, restored
    )


def seed_all(seed: int) -> None:
    """Seed every RNG a training step may draw from: torch (CPU and CUDA), random, NumPy."""
    torch.manual_seed(seed)  # seeds the CUDA generators too
    random.seed(seed)
    np.random.seed(seed)
