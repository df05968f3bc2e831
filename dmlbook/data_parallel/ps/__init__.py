"""A parameter server, from point-to-point messages: sharded, synchronous, async, bounded staleness.

Chapter 2 ("Parameter server and All-Reduce") builds its parameter server (PS) with this module.
Every rank calls :func:`train_parameter_server` inside :func:`dmlbook.launch.run` (or under
torchrun); the rank decides its role:

* ranks ``0 .. servers-1`` are **servers**. Each holds one shard of the model and applies SGD to
  it with the gradients the workers push;
* ranks ``servers .. world-1`` are **workers**. Worker ``i`` (rank ``servers + i``) pulls the
  parameters from every server, computes a gradient on its part of the global batch and pushes
  each server the slice of the gradient that server owns.

**Sharding.** The model is the flat vector ``parameters_to_vector(model.parameters())``, and each
server owns some slices of it (:func:`shard_ranges`). ``sharding="flat"`` (the default) cuts the
vector into ``servers`` equal pieces, as key-range partitioning does: the load balances to one
element. ``sharding="tensor"`` keeps every parameter tensor whole and places them with
:func:`assign_shards` (largest first, each on the least-loaded server); the busiest server then
holds at most ``total / servers + largest tensor``, so one big layer can still make a hot spot.

**Consistency.** A worker's *clock* is how many gradients it has pushed. A server answers a pull
for clock ``c`` only when ``c - slowest <= bound``, where ``slowest`` is the lowest clock of any
worker. ``train_parameter_server`` takes the consistency model as an object
(``PSConfig.consistency``, from :mod:`~dmlbook.data_parallel.ps.consistency`) that knows its
``bound`` and whether the server applies each gradient ``on_arrival``:

* ``Synchronous()`` (bulk-synchronous, the default): bound 0, and the server applies the W
  gradients of a step together, once all have arrived. This is synchronous SGD on the global
  batch: it equals single-process SGD and torch's DDP (asserted in
  tests/unit/data_parallel/test_ps.py);
* ``BoundedStaleness(k)`` (stale synchronous parallel): bound k. A worker at clock c may not run
  ahead of the slowest worker by more than k; each gradient is applied as it arrives.
  ``BoundedStaleness(0)`` is a barrier per step, yet a worker may already see some of the current
  step's gradients of faster workers;
* ``Asynchronous()``: no bound (``math.inf``), every gradient is applied on arrival, whatever its
  age.

Each worker's loss is its samples' share of the global batch's mean (summed loss / global batch),
so the server *adds* the gradients of a synchronous step (which makes their mean over the global
batch), and otherwise applies each one as it comes: W pushes move the model as far as one
synchronous step, and the three differ in staleness, not in step size. Each server records, for
every gradient, how many updates it applied between the worker's pull and that push.

**Workers that join and leave** (chapter 11). With ``members``, step ``r`` is a *round* whose
global batch (the next ``global_batch`` samples of the epoch's order) is split among the workers
``members[r]`` only; a worker waits until its first round and stops after its last. The server
steps with the sum of that round's gradients: SGD on the global batch, whoever computed it.

**Messages.** Only tensors travel, with ``torch.distributed`` send/recv (over gloo; a gloo group is
made when the default backend is NCCL). Requests are int64 headers ``[kind, clock, version]``
(pull, push, done); a push is followed by the gradient slice, a pull is answered by a header
``[version, how far the worker is ahead]`` and the shard. Nothing is unpickled off the network.
Every rank counts the bytes it sends and receives (:class:`Traffic`), so the notebook can show the
server hot spot; :func:`bytes_per_step` gives the same numbers on paper.

**A worker that dies ends the run with an error; the server never applies part of a gradient.**
Gloo's any-source receive (``recv(src=None)``) does not notice a peer that dies with nothing in
flight: it waits until the process group's timeout. A receive from a *named* source fails within
milliseconds ("Connection closed by peer"). So a server listens to each worker on a thread of its
own, as real servers keep one connection per worker, and hands a gradient to the update loop only
once all of it has arrived. When a worker is lost the server raises :class:`WorkerLost`, which
carries the shard as it was: the result of whole updates only. The run then ends:
``launch.run`` raises ``RankError`` naming the dead worker (and torchrun stops every rank when one
fails). Carrying on without the worker is elastic training, chapter 11.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dmlbook.data_parallel.ps.consistency import (
    Asynchronous,
    BoundedStaleness,
    Consistency,
    Synchronous,
    check_consistency,
)
from dmlbook.data_parallel.ps.messages import Cluster, Traffic
from dmlbook.data_parallel.ps.results import ServerResult, WorkerLost, WorkerResult, global_losses
from dmlbook.data_parallel.ps.server import requests, run_server, server_loop
from dmlbook.data_parallel.ps.sharding import (
    SHARDINGS,
    assemble_model,
    assign_shards,
    bytes_per_step,
    shard_ranges,
)
from dmlbook.data_parallel.ps.worker import pull, push, run_worker, worker_loop, worker_plan

__all__ = [
    "PSConfig",
    "Synchronous",
    "BoundedStaleness",
    "Asynchronous",
    "Consistency",
    "assign_shards",
    "shard_ranges",
    "bytes_per_step",
    "train_parameter_server",
    "assemble_model",
    "Traffic",
    "ServerResult",
    "WorkerResult",
    "WorkerLost",
    "global_losses",
    "worker_loop",
    "pull",
    "push",
    "server_loop",
    "requests",
]


@dataclass(frozen=True)
class PSConfig:
    """What fixes a parameter-server run, apart from the model, the data and the loss."""

    global_batch: int  # samples per step, summed over the workers
    lr: float  # the servers' SGD learning rate
    servers: int = 1  # ranks 0..servers-1 serve, the rest work
    epochs: int = 1
    consistency: Consistency = Synchronous()  # frozen: one shared default is safe
    seed: int = 0  # the epochs' shuffles
    sharding: str = "flat"  # "flat" (equal pieces of the flat vector) or "tensor" (whole tensors)


def train_parameter_server(
    model_fn: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    config: PSConfig,
    *,
    delay: Sequence[float] | None = None,
    loss_fn: Callable = F.cross_entropy,
    members: Sequence[Sequence[int]] | None = None,
) -> ServerResult | WorkerResult:
    """Train ``model_fn()`` on ``(x, y)`` with chapter 2's parameter server; every rank calls this.

    ``model_fn`` must build the same weights on every rank (the ``dmlbook.models`` factories take
    a seed). Workers split each epoch as :func:`~dmlbook.datasets.shard_indices` does, so
    ``consistency=Synchronous()`` equals single-process SGD with batch ``global_batch``;
    ``BoundedStaleness(k)`` and ``Asynchronous()`` let workers run ahead. ``delay`` gives each
    worker extra seconds per step, to play a straggler: a number (every step) or a list (its
    pause at step s is ``delay[w][s % len(delay[w])]``, e.g. workers that take turns to pause).
    ``members[r]`` lists the worker ranks of step ``r`` (chapter 11's workers that join and
    leave; synchronous only), instead of ``epochs``. Servers return a :class:`ServerResult`,
    workers a :class:`WorkerResult`; :func:`assemble_model` puts the model back together.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ps.train_parameter_server runs on the ranks of a process group: call it inside "
            "dmlbook.launch.run(fn, servers + workers) or under torchrun"
        )
    if not isinstance(config, PSConfig):
        raise TypeError(f"config must be a ps.PSConfig, got {type(config).__name__}")
    servers, global_batch, lr = config.servers, config.global_batch, config.lr
    epochs = config.epochs
    consistency, seed, sharding = config.consistency, config.seed, config.sharding
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_fn()
    sizes = [p.numel() for p in model.parameters()]
    _check(model, x, y, servers, world, global_batch, lr, epochs, consistency, sharding, delay)
    workers = world - servers
    if members is not None:
        _check_members(members, servers, workers, consistency, epochs)
    elif global_batch % workers:
        raise ValueError(
            f"global_batch={global_batch} must be a positive multiple of the {workers} workers"
        )
    ranges = shard_ranges(sizes, servers, sharding)
    if any(not r or r[0][0] == r[0][1] for r in ranges):
        raise ValueError(f"the {sum(sizes)} parameters leave a server empty with servers={servers}")
    # Parameter-server traffic is CPU tensors over gloo, also when the default backend is NCCL.
    comm = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    cluster = Cluster(servers=servers, workers=workers, ranges=ranges, comm=comm)
    if rank < servers:
        return run_server(model, rank, lr, consistency, members, cluster)
    plan = worker_plan(len(x), rank, global_batch, epochs, seed, members, servers, workers)
    return run_worker(model, rank, x, y, plan, config, cluster, delay=delay, loss_fn=loss_fn)


