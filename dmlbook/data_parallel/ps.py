"""A parameter server, from point-to-point messages: sharded, synchronous, async, bounded staleness.

Chapter 2 ("Parameter server and All-Reduce") builds its parameter server (PS) with this module.
Every rank calls :func:`train` inside :func:`dmlbook.launch.run` (or under torchrun); the rank
decides its role:

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
worker:

* ``mode="sync"`` (bulk-synchronous): bound 0, and the server applies the *average* of the W
  gradients of a step at once. This is synchronous SGD on the global batch: it equals
  single-process SGD and torch's DDP (asserted in tests/test_ps.py);
* ``mode="ssp"`` (stale synchronous parallel, bounded staleness): bound ``staleness`` = k. A worker
  at clock c may not run ahead of the slowest worker by more than k; each gradient is applied as
  it arrives. k = 0 is a barrier per step, yet a worker may already see some of the current step's
  gradients of faster workers;
* ``mode="async"``: no bound, every gradient is applied on arrival, whatever its age.

Each worker's loss is its samples' share of the global batch's mean (summed loss / global batch),
so the server *adds* the gradients of a synchronous step, and in ssp and async applies each one
as it comes: W pushes move the model as far as one synchronous step, and the modes differ in
staleness, not in step size. Each server records, for every gradient, how many updates it
applied between the worker's pull and that push.

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
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from dmlbook.comm.groups import balanced_blocks
from dmlbook.datasets import shard_indices
from dmlbook.launch import device

__all__ = [
    "assign_shards",
    "shard_ranges",
    "bytes_per_step",
    "train",
    "assemble_model",
    "Traffic",
    "ServerResult",
    "WorkerResult",
    "WorkerLost",
    "global_losses",
]

MODES = ("sync", "ssp", "async")
SHARDINGS = ("flat", "tensor")
PULL, PUSH, DONE, LOST = 0, 1, 2, 3  # request kinds (LOST only on a server's event queue)
REQUEST, GRADIENT, REPLY, PARAMS = 1, 2, 3, 4  # message tags: one stream of each kind per pair


# --------------------------------------------------------------------------- sharding


def assign_shards(sizes: Sequence[int], servers: int) -> list[int]:
    """The server that owns each tensor: largest first, each to the least-loaded server so far.

    When a tensor is placed, the least-loaded server holds at most the mean load so far, so the
    busiest server ends with at most ``sum(sizes) / servers + max(sizes)``.
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    load, owner = [0] * servers, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties in model order
        s = min(range(servers), key=load.__getitem__)  # least loaded; lowest index on ties
        owner[i], load[s] = s, load[s] + sizes[i]
    return owner


def shard_ranges(
    sizes: Sequence[int], servers: int, sharding: str = "flat"
) -> list[list[tuple[int, int]]]:
    """For each server, the ``(start, stop)`` slices of the flat parameter vector it holds."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if sharding == "flat":
        return [[block] for block in balanced_blocks(sum(sizes), servers)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    owner = assign_shards(sizes, servers)
    return [
        [(starts[i], starts[i] + sizes[i]) for i in range(len(sizes)) if owner[i] == s]
        for s in range(servers)
    ]


def bytes_per_step(model_bytes: int, servers: int, workers: int) -> dict[str, float]:
    """Payload bytes one synchronous step moves per rank, the model split evenly over the servers.

    A worker sends a whole gradient and receives the whole model, whatever ``servers`` is. A server
    receives a shard from each worker and sends its shard to each: ``workers / servers`` models
    each way. With one server that is W times a worker's traffic, on one rank (the hot spot);
    ring all-reduce sends ``2 (p - 1) / p`` models per rank.
    """
    return {
        "worker_sent": model_bytes,
        "worker_received": model_bytes,
        "server_sent": workers * model_bytes / servers,
        "server_received": workers * model_bytes / servers,
    }


# --------------------------------------------------------------------------- results


@dataclass
class Traffic:
    """Bytes this rank put on and took off the wire: tensor payloads and int64 headers."""

    payload_sent: int = 0
    payload_received: int = 0
    header_sent: int = 0
    header_received: int = 0

    @property
    def sent(self) -> int:
        return self.payload_sent + self.header_sent

    @property
    def received(self) -> int:
        return self.payload_received + self.header_received


@dataclass
class ServerResult:
    """A server's shard after training, and what it saw."""

    rank: int
    ranges: list[tuple[int, int]]  # the slices of the flat parameter vector it holds
    shard: torch.Tensor  # their values, concatenated
    updates: int  # how many updates it applied (steps in sync mode, gradients otherwise)
    staleness: list[int]  # per gradient: updates applied between its pull and its push
    clock_gap: list[int]  # per pull answered: how far that worker was ahead of the slowest
    traffic: Traffic
    seconds: float
    members: list[list[int]] = field(default_factory=list)  # sync: whose gradients made each step


