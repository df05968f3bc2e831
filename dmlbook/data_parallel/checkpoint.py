"""Checkpoints that survive a crash at any moment, and training that resumes exactly (chapter 3).

Chapter 3 ("checkpointing and fault tolerance") teaches three ideas with this module:

1. **A save is all or nothing.** :func:`atomic_save` writes a temporary file in the same
   directory, flushes Python's buffer and ``fsync``s the kernel's cache to the disk, renames the
   file over the old one with ``os.replace`` (atomic within one filesystem), then ``fsync``s the
   directory so that the rename itself is on disk. Killed at any moment, it leaves the previous
   checkpoint or the new one at the final path, never half of one.
2. **A checkpoint holds everything the next step depends on**, so that a resumed run is
   bitwise the run that never crashed: the model, the optimizer (momentum buffers), the progress
   (epoch and position within it: each epoch's shuffle is a function of ``(seed, epoch)``, see
   :func:`~dmlbook.datasets.shard_indices`), and the random-number generators of *every* rank
   (torch CPU and CUDA, Python's ``random``, NumPy), since each rank draws its own dropout masks or
   augmentations. :func:`save` is collective: the ranks' RNG states are gathered to rank 0, rank 0
   alone writes (data-parallel replicas are identical), and a barrier makes sure the file exists
   before any rank moves on. :func:`load` is read by every rank, each restoring its own RNG.
   :func:`train_resumable` is chapter 1's loop plus these checkpoints: a crash costs at most
   ``every`` steps.
3. **Sharded checkpoints with** ``torch.distributed.checkpoint`` **(DCP)**, beside the home-made
   one: :func:`save_sharded` has every rank write its own shard (for a model sharded with FSDP2,
   ZeRO-3 style), and :func:`load_sharded` reads it back at *any* world size, each rank reading
   only the pieces that overlap the shard it now holds.

Files are read with ``torch.load(weights_only=True)``, so a checkpoint holds only tensors, numbers,
strings and lists/tuples/dicts of them (RNG states are converted to tensors), and loading a file
from elsewhere cannot run code. DCP's tensors are read the same way, but its ``.metadata`` file is
a plain pickle: load only DCP checkpoints you trust.

Loading at another world size: the model, optimizer and progress load as usual (replicas are
identical); rank ``r`` restores the RNG state saved by rank ``r`` if there was one and keeps its own
otherwise, and a ``RuntimeWarning`` says that random draws, hence results, will no longer match an
uninterrupted run bitwise (chapter 11 resizes jobs on purpose).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel.averaging import broadcast_parameters
from dmlbook.data_parallel.loop import Batch, Callback, LoopState, strided_batches, train_loop
from dmlbook.launch import device

__all__ = [
    "Progress",
    "Checkpoint",
    "TrainingRun",
    "SimulatedCrash",
    "SimulateCrash",
    "Checkpointing",
    "progress_after",
    "atomic_save",
    "save",
    "load",
    "checkpoint_path",
    "latest",
    "seed_all",
    "train_resumable",
    "save_sharded",
    "load_sharded",
]

FORMAT = "dmlbook.data_parallel.checkpoint/1"
_NAME = re.compile(r"step-(\d+)\.pt")  # checkpoint_path's names; temporaries start with a dot


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


def _barrier(group=None) -> None:
    if group_rank_size(group)[1] > 1:
        dist.barrier(group=group)  # communication


# --------------------------------------------------------------------------- atomic files


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)``, all or nothing: a crash leaves the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # 1. A temporary file in the SAME directory: a rename is atomic only within one filesystem.
    #    The leading dot keeps it out of latest()'s sight if we die before the rename.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()  # Python's buffer -> the kernel's page cache
            os.fsync(f.fileno())  # the page cache -> the disk
        os.replace(tmp, path)  # 2. readers now see the new file, before they saw the old one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # 3. the rename is an entry in the directory: make it durable
    return path


def _fsync_directory(directory: Path) -> None:
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


# --------------------------------------------------------------------------- RNG states as tensors


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


# --------------------------------------------------------------------------- save and load


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
    _barrier(group)  # nobody moves on (or crashes) before the checkpoint is on disk
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


def _mismatches(saved: dict[str, tuple], ours: dict[str, tuple]) -> list[str]:
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
    problems = _mismatches(saved, {k: tuple(v.shape) for k, v in model.state_dict().items()})
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


# --------------------------------------------------------------------------- resumable training


def seed_all(seed: int) -> None:
    """Seed every RNG a training step may draw from: torch (CPU and CUDA), random, NumPy."""
    torch.manual_seed(seed)  # seeds the CUDA generators too
    random.seed(seed)
    np.random.seed(seed)


class SimulatedCrash(RuntimeError):
    """Raised by :class:`SimulateCrash`: the failure a resumed run recovers from."""


class SimulateCrash(Callback):
    """A callback for :func:`~dmlbook.data_parallel.loop.train_loop`: rank ``rank`` fails after
    global step ``at_step``. ``hard=True`` ends the process at once with ``os._exit`` (as a
    machine failure would: no traceback, no cleanup); otherwise it raises :class:`SimulatedCrash`.
    """

    def __init__(self, at_step: int, rank: int = 0, hard: bool = False) -> None:
        self.at_step, self.rank, self.hard = at_step, rank, hard

    def on_step(self, state: LoopState) -> None:
        if state.step == self.at_step and state.rank == self.rank:
            if self.hard:
                os._exit(17)
            raise SimulatedCrash(f"rank {self.rank} crashed after step {self.at_step}, as asked")


def progress_after(batch: Batch, step: int) -> Progress:
    """Where training stands after ``batch``, the ``step``-th step: the next batch to run."""
    if batch.last_in_epoch:
        return Progress(batch.epoch + 1, 0, step)
    return Progress(batch.epoch, batch.index + 1, step)


class Checkpointing(Callback):
    """A callback that checkpoints the loop with :func:`save` every ``every`` steps and after the
    last batch of epoch ``epochs - 1``, keeping the ``keep`` newest files of ``directory``.

    ``extra(state)`` adds the caller's values to each checkpoint (always ``settings``: what fixes
    the data order). After each save every callback's ``on_checkpoint(state, path)`` runs.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int,
        epochs: int,
        keep: int = 2,
        settings: dict | None = None,
        extra: Callable[[LoopState], dict] | None = None,
    ) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"every={every} and keep={keep} must be >= 1")
        self.directory, self.every, self.epochs, self.keep = Path(directory), every, epochs, keep
        self.settings, self.extra = settings or {}, extra

    def on_train_start(self, state: LoopState) -> None:
        if state.rank == 0:  # nobody is saving now: remove what a save killed earlier left behind
            for leftover in self.directory.glob(".step-*.tmp"):
                leftover.unlink(missing_ok=True)

    def on_step(self, state: LoopState) -> None:
        batch = state.batch
        if state.step % self.every == 0 or (batch.last_in_epoch and batch.epoch + 1 == self.epochs):
            path = checkpoint_path(self.directory, state.step)
            extra = {"settings": self.settings, **(self.extra(state) if self.extra else {})}
            save(path, model=state.model, optimizer=state.optimizer, extra=extra,
                 progress=progress_after(batch, state.step), group=state.group)  # fmt: skip
            if state.rank == 0:  # only once the new checkpoint is durable
                for old in sorted(self.directory.glob("step-*.pt"))[: -self.keep]:
                    old.unlink(missing_ok=True)
            state.emit("on_checkpoint", path)