def _check_members(members, servers: int, workers: int, consistency, epochs: int) -> None:
    """Every step needs a worker, each listed once, and the rounds fix the steps."""
    if not isinstance(consistency, Synchronous) or epochs != 1:
        raise ValueError(
            f"members needs consistency=Synchronous() and no epochs "
            f"(got {consistency!r}, epochs={epochs})"
        )
    if not members:
        raise ValueError("members needs at least one round")
    for r, ids in enumerate(members):
        if not ids:
            raise ValueError(f"round {r} has no worker: a parameter server needs at least one")
        if len(set(ids)) != len(ids) or not all(servers <= w < servers + workers for w in ids):
            raise ValueError(
                f"round {r} lists workers {list(ids)}: each must appear once and be a worker "
                f"rank in {servers}..{servers + workers - 1} (ranks 0..{servers - 1} serve)"
            )


def _check(model, x, y, servers, world, global_batch, lr, epochs, consistency, sharding, delay):
    """Reject bad arguments on every rank alike, before any message: an error, never a hang."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    workers = world - servers
    if workers < 1:
        raise ValueError(
            f"no workers: world size {world} with servers={servers}; "
            f"launch servers + workers ranks (ranks {servers}.. are the workers)"
        )
    check_consistency(consistency)
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch} must be >= 1")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
    if global_batch > len(x):
        raise ValueError(f"global_batch={global_batch} is larger than the {len(x)} samples")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if delay is not None and (len(delay) != workers or not all(map(_pauses_ok, delay))):
        raise ValueError(
            f"delay needs {workers} entries (one per worker), each a number >= 0 or a non-empty "
            f"list of numbers >= 0 (its pause at step s is entry s % length), got {delay!r}"
        )
    if len({p.dtype for p in model.parameters()}) != 1:
        raise ValueError("the model's parameters must exist and share one dtype (one flat vector)")
    if next(model.buffers(), None) is not None:
        raise ValueError(
            "ps.train_parameter_server serves parameters only; "
            "this model has buffers it cannot sync"
        )


def _pauses_ok(pause) -> bool:
    """A worker's delay: seconds >= 0, or a non-empty sequence of them (a repeating pattern)."""
    numbers = [pause] if isinstance(pause, (int, float)) else pause
    return (
        isinstance(numbers, Sequence)
        and len(numbers) > 0
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in numbers)
    )