@dataclass
class WorkerResult:
    """A worker's loss per step and what it saw."""

    rank: int
    worker: int  # its index among the workers, 0 .. W-1
    steps: int
    loss: list[float] = field(default_factory=list)  # per step: the mean loss of its samples
    rounds: list[int] = field(default_factory=list)  # the global steps it worked in
    samples: list[list[int]] = field(default_factory=list)  # per step: its sample indices
    clock_gap: list[int] = field(default_factory=list)  # per step, largest over the servers
    traffic: Traffic = field(default_factory=Traffic)
    seconds: float = 0.0


class WorkerLost(RuntimeError):
    """A server lost a worker. ``shard`` is the server's model then: whole updates only."""

    def __init__(self, message: str, worker_rank: int, updates: int, shard: torch.Tensor):
        super().__init__(message)
        self.worker_rank, self.updates, self.shard = worker_rank, updates, shard

    def __reduce__(self):
        return type(self), (str(self), self.worker_rank, self.updates, self.shard)


# --------------------------------------------------------------------------- training


def train(
    model_fn: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    servers: int = 1,
    global_batch: int,
    lr: float,
    epochs: int = 1,
    mode: str = "sync",
    staleness: int = 0,
    seed: int = 0,
    sharding: str = "flat",
    delay: Sequence[float] | None = None,
    loss_fn: Callable = F.cross_entropy,
    members: Sequence[Sequence[int]] | None = None,
) -> ServerResult | WorkerResult:
    """Train ``model_fn()`` on ``(x, y)`` with chapter 2's parameter server; every rank calls this.

    ``model_fn`` must build the same weights on every rank (the ``dmlbook.models`` factories take
    a seed). Workers split each epoch as :func:`~dmlbook.datasets.shard_indices` does, so
    ``mode="sync"`` equals single-process SGD with batch ``global_batch``. ``delay`` gives each
    worker extra seconds per step, to play a straggler. ``members[r]`` lists the worker ranks of
    step ``r`` (chapter 11's workers that join and leave; sync only), instead of ``epochs``.
    Servers return a :class:`ServerResult`, workers a :class:`WorkerResult`;
    :func:`assemble_model` puts the model back together.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ps.train runs on the ranks of a process group: call it inside "
            "dmlbook.launch.run(fn, servers + workers) or under torchrun"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_fn()
    sizes = [p.numel() for p in model.parameters()]
    _check(model, x, y, servers, world, global_batch, lr, epochs, mode, staleness, sharding, delay)
    workers = world - servers
    if members is not None:
        _check_members(members, servers, workers, mode, epochs)
    elif global_batch % workers:
        raise ValueError(
            f"global_batch={global_batch} must be a positive multiple of the {workers} workers"
        )
    ranges = shard_ranges(sizes, servers, sharding)
    if any(not r or r[0][0] == r[0][1] for r in ranges):
        raise ValueError(f"the {sum(sizes)} parameters leave a server empty with servers={servers}")
    # Parameter-server traffic is CPU tensors over gloo, also when the default backend is NCCL.
    comm = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    cfg = dict(servers=servers, workers=workers, ranges=ranges, comm=comm)
    if rank < servers:
        bound = {"sync": 0, "ssp": staleness, "async": math.inf}[mode]
        return _serve(model, rank, lr, mode, bound, members, **cfg)
    plan = _plan(len(x), rank, global_batch, epochs, seed, members, servers, workers)
    return _work(model, rank, x, y, plan, global_batch, delay, loss_fn, **cfg)


def _check_members(members, servers: int, workers: int, mode: str, epochs: int) -> None:
    """Every step needs a worker, each listed once, and the rounds fix the steps."""
    if mode != "sync" or epochs != 1:
        raise ValueError(f"members needs mode='sync' and no epochs (got {mode!r}, {epochs})")
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


def _plan(samples, rank, global_batch, epochs, seed, members, servers, workers):
    """This worker's steps: (global step, its sample indices), in order.

    Without ``members`` every worker works every step, on its strided share of the epoch
    (:func:`~dmlbook.datasets.shard_indices`). With them, round r's global batch is the next
    ``global_batch`` samples of the epoch's order (a short tail starts the next epoch), cut
    among the round's workers."""
    me = rank - servers
    if members is None:
        local, per_epoch = global_batch // workers, samples // global_batch
        for epoch in range(epochs):
            shard = shard_indices(samples, me, workers, shuffle=True, seed=seed, epoch=epoch)
            for t in range(per_epoch):
                yield epoch * per_epoch + t, shard[t * local : (t + 1) * local]
        return
    per_epoch = samples // global_batch
    for r, ids in enumerate(members):
        if rank in ids:
            epoch, t = divmod(r, per_epoch)
            order = shard_indices(samples, 0, 1, shuffle=True, seed=seed, epoch=epoch)
            batch = order[t * global_batch : (t + 1) * global_batch]
            start, stop = balanced_blocks(len(batch), len(ids))[list(ids).index(rank)]
            yield r, batch[start:stop]