class _Augment(Callback):
    """Gaussian noise on this rank's inputs, from the global RNG: why every RNG is restored."""

    def __init__(self, std: float) -> None:
        self.std = std

    def inputs(self, state: LoopState, x: torch.Tensor) -> torch.Tensor:
        return x + self.std * torch.randn_like(x)


@dataclass
class TrainingRun:
    """What one call of :func:`train_resumable` did on this rank."""

    resumed_from: int | None  # global step of the checkpoint it started from; None if fresh
    progress: Progress  # where it stopped
    losses: list[float] = field(default_factory=list)  # this rank's loss at each step it ran


def train_resumable(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    global_batch: int,
    epochs: int,
    checkpoint_dir: str | os.PathLike,
    every: int,
    seed: int = 0,
    noise: float = 0.1,
    keep: int = 2,
    callbacks: Sequence[Callback] = (),
    restore_rng: bool = True,
    group=None,
) -> TrainingRun:
    """Chapter 1's loop (:func:`~dmlbook.data_parallel.loop.train_loop`) with a
    :class:`Checkpointing` callback; it resumes from the latest checkpoint of ``checkpoint_dir``.

    Each step adds Gaussian noise (std ``noise``) to this rank's inputs, drawn from the global
    torch RNG seeded with ``seed + rank``: the random augmentation that makes restoring every
    rank's RNG necessary. Only the ``keep`` newest checkpoints are kept.
    """
    rank, world = group_rank_size(group)
    batches = strided_batches(
        len(x), global_batch, rank=rank, world_size=world, epochs=epochs, seed=seed
    )  # fmt: skip  (checks the arguments before any load)
    # What fixes the data order: a position within an epoch means nothing under other values.
    settings = dict(seed=seed, global_batch=global_batch, samples=len(x))
    saver = Checkpointing(checkpoint_dir, every=every, epochs=epochs, keep=keep, settings=settings)
    start, resumed_from = Progress(), None
    if (path := latest(checkpoint_dir)) is not None:
        loaded = load(path, model=model, optimizer=optimizer, restore_rng=restore_rng, group=group)
        if loaded.extra.get("settings") != settings:
            raise ValueError(
                f"{path} was saved by a run with {loaded.extra.get('settings')}, this one has "
                f"{settings}: resume with the same ones, or start in a new checkpoint_dir"
            )
        start, resumed_from = loaded.progress, loaded.progress.step
        batches = strided_batches(len(x), global_batch, rank=rank, world_size=world,
                                  epochs=epochs, seed=seed,
                                  start=(start.epoch, start.step_in_epoch))  # fmt: skip
    else:
        seed_all(seed + rank)  # each rank its own random stream
        broadcast_parameters(model, group=group)  # every rank starts from rank 0's model
    done = train_loop(model, optimizer, x, y, batches, callbacks=[_Augment(noise), saver,
                      *callbacks], step=start.step, group=group)  # fmt: skip
    progress = start if done.batch is None else progress_after(done.batch, done.step)
    return TrainingRun(resumed_from, progress, done.losses)


