"""Elastic training and serving: jobs that lose, gain and resize workers (chapter 11).

Chapter 11 ("Elastic model training and serving") teaches three pieces with this module:

1. **Elastic data parallelism under torchrun's elastic agent.** ``torchrun --nnodes 1:N
   --max-restarts K`` runs an *agent* per machine. When a worker dies, the agent stops the others,
   meets the surviving agents again (the c10d *rendezvous*) and starts a fresh group at whatever
   world size is there now. Nothing survives in memory, so :func:`train_worker` (what each worker
   runs; ``examples/elastic_train.py`` is the script) checkpoints with chapter 3's atomic
   :func:`dmlbook.data_parallel.checkpoint.save` and, on every start:

   * resumes from the latest checkpoint: the model, the momentum, and the position in the epoch
     counted in **samples** (a position in batches means nothing once the batch size changes);
   * re-partitions the rest of the epoch for the new world size (:func:`rank_batch`): global
     batch ``t`` is the next ``local_batch x world`` samples of the epoch's shuffled order, and
     rank ``r`` takes its own contiguous part, so no sample is lost or seen twice;
   * rescales the learning rate to the new global batch with the linear rule
     (:func:`lr_for`, :func:`dmlbook.data_parallel.linear_scaling`).

   It writes a :class:`Timeline` (JSON lines under the run directory: start, checkpoint, step,
   kill, end, with wall times) and, per rank and generation, the sample indices it trained on, so
   tests and the notebook can check the story instead of trusting it. :func:`torchrun_command`
   writes the agents' command lines (``--standalone``, or a c10d endpoint for several nodes) and
   :func:`run_agents` runs them and leaves no process behind. torchrun needs
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (:data:`AGENT_ENV`) for restarts to work here.

2. **Adaptive training on a parameter server** (:func:`ps_train_adaptive`): workers join and
   leave between rounds. Workers only ever talk to the server, so a membership change needs no
   rendezvous and no restart: the server hands each round's global batch to whoever is there.

3. **Elastic serving** (:func:`serve_elastic`): a pool of inference worker processes that an
   :class:`Autoscaler` grows and shrinks with the measured request rate (a :class:`FixedPool`
   is the baseline), with every request's latency.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dmlbook.data_parallel import accuracy, average_gradients, linear_scaling
from dmlbook.data_parallel import checkpoint as ckpt
from dmlbook.datasets import EXAMPLES_DIR, load_digits, shard_indices
from dmlbook.models import mlp

__all__ = [
    "ElasticConfig",
    "Timeline",
    "epoch_order",
    "rank_batch",
    "lr_for",
    "train_worker",
    "train_reference",
    "torchrun_command",
    "free_port",
    "run_agents",
    "AgentRun",
    "samples_trained",
    "AGENT_ENV",
    "ps_train_adaptive",
    "AdaptiveResult",
    "serve_elastic",
    "ServingReport",
    "Autoscaler",
    "FixedPool",
    "request_schedule",
]


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
    cuts = [len(batch) * r // world_size for r in range(world_size + 1)]
    return list(batch[cuts[rank] : cuts[rank + 1]])


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
    samples_log = open(run_dir / f"samples-g{generation}-r{rank}.jsonl", "a", buffering=1)
    # 3. Train: each global batch is re-partitioned for *this* world size.
    while epoch < config.epochs:
        order = epoch_order(len(x), config.seed, epoch)
        while position < len(order):
            idx = rank_batch(order, position, config.local_batch, rank, world)
            global_size = min(config.local_batch * world, len(order) - position)
            loss = _step(model, optimizer, x[idx], y[idx], global_size)
            step, position = step + 1, position + global_size
            samples_log.write(json.dumps([step, epoch, idx]) + "\n")
            dist.all_reduce(loss)  # the global batch's mean loss, for the curve
            if rank == 0:
                timeline.record("step", step=step, loss=loss.item(), world=world, lr=lr,
                                generation=generation)  # fmt: skip
            # where the next step starts: the next epoch once this one is used up
            after = (epoch + 1, 0) if position == len(order) else (epoch, position)
            if step % config.every == 0 or after[0] == config.epochs:
                _checkpoint(run_dir, model, optimizer, step, after, lr, timeline, rank)
            _plant_failure(config, timeline, rank, step)
            if config.step_delay:
                time.sleep(config.step_delay)
        epoch, position = epoch + 1, 0
    samples_log.close()
    result = _finish(run_dir, model, step, world, timeline) if rank == 0 else None
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


def _step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor, global_size: int):
    """One SGD step on this rank's part of a global batch; returns its share of the mean loss."""
    # sum of per-sample losses / global batch: the all-reduced SUM is the mean gradient
    loss = F.cross_entropy(model(x), y, reduction="sum") / global_size
    optimizer.zero_grad()
    loss.backward()
    average_gradients(model, algorithm="ring", divide_by=1)  # chapter 2's ring all-reduce
    optimizer.step()
    return loss.detach().reshape(1)


