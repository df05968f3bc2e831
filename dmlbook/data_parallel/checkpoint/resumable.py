"""Training that resumes exactly: the loop's checkpointing and crash callbacks (chapter 3).

:class:`Checkpointing` plugs :func:`~dmlbook.data_parallel.checkpoint.save` into the one training
loop (:func:`dmlbook.data_parallel.loop.train_loop`); :func:`train_resumable` is chapter 1's loop
with it, resuming from the latest checkpoint; :class:`SimulateCrash` plants a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel.averaging import broadcast_parameters
from dmlbook.data_parallel.checkpoint.files import (
    Progress,
    checkpoint_path,
    latest,
    load,
    save,
    seed_all,
)
from dmlbook.data_parallel.loop import Callback, LocalBatch, LoopState, strided_batches, train_loop


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


def progress_after(batch: LocalBatch, step: int) -> Progress:
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


@dataclass(frozen=True)
class ResumableConfig:
    """What fixes a :func:`train_resumable` run: where and how often it checkpoints, and chapter
    1's loop settings."""

    checkpoint_dir: str | os.PathLike
    global_batch: int
    epochs: int
    every: int  # checkpoint every this many steps (and after the last)
    seed: int = 0  # the data order, and each rank's random stream (seed + rank)
    noise: float = 0.1  # std of the Gaussian noise added to the inputs: a random augmentation
    keep: int = 2  # how many of the newest checkpoints to keep
    restore_rng: bool = True  # on resume, restore every rank's RNG state (chapter 3's point)

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1 or self.epochs < 1:
            raise ValueError(
                f"every={self.every}, keep={self.keep} and epochs={self.epochs} must be >= 1"
            )


def train_resumable(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    config: ResumableConfig,
    *,
    callbacks: Sequence[Callback] = (),
    group=None,
) -> TrainingRun:
    """Chapter 1's loop (:func:`~dmlbook.data_parallel.loop.train_loop`) with a
    :class:`Checkpointing` callback; it resumes from the latest checkpoint of
    ``config.checkpoint_dir``.

    Each step adds Gaussian noise (std ``config.noise``) to this rank's inputs, drawn from the
    global torch RNG seeded with ``seed + rank``: the random augmentation that makes restoring
    every rank's RNG necessary. Only the ``keep`` newest checkpoints are kept.
    """
    c = config
    rank, world = group_rank_size(group)
    plan = dict(rank=rank, world_size=world, epochs=c.epochs, seed=c.seed)
    batches = strided_batches(len(x), c.global_batch, **plan)  # checks them before any load
    # What fixes the data order: a position within an epoch means nothing under other values.
    settings = dict(seed=c.seed, global_batch=c.global_batch, samples=len(x))
    saver = Checkpointing(c.checkpoint_dir, every=c.every, epochs=c.epochs, keep=c.keep,
                          settings=settings)  # fmt: skip
    start, resumed_from = Progress(), None
    if (path := latest(c.checkpoint_dir)) is not None:
        loaded = load(path, model=model, optimizer=optimizer, restore_rng=c.restore_rng,
                      group=group)  # fmt: skip
        if loaded.extra.get("settings") != settings:
            raise ValueError(
                f"{path} was saved by a run with {loaded.extra.get('settings')}, this one has "
                f"{settings}: resume with the same ones, or start in a new checkpoint_dir"
            )
        start, resumed_from = loaded.progress, loaded.progress.step
        resume_at = (start.epoch, start.step_in_epoch)
        batches = strided_batches(len(x), c.global_batch, **plan, start=resume_at)
    else:
        seed_all(c.seed + rank)  # each rank its own random stream
        broadcast_parameters(model, group=group)  # every rank starts from rank 0's model
    callbacks = [_Augment(c.noise), saver, *callbacks]
    done = train_loop(model, optimizer, x, y, batches, callbacks=callbacks, step=start.step,
                      group=group)  # fmt: skip
    progress = start if done.batch is None else progress_after(done.batch, done.step)
    return TrainingRun(resumed_from, progress, done.losses)