def global_losses(results: Sequence[ServerResult | WorkerResult], global_batch: int) -> list:
    """The global batch's mean loss at each step, from the workers' results."""
    total: dict[int, float] = {}
    for r in results:
        if isinstance(r, WorkerResult):
            for step, loss, idx in zip(r.rounds, r.loss, r.samples, strict=True):
                total[step] = total.get(step, 0.0) + loss * len(idx) / global_batch
    return [total[step] for step in sorted(total)]


def _check(model, x, y, servers, world, global_batch, lr, epochs, mode, staleness, sharding, delay):
    """Reject bad arguments on every rank alike, before any message: an error, never a hang."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    workers = world - servers
    if workers < 1:
        raise ValueError(
            f"no workers: world size {world} with servers={servers}; "
            f"launch servers + workers ranks (ranks {servers}.. are the workers)"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
    if staleness and mode != "ssp":
        raise ValueError(f"staleness={staleness} needs mode='ssp' (mode is {mode!r})")
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
    if delay is not None and (len(delay) != workers or min(delay) < 0):
        raise ValueError(f"delay needs {workers} numbers >= 0 (one per worker), got {delay!r}")
    if len({p.dtype for p in model.parameters()}) != 1:
        raise ValueError("the model's parameters must exist and share one dtype (one flat vector)")
    if next(model.buffers(), None) is not None:
        raise ValueError("ps.train serves parameters only; this model has buffers it cannot sync")


def _send(t: torch.Tensor, dst: int, tag: int, traffic: Traffic, comm, wait=True):
    """Send ``t`` to ``dst``, counting its bytes; return the request if ``wait`` is False."""
    size = t.numel() * t.element_size()
    if t.dtype == torch.int64:
        traffic.header_sent += size
    else:
        traffic.payload_sent += size
    work = dist.isend(t, dst, group=comm, tag=tag)
    return work.wait() if wait else work


def _count_received(t: torch.Tensor, traffic: Traffic) -> None:
    size = t.numel() * t.element_size()
    if t.dtype == torch.int64:
        traffic.header_received += size
    else:
        traffic.payload_received += size


def _load(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy the flat vector into the parameters (the inverse of ``parameters_to_vector``)."""
    with torch.no_grad():
        for p, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(value.view_as(p))