def _checkpoint(run_dir, model, optimizer, step, after, lr, timeline, rank) -> None:
    """Chapter 3's atomic checkpoint at ``step``; rank 0 keeps only the two newest."""
    progress, extra = ckpt.Progress(epoch=after[0], step=step), {"position": after[1], "lr": lr}
    ckpt.save(ckpt.checkpoint_path(run_dir / "checkpoints", step), model=model,
              optimizer=optimizer, progress=progress, extra=extra)  # fmt: skip
    if rank == 0:
        timeline.record("checkpoint", step=step, epoch=after[0], position=after[1])
        for old in sorted((run_dir / "checkpoints").glob("step-*.pt"))[:-2]:
            old.unlink(missing_ok=True)


def _finish(run_dir: Path, model: nn.Module, step: int, world: int, timeline) -> dict:
    """Rank 0: the test accuracy, and the final model saved atomically."""
    x_test, y_test = load_digits("test")
    result = dict(accuracy=accuracy(model, x_test, y_test), step=step, world=world)
    ckpt.atomic_save({"model": model.state_dict(), **result}, run_dir / "final.pt")
    timeline.record("end", **result)
    return result


def train_reference(config: ElasticConfig, world_size: int) -> tuple[nn.Module, list[float]]:
    """The uninterrupted run at ``world_size``, in one process: the same global batches, the same
    LR, the mean gradient computed at once. Returns the model and the loss at every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny MLP: threads only wait for each other on a busy machine
    try:
        return _train_reference(config, world_size)
    finally:
        torch.set_num_threads(threads)


def _train_reference(config: ElasticConfig, world_size: int) -> tuple[nn.Module, list[float]]:
    x, y = load_digits("train")
    model = mlp(seed=config.seed)
    lr = lr_for(world_size, base_lr=config.base_lr, base_batch=config.base_batch,
                local_batch=config.local_batch)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum)
    losses, global_batch = [], config.local_batch * world_size
    for epoch in range(config.epochs):
        order = epoch_order(len(x), config.seed, epoch)
        for start in range(0, len(order), global_batch):
            idx = order[start : start + global_batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return model, losses


# --------------------------------------------------------------------------- launching agents

SCRIPT = str(EXAMPLES_DIR / "elastic_train.py")
# torchrun's environment: a fresh store per restarted group (see _init_from_torchrun)
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
# quick rendezvous on one machine: a dead node is noticed after 1 s x 2 missed heartbeats, and
# once min_nodes are there the rendezvous waits 3 s more for latecomers (defaults: 5 s x 3, 30 s)
QUICK_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=3"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now: for a rendezvous endpoint on this machine."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(
    run_dir: str | os.PathLike,
    *script_args: str,
    nproc_per_node: int = 1,
    nnodes: str = "1:2",
    max_restarts: int = 1,
    endpoint: str | None = None,
    is_host: bool | None = None,
    rdzv_conf: str = QUICK_RDZV,
    job: str = "elastic",
    local_addr: str | None = None,
) -> list[str]:
    """The torchrun command line of one node (agent) running examples/elastic_train.py.

    ``endpoint=None`` is ``--standalone`` (one node); otherwise ``HOST:PORT`` of the c10d
    rendezvous, which the node with ``is_host`` serves (on real machines torchrun tells that from
    the host name; on one machine we must say which agent it is).
    """
    cmd = ["torchrun", "--nproc-per-node", str(nproc_per_node),
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]  # fmt: skip
    if endpoint is None:
        cmd += ["--standalone"]
    else:
        conf = rdzv_conf + ("" if is_host is None else f",is_host={int(is_host)}")
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", job, "--rdzv-conf", conf.strip(",")]  # fmt: skip
        cmd += [] if local_addr is None else ["--local-addr", local_addr]
    return [*cmd, SCRIPT, str(run_dir), *script_args]


@dataclass
class AgentRun:
    """What :func:`run_agents` saw: each agent's exit code and output, and every pid involved."""

    returncodes: list[int | None]
    logs: list[str]
    seconds: float
    agent_pids: list[int]
    worker_pids: list[int]
    timed_out: bool = False  # still running at the timeout: everything was killed

    @property
    def ok(self) -> bool:
        return any(rc == 0 for rc in self.returncodes)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def run_agents(
    commands: Sequence[Sequence[str]],
    run_dir: str | os.PathLike,
    *,
    timeout: float = 120.0,
    popen: Callable[..., Any] | None = None,
    during: Callable[[], None] | None = None,
) -> AgentRun:
    """Start one torchrun agent per command (``torchrun`` runs as ``python -m
    torch.distributed.run``), wait for all, and leave no process behind, even on error.

    ``popen(i, cmd, **kwargs)`` starts agent ``i`` elsewhere (the network lab's hosts);
    ``during()`` runs while the agents do (to kill a host, say).
    """
    import subprocess
    import sys

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **AGENT_ENV)
    procs = []
    began = time.perf_counter()
    try:
        for i, cmd in enumerate(commands):
            argv = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
            kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)  # fmt: skip
            procs.append(popen(i, argv, **kwargs) if popen else subprocess.Popen(argv, **kwargs))
        logs = [""] * len(procs)

        def drain(i: int) -> None:
            logs[i] = procs[i].stdout.read()

        readers = [
            threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))
        ]
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout
        if during is not None:
            during()
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        for p in procs:  # SIGTERM first: an agent then stops its own workers
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in _worker_pids(run_dir):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    for r in readers:
        r.join(timeout=5)
    return AgentRun([p.returncode for p in procs], logs, time.perf_counter() - began,
                    [p.pid for p in procs], _worker_pids(run_dir), timed_out)  # fmt: skip