# --------------------------------------------------------------------------- sharded, with DCP


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every call outside a process group (even with ``no_dist=True``); here that
    single-process use is deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    group=None,
) -> Path:
    """Collective: every rank writes its own shard with ``torch.distributed.checkpoint`` (ch. 3).

    DCP writes many files, so no single rename replaces them all: the ranks write a temporary
    folder, and rank 0 renames the folder into place once DCP's ``.metadata`` is written.
    Beware: to save an optimizer that has not stepped yet, ``get_state_dict`` creates its state
    by stepping it with zero gradients at lr 0, which for Adam counts as a step.
    """
    import torch.distributed.checkpoint as dcp  # here, not at the top: costs ~1 s per rank
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    partial = directory.with_name(f".{directory.name}.partial")
    if group_rank_size(group)[0] == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a save killed earlier left
    _barrier(group)
    # Keyed by parameter name; a sharded model's tensors are DTensors that know their part.
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else [optimizer])
    state = {"model": model_state, "optimizer": optim_state}
    with _quiet_dcp():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=group)
    if group_rank_size(group)[0] == 0:
        old = directory.with_name(f".{directory.name}.old")
        if directory.exists():  # a folder cannot be renamed over a non-empty one
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_directory(directory.parent)
    _barrier(group)
    return directory


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
    with _quiet_dcp():
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
    problems = _mismatches(theirs, ours)
    if optimizer is not None and not any(k.startswith("optimizer.") for k in saved):
        problems.append("no optimizer state was saved: load with optimizer=None")
    if problems:
        raise ValueError(f"{directory} does not fit this model:\n  " + "\n  ".join(problems))
