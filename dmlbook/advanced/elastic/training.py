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
    linear_scaling,
    train_loop,
    train_reference,
)
from dmlbook.data_parallel import checkpoint as ckpt
from dmlbook.datasets import load_digits, shard_indices
from dmlbook.models import Batch, accuracy, mlp

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


@dataclass(frozen=True)
class ResumePoint:
    """Where a (re)started worker begins: the epoch, the samples of it already trained, and the
    global step. ``saved_world`` and ``saved_lr`` say who wrote the checkpoint (None: a first
    start, from scratch)."""

    epoch: int = 0
    position: int = 0  # in samples: a count of batches means nothing once the batch size changes
    step: int = 0
    saved_world: int | None = None
    saved_lr: float | None = None


def resume(checkpoints: str | os.PathLike, model: nn.Module, optimizer, lr: float) -> ResumePoint:
    """Load the latest checkpoint in ``checkpoints`` into ``model`` and ``optimizer`` (momentum
    included) and return where it left off; from scratch if there is none. The learning rate is
    set to ``lr``, this world's, since the checkpoint holds the old world's."""
    path = ckpt.latest(checkpoints)
    if path is None:
        return ResumePoint()  # the first start
    with warnings.catch_warnings():  # a checkpoint from another world size is expected here
        warnings.simplefilter("ignore", RuntimeWarning)
        saved = ckpt.load(path, model=model, optimizer=optimizer)  # every rank reads the file
    for group in optimizer.param_groups:
        group["lr"] = lr
    return ResumePoint(saved.progress.epoch, saved.extra["position"], saved.progress.step,
                       saved.world_size, saved.extra["lr"])  # fmt: skip


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
    """This rank's batches from ``start = (epoch, position in samples)`` on: each global batch is
    the next ``local_batch * world_size`` samples of the epoch's order (fewer at its end), and
    :func:`rank_batch` gives this rank its part. Each rank's loss is its share of the global
    mean (``global_size``), since the parts may differ in size."""
    for epoch in range(start[0], epochs):
        order = epoch_order(samples, seed, epoch)  # the same on every rank, at any world size
        position = start[1] if epoch == start[0] else 0
        index = 0
        while position < len(order):
            size = min(local_batch * world_size, len(order) - position)  # this global batch
            mine = rank_batch(order, position, local_batch, rank, world_size)
            yield LocalBatch(epoch, index, mine, last_in_epoch=position + size == len(order),
                             offset=position, global_size=size)  # fmt: skip
            position, index = position + size, index + 1


def position_after(batch: LocalBatch) -> int:
    """Where the epoch stands after ``batch``, in samples: 0 once the epoch is done (the
    checkpoint's epoch is then the next one)."""
    return 0 if batch.last_in_epoch else batch.offset + batch.global_size


def train_worker(config: ElasticConfig) -> dict | None:
    """One worker of elastic data-parallel training. torchrun starts it, and starts it again
    after a failure, at whatever world size the rendezvous found. Returns rank 0's final test
    accuracy (None on the other ranks)."""
    rank, world = _join_torchrun_group()  # torchrun set RANK and WORLD_SIZE for this generation
    x, y = load_digits("train")
    model = mlp(seed=config.seed)
    # 3. Rescale the learning rate for this world's global batch (local_batch x world).
    lr = lr_for(world, base_lr=config.base_lr, base_batch=config.base_batch,
                local_batch=config.local_batch)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum)
    # 1. Resume: the model, the momentum and the position in the epoch, from the last checkpoint.
    checkpoints = Path(config.run_dir) / "checkpoints"
    start = resume(checkpoints, model, optimizer, lr)
    # 2. Re-partition the rest of the epoch over this world's ranks.
    batches = elastic_batches(len(x), seed=config.seed, local_batch=config.local_batch,
                              rank=rank, world_size=world, epochs=config.epochs,
                              start=(start.epoch, start.position))  # fmt: skip

    def extra(state):  # what each checkpoint adds: this world's LR, the position in samples
        return {"lr": lr, "position": position_after(state.batch)}

    # Chapter 3's atomic checkpoints, every config.every steps.
    saver = ckpt.Checkpointing(checkpoints, every=config.every, epochs=config.epochs, extra=extra)
    record = _Record(config, start, lr)  # the run's timeline, for the chapter to check
    failure = _PlantedFailure(config, record.timeline)  # the failure the chapter plants
    # Chapter 1's loop, with chapter 2's ring all-reduce adding up the gradients.
    sync = GradientAveraging(algorithm="ring", divide_by=1)
    done = train_loop(model, optimizer, x, y, batches, sync=sync, step=start.step,
                      callbacks=[record, saver, failure])  # fmt: skip
    result = _finish(Path(config.run_dir), model, done.step, world, record.timeline)
    dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------- the worker's plumbing