def _worker_pids(run_dir: Path) -> list[int]:
    path = run_dir / "pids.txt"
    return [int(v) for v in path.read_text().split()] if path.exists() else []


def samples_trained(run_dir: str | os.PathLike) -> dict[int, dict]:
    """For every global step, the samples that *count*: those of the last generation that ran it
    (a step re-run after a failure replaces the lost one). ``{step: {"epoch", "generation",
    "ranks": {rank: [indices]}}}``."""
    steps: dict[int, dict] = {}
    for path in sorted(Path(run_dir).glob("samples-g*-r*.jsonl")):
        generation, rank = (int(v) for v in path.stem[len("samples-g") :].split("-r"))
        for line in path.read_text().splitlines():
            step, epoch, idx = json.loads(line)
            entry = steps.setdefault(step, {"epoch": epoch, "generation": -1, "ranks": {}})
            if generation > entry["generation"]:
                entry.update(generation=generation, ranks={})
            if generation == entry["generation"]:
                entry["ranks"][rank] = idx
    return dict(sorted(steps.items()))


# --------------------------------------------------------------------------- adaptive PS

WORK, LEAVE = 1, 2


@dataclass
class AdaptiveResult:
    """The server's view (rank 0) or a worker's view of :func:`ps_train_adaptive`."""

    rank: int
    rounds: list[int] = field(default_factory=list)  # worker: the rounds it worked in
    samples: list[list[int]] = field(default_factory=list)  # worker: its samples, per round
    members: list[list[int]] = field(default_factory=list)  # server: who worked each round
    losses: list[float] = field(default_factory=list)  # server: the global batch's mean loss
    state: dict | None = None  # server: the final model


