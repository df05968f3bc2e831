"""Elastic data-parallel training under torchrun's agent: resume, re-partition, rescale (ch. 11)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmlbook.comm.groups import balanced_blocks
from dmlbook.data_parallel import (
    Callback,
    GradientAveraging,
    LocalBatch,
    LoopState,
    accuracy,
    linear_scaling,
    train_loop,
    train_reference,
)
from dmlbook.data_parallel import checkpoint as ckpt
from dmlbook.datasets import load_digits, shard_indices
from dmlbook.models import Batch, mlp

# --------------------------------------------------------------------------- the timeline


class Timeline:
    """Events of an elastic run, one JSON object per line of ``<run_dir>/timeline.jsonl``.

    Every event has ``event`` and ``time`` (wall clock, ``time.time()``). Appends are single
    ``write`` calls of whole lines on a file opened for appending, so the events of a process that
    is killed right after are already in the file.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / "timeline.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, event: str, **fields: Any) -> dict:
        entry = {"event": event, "time": time.time(), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        return entry

    def events(self, kind: str | None = None) -> list[dict]:
        """Every event so far (of ``kind`` only, if given), in the order they were written."""
        if not self.path.exists():
            return []
        entries = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [e for e in entries if kind is None or e["event"] == kind]


# --------------------------------------------------------------------------- data and LR


def epoch_order(samples: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shuffled order of all samples: the same on every rank, at any world size."""
    return shard_indices(samples, 0, 1, shuffle=True, seed=seed, epoch=epoch)


def rank_batch(
    order: Sequence[int], position: int, local_batch: int, rank: int, world_size: int
) -> list[int]:
    """Rank ``rank``'s part of the global batch that starts at ``position`` in ``order``.

    The global batch is the next ``local_batch * world_size`` samples (fewer at the end of the
    epoch); rank r takes a contiguous part of it, sizes differing by at most one. The parts of all
    ranks are exactly the global batch, whatever the world size: resizing loses and repeats nothing.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if local_batch < 1 or not 0 <= position < len(order):
        raise ValueError(f"need local_batch >= 1 and 0 <= position < {len(order)}")
    batch = order[position : position + local_batch * world_size]
    start, stop = balanced_blocks(len(batch), world_size)[rank]  # sizes differ by one at most
    return list(batch[start:stop])


def lr_for(world_size: int, *, base_lr: float, base_batch: int, local_batch: int) -> float:
    """The learning rate at this world size: the linear rule on the global batch."""
    return linear_scaling(base_lr, base_batch, local_batch * world_size)


@dataclass(frozen=True)
class ElasticConfig:
    """Everything that fixes an elastic run. ``kill_*`` plant one failure, once per run directory:
    at global step ``kill_step`` rank ``kill_rank`` SIGKILLs itself (``kill="worker"``) or its
    agent and then itself (``kill="node"``: the whole machine is gone)."""

    run_dir: str
    epochs: int = 3
    local_batch: int = 16
    base_lr: float = 0.1
    base_batch: int = 32
    momentum: float = 0.9
    every: int = 10  # checkpoint every this many steps
    seed: int = 0
    kill_step: int | None = None
    kill_rank: int = 1
    kill: str = "worker"
    step_delay: float = 0.0  # seconds of sleep per step, to make a run long enough to watch

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.local_batch < 1 or self.base_batch < 1 or self.every < 1:
            raise ValueError(
                f"epochs, local_batch, base_batch and every must be >= 1, got {self.epochs}, "
                f"{self.local_batch}, {self.base_batch}, {self.every}"
            )
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"base_lr must be a number > 0, got {self.base_lr}")
        if self.kill not in ("worker", "node"):
            raise ValueError(f"kill must be 'worker' or 'node', got {self.kill!r}")
        if self.kill_step is not None and self.kill_step < 1:
            raise ValueError(f"kill_step must be >= 1 (a global step), got {self.kill_step}")


# --------------------------------------------------------------------------- elastic training


def _init_from_torchrun() -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if not dist.is_initialized():
        missing = [
            v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"train_worker runs under torchrun (missing {missing}); e.g. torchrun "
                "--standalone --nproc-per-node 2 --max-restarts 1 examples/elastic_train.py RUN_DIR"
            )
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torch >= 2.5 lends the agent's store to the workers; a restarted group can then
            # read the dead group's addresses and fail to connect (pytorch/pytorch#135712)
            raise RuntimeError(
                "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, so "
                "that every restarted group gets a fresh store (see "
                "dmlbook.advanced.elastic.AGENT_ENV)"
            )
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _plant_failure(config: ElasticConfig, timeline: Timeline, rank: int, step: int) -> None:
    """Kill this worker (or its whole node) once per run directory, at the planned step."""
    if config.kill_step != step or config.kill_rank != rank:
        return
    marker = Path(config.run_dir) / "killed"
    try:
        marker.open("x").close()  # only the first attempt that gets here kills
    except FileExistsError:
        return
    timeline.record("kill", rank=rank, step=step, what=config.kill, pid=os.getpid())
    if config.kill == "node":  # the agent first, so nothing is left to notice and clean up
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def elastic_batches(
    samples: int,
    *,
    seed: int,
    local_batch: int,
    rank: int,
    world_size: int,
    epochs: int,
    start: tuple[int, int] = (0, 0),
) -> Iterable[LocalBatch]:
    """Chapter 11's batch plan for :func:`~dmlbook.data_parallel.loop.train_loop`: each global
    batch is the next ``local_batch * world_size`` samples of the epoch's order (fewer at its
    end), re-partitioned over *this* world size by :func:`rank_batch`; each rank's loss is its
    share of the global mean. ``start`` is ``(epoch, position in samples)``, for a resumed run."""
    for epoch in range(start[0], epochs):
        order = epoch_order(samples, seed, epoch)
        position, index = (start[1] if epoch == start[0] else 0), 0
        while position < len(order):
            size = min(local_batch * world_size, len(order) - position)
            idx = rank_batch(order, position, local_batch, rank, world_size)
            yield LocalBatch(epoch, index, idx, last_in_epoch=position + size == len(order),
                        offset=position, global_size=size)  # fmt: skip
            position, index = position + size, index + 1


def _position_after(batch: LocalBatch) -> dict:
    """Where the next step starts, in samples of its epoch: the next epoch once one is used up."""
    return {"position": 0 if batch.last_in_epoch else batch.offset + batch.global_size}


class _ElasticRecord(Callback):
    """Chapter 11's records of each step: the samples each rank took, and on rank 0 the global
    mean loss and each checkpoint in the timeline."""

    def __init__(self, timeline: Timeline, samples_log, generation: int, lr: float) -> None:
        self.timeline, self.samples_log, self.generation, self.lr = (
            timeline, samples_log, generation, lr)  # fmt: skip

    def on_step(self, state: LoopState) -> None:
        batch = state.batch
        self.samples_log.write(json.dumps([state.step, batch.epoch, list(batch.samples)]) + "\n")
        loss = state.loss.reshape(1).clone()
        dist.all_reduce(loss)  # the global batch's mean loss, for the curve
        if state.rank == 0:
            self.timeline.record("step", step=state.step, loss=loss.item(), world=state.world_size,
                                 lr=self.lr, generation=self.generation)  # fmt: skip

    def on_checkpoint(self, state: LoopState, path) -> None:
        if state.rank == 0:
            after = ckpt.progress_after(state.batch, state.step)
            self.timeline.record("checkpoint", step=state.step, epoch=after.epoch,
                                 **_position_after(state.batch))  # fmt: skip


class _PlantedFailure(Callback):
    """Kill this worker (or its whole node) once per run directory, at the planned step; then
    wait ``step_delay`` seconds, to make a run long enough to watch."""

    def __init__(self, config: ElasticConfig, timeline: Timeline) -> None:
        self.config, self.timeline = config, timeline

    def on_step(self, state: LoopState) -> None:
        _plant_failure(self.config, self.timeline, state.rank, state.step)
        if self.config.step_delay:
            time.sleep(self.config.step_delay)


def train_worker(config: ElasticConfig) -> dict | None:
    """One worker of elastic data-parallel training; torchrun starts it (again after failures).

    Returns the final test accuracy and state on rank 0, None elsewhere.
    """
    rank, world = _init_from_torchrun()
    run_dir, timeline = Path(config.run_dir), Timeline(config.run_dir)
    torch.manual_seed(config.seed)
    x, y = load_digits("train")
    model = mlp(seed=config.seed)
    lr = lr_for(world, base_lr=config.base_lr, base_batch=config.base_batch,
                local_batch=config.local_batch)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum)
    epoch, position, step, resumed = _resume(run_dir, model, optimizer, lr)  # 1. resume
    generation = _start_generation(config, timeline, rank, world, lr, step, epoch, position,
                                   resumed)  # 2. a generation number per (re)start  # fmt: skip
    with open(run_dir / "pids.txt", "a") as f:
        f.write(f"{os.getpid()}\n")
    # 3. Train: chapter 1's loop, each global batch re-partitioned for *this* world size.
    batches = elastic_batches(len(x), seed=config.seed, local_batch=config.local_batch,
                              rank=rank, world_size=world, epochs=config.epochs,
                              start=(epoch, position))  # fmt: skip
    saver = ckpt.Checkpointing(
        run_dir / "checkpoints",
        every=config.every,
        epochs=config.epochs,
        extra=lambda state: {"lr": lr, **_position_after(state.batch)},
    )
    with open(run_dir / f"samples-g{generation}-r{rank}.jsonl", "a", buffering=1) as log:
        callbacks = [_ElasticRecord(timeline, log, generation, lr), saver,
                     _PlantedFailure(config, timeline)]  # fmt: skip
        sync = GradientAveraging(algorithm="ring", divide_by=1)  # chapter 2's ring all-reduce
        done = train_loop(model, optimizer, x, y, batches, sync=sync, callbacks=callbacks,
                          step=step)  # fmt: skip
    result = _finish(run_dir, model, done.step, world, timeline) if rank == 0 else None
    dist.destroy_process_group()
    return result