def _join_torchrun_group() -> tuple[int, int]:
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


def _spawned_at() -> float:
    """When the agent started this process (wall clock), from Linux's process table; now, where
    there is none. ``time.time()`` minus the process's age, which /proc gives to 10 ms."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class _Record(Callback):
    """The timeline of a worker: its start (with a generation number, counted by rank 0 and
    broadcast), each step's global mean loss and the samples each rank took, each checkpoint,
    and a fault (a collective that lost its peer)."""

    def __init__(self, config: ElasticConfig, start: ResumePoint, lr: float) -> None:
        self.config, self.start, self.lr = config, start, lr
        self.timeline, self.samples_log = Timeline(config.run_dir), None

    def on_train_start(self, state: LoopState) -> None:
        rank, world, timeline, start = state.rank, state.world_size, self.timeline, self.start
        generation = torch.tensor([len(timeline.events("start"))] if rank == 0 else [0])
        dist.broadcast(generation, 0)  # rank 0 counts the earlier starts and tells the others
        self.generation = int(generation)
        run_dir = Path(self.config.run_dir)
        with open(run_dir / "pids.txt", "a") as f:
            f.write(f"{os.getpid()}\n")
        self.samples_log = open(run_dir / f"samples-g{self.generation}-r{rank}.jsonl", "a",
                                buffering=1)  # fmt: skip
        if rank == 0:
            resumed = None if start.saved_world is None else dict(
                world=start.saved_world, lr=start.saved_lr)  # fmt: skip
            timeline.record(
                "start", generation=self.generation, world=world, lr=self.lr,
                global_batch=self.config.local_batch * world, resume_step=start.step,
                epoch=start.epoch, position=start.position, resumed_from=resumed,
                restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), spawned=_spawned_at(),
            )  # fmt: skip

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
                                 position=position_after(state.batch))  # fmt: skip

    def on_fault(self, state: LoopState, error: BaseException) -> None:
        self.timeline.record("fault", rank=state.rank, step=state.step, generation=self.generation,
                             error=f"{type(error).__name__}: {str(error)[:200]}")  # fmt: skip

    def on_train_end(self, state: LoopState) -> None:
        self.samples_log.close()


class _PlantedFailure(Callback):
    """Kill this worker (or its whole node) once per run directory, at the planned step; then
    wait ``step_delay`` seconds, to make a run long enough to watch."""

    def __init__(self, config: ElasticConfig, timeline: Timeline) -> None:
        self.config, self.timeline = config, timeline

    def on_step(self, state: LoopState) -> None:
        _plant_failure(self.config, self.timeline, state.rank, state.step)
        if self.config.step_delay:
            time.sleep(self.config.step_delay)


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


def _finish(run_dir: Path, model: nn.Module, step: int, world: int, timeline) -> dict | None:
    """Rank 0: the test accuracy, and the final model saved atomically (None elsewhere)."""
    if dist.get_rank() != 0:
        return None
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