def _check_schedule(members: Sequence[Sequence[int]], workers: int) -> None:
    if not members:
        raise ValueError("members needs at least one round")
    for r, ids in enumerate(members):
        if not ids:
            raise ValueError(f"round {r} has no worker: a parameter server needs at least one")
        if len(set(ids)) != len(ids) or not all(1 <= w <= workers for w in ids):
            raise ValueError(
                f"round {r} lists workers {list(ids)}: each must appear once and be a worker rank "
                f"in 1..{workers} (rank 0 is the server)"
            )


def ps_train_adaptive(
    model_fn: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    members: Sequence[Sequence[int]],
    global_batch: int,
    lr: float,
    seed: int = 0,
) -> AdaptiveResult:
    """A parameter server whose workers join and leave between rounds; every rank calls this.

    Rank 0 is the server, ranks 1.. the workers. ``members[r]`` lists the worker ranks of round
    ``r``. A worker waits until its first round (it has not joined yet) and returns after its last
    (it has left: its process ends). Each round the server splits the next ``global_batch``
    samples of the epoch order among the round's members, sends each its indices and the model,
    and steps with the mean of their gradients: SGD on the global batch, whoever computed it.
    """
    if not dist.is_initialized():
        raise RuntimeError("ps_train_adaptive runs on ranks: dmlbook.launch.run(fn, 1 + workers)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("ps_train_adaptive needs a server and at least one worker (world >= 2)")
    _check_schedule(members, world - 1)
    if not 1 <= global_batch <= len(x) or len(x) != len(y):
        raise ValueError(f"global_batch={global_batch} must be in 1..{len(x)} (x and y alike)")
    model = model_fn()
    params = list(model.parameters())
    result = AdaptiveResult(rank)
    if rank != 0:  # a worker: obey the server until told to leave
        while True:
            header = torch.empty(3, dtype=torch.int64)
            dist.recv(header, 0)
            kind, round_, n = header.tolist()
            if kind == LEAVE:
                return result
            idx = torch.empty(n, dtype=torch.int64)
            flat = parameters_to_vector(params).detach()
            dist.recv(idx, 0)
            dist.recv(flat, 0)
            vector_to_parameters(flat, params)
            loss = F.cross_entropy(model(x[idx]), y[idx], reduction="sum")
            model.zero_grad()
            loss.backward()
            grad = parameters_to_vector([p.grad for p in params])
            dist.send(torch.cat([grad, loss.detach().reshape(1)]), 0)
            result.rounds.append(round_)
            result.samples.append(idx.tolist())
    last_round = {w: max((r for r, ids in enumerate(members) if w in ids), default=-1)
                  for w in range(1, world)}  # fmt: skip
    for w, r in last_round.items():
        if r < 0:  # never scheduled: it leaves at once
            dist.send(torch.tensor([LEAVE, -1, 0]), w)
    epoch, position, order = 0, 0, epoch_order(len(x), seed, 0)
    for round_, ids in enumerate(members):
        if position + global_batch > len(order):  # a new epoch (the short tail is dropped)
            epoch, position = epoch + 1, 0
            order = epoch_order(len(x), seed, epoch)
        batch = order[position : position + global_batch]
        position += global_batch
        cuts = [len(batch) * i // len(ids) for i in range(len(ids) + 1)]
        flat = parameters_to_vector(params).detach()
        for i, w in enumerate(ids):
            part = torch.tensor(batch[cuts[i] : cuts[i + 1]])
            dist.send(torch.tensor([WORK, round_, len(part)]), w)
            dist.send(part, w)
            dist.send(flat, w)
        total = torch.zeros(flat.numel() + 1)
        for w in ids:
            got = torch.empty_like(total)
            dist.recv(got, w)
            total += got
        flat -= lr * total[:-1] / global_batch
        vector_to_parameters(flat, params)
        result.members.append(list(ids))
        result.losses.append(total[-1].item() / global_batch)
        for w in ids:
            if last_round[w] == round_:
                dist.send(torch.tensor([LEAVE, round_, 0]), w)
    result.state = {k: v.clone() for k, v in model.state_dict().items()}
    return result


# --------------------------------------------------------------------------- elastic serving


def _inference_worker(model: nn.Module, requests, answers, service_s: float) -> None:
    """Answer requests until a ``None`` arrives; each takes at least ``service_s`` seconds."""
    torch.set_num_threads(1)
    answers.put(("up", os.getpid(), time.time()))
    with torch.no_grad():
        while (item := requests.get()) is not None:
            request_id, features = item
            began = time.perf_counter()
            out = model(torch.from_numpy(features)).numpy()
            # stand-in for a bigger model: the request holds the worker for service_s in all
            time.sleep(max(0.0, service_s - (time.perf_counter() - began)))
            answers.put((request_id, out, os.getpid()))
    answers.put(("down", os.getpid(), time.time()))


@dataclass
class ServingReport:
    """What :func:`serve_elastic` measured."""

    sent: list[float]  # request i's submit time (seconds since start)
    latency: list[float]  # request i's seconds from submit to answer
    answers: torch.Tensor  # request i's model output, as the pool answered it
    worker_of: list[int]  # the pid that answered request i
    rate_of: list[float]  # the offered rate when request i was sent
    pool: list[tuple[float, float, int]] = field(
        default_factory=list
    )  # (t, measured rate, workers)
    started: list[float] = field(default_factory=list)  # seconds from asking to a worker being up
    pids: list[int] = field(default_factory=list)  # every worker process ever started


@dataclass(frozen=True)
class Autoscaler:
    """Every ``interval`` seconds, measure the arrival rate over the last ``window`` seconds and
    size the pool to ``ceil(rate x service_s / target_utilization)`` workers, within
    ``[min_workers, max_workers]``. Below 1, utilisation leaves headroom for bursts."""

    min_workers: int = 1
    max_workers: int = 4
    target_utilization: float = 0.7
    interval: float = 0.2
    window: float = 0.6

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}"
            )
        if not 0 < self.target_utilization <= 1 or self.interval <= 0 or self.window <= 0:
            raise ValueError("need 0 < target_utilization <= 1, and interval, window > 0")

    def workers_for(self, rate: float, service_s: float) -> int:
        """How many workers serve ``rate`` requests per second at the target utilisation."""
        want = math.ceil(rate * service_s / self.target_utilization)
        return min(self.max_workers, max(self.min_workers, want))