def _take(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The slices ``ranges`` of the flat vector, one after the other: a server's shard."""
    return torch.cat([flat[a:b] for a, b in ranges])


def _put(flat: torch.Tensor, ranges: list[tuple[int, int]], shard: torch.Tensor) -> int:
    """Write a shard back into its slices of the flat vector (the inverse of ``_take``)."""
    offset = 0
    for a, b in ranges:
        flat[a:b] = shard[offset : offset + b - a]
        offset += b - a
    return offset


# --------------------------------------------------------------------------- server


def _listen(worker: int, numel: int, dtype: torch.dtype, events: queue.Queue, comm) -> None:
    """Receive one worker's requests in order and queue them; a gradient only once it is whole."""
    try:
        while True:
            header = torch.empty(3, dtype=torch.int64)
            dist.recv(header, worker, group=comm, tag=REQUEST)
            grad = None
            if header[0] == PUSH:
                grad = torch.empty(numel, dtype=dtype)
                dist.recv(grad, worker, group=comm, tag=GRADIENT)  # all of it, or an error
            events.put((worker, header, grad))
            if header[0] == DONE:
                return
    except Exception as e:  # its connection broke: the worker died or failed
        events.put((worker, torch.tensor([LOST, -1, -1]), e))


def _serve(model, rank, lr, mode, bound, members, *, servers, workers, ranges, comm):
    """Hold one shard, apply pushed gradients, answer pulls when the staleness bound allows."""
    start, traffic = time.perf_counter(), Traffic()
    mine = ranges[rank]
    shard = _take(parameters_to_vector(model.parameters()).detach(), mine)
    worker_ranks = range(servers, servers + workers)
    events: queue.Queue = queue.Queue()
    for w in worker_ranks:
        args = (w, shard.numel(), shard.dtype, events, comm)
        threading.Thread(target=_listen, args=args, daemon=True).start()
    clock = dict.fromkeys(worker_ranks, 0)  # gradients received from each worker
    waiting: dict[int, int] = {}  # worker -> clock of its pull not answered yet
    step_grads: dict[int, torch.Tensor] = {}  # sync: this step's gradients, by worker
    done, updates, stale, gaps, rounds = set(), 0, [], [], []
    while len(done) < workers:
        w, header, grad = events.get()
        kind, c, pulled_version = header.tolist()
        if kind == LOST:
            raise WorkerLost(
                f"parameter server {rank} lost worker rank {w} after {clock[w]} gradients "
                f"(its shard holds {updates} whole updates): {grad}",
                w,
                updates,
                shard.clone(),
            )
        _count_received(header, traffic)
        if kind == PULL:
            waiting[w] = c
        elif kind == PUSH:
            _count_received(grad, traffic)
            clock[w] += 1
            stale.append(updates - pulled_version)
            if mode == "sync":  # add up the step's gradients, in worker order, then step
                step_grads[w] = grad
                expected = list(worker_ranks) if members is None else sorted(members[updates])
                if sorted(step_grads) == expected:
                    shard.add_(torch.stack([step_grads[v] for v in expected]).sum(0), alpha=-lr)
                    updates, step_grads = updates + 1, {}
                    rounds.append(expected)
            else:  # ssp and async: apply each gradient on arrival
                shard.add_(grad, alpha=-lr)
                updates += 1
        elif kind == DONE:
            done.add(w)
        # How far ahead a pull for step c is: of the slowest worker, or in sync of the last
        # update (the same without members; with them a worker that left stays behind).
        behind = updates if mode == "sync" else min(clock.values())
        for v, c in list(waiting.items()):  # answer the pulls the bound now allows
            if c - behind <= bound:
                del waiting[v]
                gaps.append(c - behind)
                _send(torch.tensor([updates, c - behind]), v, REPLY, traffic, comm)
                _send(shard, v, PARAMS, traffic, comm)
    seconds = time.perf_counter() - start
    return ServerResult(rank, mine, shard, updates, stale, gaps, traffic, seconds, rounds)


# --------------------------------------------------------------------------- worker


def _work(
    model, rank, x, y, plan, global_batch, delay, loss_fn, *, servers, workers, ranges, comm
) -> WorkerResult:
    """Pull the model, compute a gradient on this worker's part of the batch, push it; repeat."""
    start, me = time.perf_counter(), rank - servers
    result = WorkerResult(rank, me, steps=0)
    dev = device()
    model.to(dev)
    params = list(model.parameters())
    flat = parameters_to_vector(params).detach().cpu()  # the model as last pulled
    for step, idx in plan:
        versions, gap = _pull(flat, step, ranges, result.traffic, comm)
        _load(params, flat)
        loss = loss_fn(model(x[idx].to(dev)), y[idx].to(dev))  # the mean over its samples
        model.zero_grad(set_to_none=True)
        (loss * len(idx) / global_batch).backward()  # its share of the global batch's mean
        if delay:
            time.sleep(delay[me])  # a slower machine
        grad = parameters_to_vector([p.grad for p in params]).cpu()
        pending = []
        for s in range(servers):
            header = torch.tensor([PUSH, step, versions[s]])
            pending.append(_send(header, s, REQUEST, result.traffic, comm, wait=False))
            piece = _take(grad, ranges[s])
            pending.append(_send(piece, s, GRADIENT, result.traffic, comm, wait=False))
        for work in pending:
            work.wait()
        result.steps += 1
        result.loss.append(loss.item())
        result.rounds.append(step)
        result.samples.append(list(idx))
        result.clock_gap.append(gap)
    for s in range(servers):
        _send(torch.tensor([DONE, result.steps, 0]), s, REQUEST, result.traffic, comm)
    result.seconds = time.perf_counter() - start
    return result


def _pull(flat, clock, ranges, traffic, comm) -> tuple[list[int], int]:
    """Fetch every server's shard into ``flat``; return their versions and this worker's gap."""
    headers = [torch.empty(2, dtype=torch.int64) for _ in ranges]
    shards = [torch.empty(sum(b - a for a, b in r), dtype=flat.dtype) for r in ranges]
    # Post the receives before asking, so that a server's answer never waits for us.
    pending = []
    for s in range(len(ranges)):
        pending.append(dist.irecv(headers[s], s, group=comm, tag=REPLY))
        pending.append(dist.irecv(shards[s], s, group=comm, tag=PARAMS))
    for s in range(len(ranges)):
        _send(torch.tensor([PULL, clock, 0]), s, REQUEST, traffic, comm)
    for work in pending:
        work.wait()  # a server may hold its answer back: the staleness bound
    for s, r in enumerate(ranges):
        _count_received(headers[s], traffic)
        _count_received(shards[s], traffic)
        _put(flat, r, shards[s])
    return [int(h[0]) for h in headers], max(int(h[1]) for h in headers)


# --------------------------------------------------------------------------- after training


def assemble_model(model: nn.Module, results: Sequence[ServerResult | WorkerResult]) -> nn.Module:
    """Load the servers' shards (from :func:`train`'s results, in any order) into ``model``."""
    flat = parameters_to_vector(model.parameters()).detach().clone()
    covered = sum(_put(flat, r.ranges, r.shard) for r in results if isinstance(r, ServerResult))
    if covered != flat.numel():
        raise ValueError(f"the servers' shards cover {covered} of {flat.numel()} parameters")
    _load(list(model.parameters()), flat)
    return model