def _resume(run_dir: Path, model: nn.Module, optimizer, lr: float) -> tuple:
    """(epoch, position in samples, step, what it resumed from) from the latest checkpoint, with
    this world's learning rate set again (``load`` brings back the old one); zeros if none."""
    epoch, position, step, resumed = 0, 0, 0, None
    if (path := ckpt.latest(run_dir / "checkpoints")) is not None:
        with warnings.catch_warnings():  # a new world size is the point here, not a surprise
            warnings.simplefilter("ignore", RuntimeWarning)
            loaded = ckpt.load(path, model=model, optimizer=optimizer)
        epoch, position = loaded.progress.epoch, loaded.extra["position"]
        step, resumed = loaded.progress.step, dict(world=loaded.world_size, lr=loaded.extra["lr"])
    for group in optimizer.param_groups:
        group["lr"] = lr
    return epoch, position, step, resumed


def _start_generation(config, timeline, rank, world, lr, step, epoch, position, resumed) -> int:
    """Rank 0 counts earlier starts and tells the others; it records this start's settings."""
    generation = torch.tensor([len(timeline.events("start"))] if rank == 0 else [0])
    dist.broadcast(generation, 0)
    if rank == 0:
        timeline.record(
            "start", generation=int(generation), world=world, lr=lr,
            global_batch=config.local_batch * world, resume_step=step, epoch=epoch,
            position=position, resumed_from=resumed,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        )  # fmt: skip
    return int(generation)