@dataclass(frozen=True)
class FixedPool(Autoscaler):
    """A pool that keeps ``workers`` whatever the rate: the baseline an autoscaler is measured
    against (it still records the rate it sees every ``interval``)."""

    workers: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_workers", self.workers)
        object.__setattr__(self, "max_workers", self.workers)
        super().__post_init__()

    def workers_for(self, rate: float, service_s: float) -> int:
        return self.workers


def request_schedule(phases: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(send time, offered rate)`` of every request: evenly spaced within each phase of
    ``(seconds, requests per second)``."""
    if not phases or any(s <= 0 or r <= 0 for s, r in phases):
        raise ValueError(f"phases must be (seconds > 0, rate > 0) pairs, got {list(phases)}")
    schedule, t = [], 0.0
    for seconds, rate in phases:
        schedule += [(t + i / rate, rate) for i in range(max(1, round(seconds * rate)))]
        t += seconds
    return schedule


class _WorkerPool:
    """Inference worker processes sharing one request queue; forked from a server that imported
    torch once. ``grow`` starts one, ``shrink`` asks one to stop after what it holds."""

    def __init__(self, model: nn.Module, service_s: float) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "dmlbook.models"])
        self.requests, self.answers = self.ctx.Queue(), self.ctx.Queue()
        self.model, self.service_s = model, service_s
        self.procs: list[mp.process.BaseProcess] = []
        self.asked: list[float] = []  # when each was asked for (wall clock)
        self.live = 0  # started and not yet told to stop

    def grow(self) -> None:
        args = (self.model, self.requests, self.answers, self.service_s)
        process = self.ctx.Process(target=_inference_worker, args=args)
        self.asked.append(time.time())
        process.start()
        self.procs.append(process)
        self.live += 1

    def shrink(self) -> None:
        self.requests.put(None)
        self.live -= 1

    def resize(self, want: int) -> None:
        while self.live < want:
            self.grow()
        while self.live > want:
            self.shrink()

    def close(self) -> None:
        """Stop every worker; kill any that does not stop within 5 s."""
        for _ in self.procs:
            self.requests.put(None)
        for process in self.procs:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def serve_elastic(
    model: nn.Module,
    inputs: torch.Tensor,
    phases: Sequence[tuple[float, float]],
    *,
    service_s: float = 0.02,
    scaling: Autoscaler | None = None,
) -> ServingReport:
    """Serve ``inputs`` (one request per row, cycling) at the rates ``phases`` = [(seconds,
    requests per second), ...] with a pool of worker processes sized by ``scaling``
    (:class:`Autoscaler` by default; :class:`FixedPool` never resizes). New workers are
    started, surplus ones get a stop message and finish what they hold first."""
    scaling = Autoscaler() if scaling is None else scaling
    schedule = request_schedule(phases)
    if service_s < 0:
        raise ValueError(f"need service_s >= 0, got {service_s}")
    try:  # fail here, clearly, not in every worker process
        with torch.no_grad():
            model(inputs[:1])
    except Exception as e:
        raise ValueError(
            f"the model cannot answer a request of shape {tuple(inputs[:1].shape)}: {e}"
        ) from e
    n = len(schedule)
    report = ServingReport([0.0] * n, [math.nan] * n, torch.empty(0), [0] * n,
                           [rate for _, rate in schedule])  # fmt: skip
    outputs: list[Any] = [None] * n
    up_times: dict[int, float] = {}
    pool = _WorkerPool(model.eval(), service_s)
    try:
        for _ in range(scaling.min_workers):
            pool.grow()
        while len(up_times) < scaling.min_workers:  # the first pool is warm before the clock
            _, pid, at = pool.answers.get(timeout=60)  # ("up", pid, wall time)
            up_times[pid] = at
        _send_and_collect(pool, scaling, schedule, inputs, report, outputs, up_times)
    finally:
        pool.close()
    report.answers = torch.from_numpy(np.concatenate(outputs))
    report.pids = [p.pid for p in pool.procs]
    report.started = [
        up_times[p.pid] - a
        for p, a in zip(pool.procs, pool.asked, strict=True)
        if p.pid in up_times
    ]
    return report


def _send_and_collect(pool, scaling, schedule, inputs, report, outputs, up_times) -> None:
    """Send every request on time while two threads collect the answers and resize the pool."""
    origin, lock, done = time.perf_counter(), threading.Lock(), threading.Event()
    arrivals: list[float] = []

    def collect() -> None:
        received = 0
        while received < len(schedule):
            first, second, third = pool.answers.get()
            if first == "up":  # ("up", pid, wall time)
                up_times[second] = third
            elif first != "down":  # (request id, output, pid)
                report.latency[first] = time.perf_counter() - (origin + report.sent[first])
                outputs[first], report.worker_of[first] = second, third
                received += 1
        done.set()

    def autoscale() -> None:
        while not done.is_set():
            time.sleep(scaling.interval)
            now = time.perf_counter() - origin
            with lock:
                recent = sum(1 for a in arrivals if a > now - scaling.window)
            rate = recent / min(scaling.window, max(now, 1e-9))
            pool.resize(scaling.workers_for(rate, pool.service_s))
            report.pool.append((now, rate, pool.live))

    threading.Thread(target=collect, daemon=True).start()
    scaler = threading.Thread(target=autoscale, daemon=True)
    scaler.start()
    for i, (at, _) in enumerate(schedule):
        if (delay := at - (time.perf_counter() - origin)) > 0:
            time.sleep(delay)
        report.sent[i] = time.perf_counter() - origin
        with lock:
            arrivals.append(report.sent[i])
        pool.requests.put((i, inputs[i % len(inputs)].unsqueeze(0).numpy()))
    if not done.wait(timeout=60):
        raise TimeoutError("the serving pool did not answer every request within 60 s")
    scaler.join(timeout=5)