def _finish(run_dir: Path, model: nn.Module, step: int, world: int, timeline) -> dict:
    """Rank 0: the test accuracy, and the final model saved atomically."""
    x_test, y_test = load_digits("test")
    result = dict(accuracy=accuracy(model, x_test, y_test), step=step, world=world)
    ckpt.atomic_save({"model": model.state_dict(), **result}, run_dir / "final.pt")
    timeline.record("end", **result)
    return result


def uninterrupted_run(config: ElasticConfig, world_size: int) -> tuple[nn.Module, list[float]]:
    """The uninterrupted run at ``world_size``, in one process: the same global batches, the same
    LR, the mean gradient computed at once (the one reference trainer,
    :func:`~dmlbook.data_parallel.loop.train_reference`). Returns the model and the loss at
    every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny MLP: threads only wait for each other on a busy machine
    try:
        x, y = load_digits("train")
        lr = lr_for(world_size, base_lr=config.base_lr, base_batch=config.base_batch,
                    local_batch=config.local_batch)  # fmt: skip
        done = train_reference(
            lambda: mlp(seed=config.seed),
            _global_batches(x, y, config, config.local_batch * world_size),
            optimizer=partial(torch.optim.SGD, momentum=config.momentum),
            lr=lr,
            loss_fn=F.cross_entropy,
        )
        return done.model, done.losses
    finally:
        torch.set_num_threads(threads)


def _global_batches(x, y, config: ElasticConfig, global_batch: int) -> Iterable[Batch]:
    """Every epoch's order cut into global batches (the last of an epoch may be shorter)."""
    for epoch in range(config.epochs):
        order = epoch_order(len(x), config.seed, epoch)
        for start in range(0, len(order), global_batch):
            idx = order[start : start + global_batch]
            yield Batch(x[idx], y[idx])
