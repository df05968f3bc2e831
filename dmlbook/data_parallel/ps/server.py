"""A parameter server: one shard, gradients applied as its consistency model says (chapter 2).

One listening thread per worker hands each request to the update loop only once it is whole, so a
worker that dies is noticed at once (:class:`~dmlbook.data_parallel.ps.WorkerLost`)."""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from dmlbook.data_parallel.ps.consistency import Consistency
from dmlbook.data_parallel.ps.messages import (
    DONE,
    GRADIENT,
    LOST,
    PARAMS,
    PULL,
    PUSH,
    REPLY,
    REQUEST,
    Cluster,
    Traffic,
    _count_received,
    _send,
)
from dmlbook.data_parallel.ps.results import ServerResult, WorkerLost
from dmlbook.data_parallel.ps.sharding import _take


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


def _serve(model, rank, lr, consistency: Consistency, members, cluster: Cluster) -> ServerResult:
    """Hold one shard, apply pushed gradients, answer pulls when the staleness bound allows."""
    servers, workers, ranges, comm = cluster.servers, cluster.workers, cluster.ranges, cluster.comm
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
    step_grads: dict[int, torch.Tensor] = {}  # synchronous: this step's gradients, by worker
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
            if not consistency.on_arrival:  # synchronous: sum the step's gradients in worker order
                step_grads[w] = grad
                expected = list(worker_ranks) if members is None else sorted(members[updates])
                if sorted(step_grads) == expected:
                    shard.add_(torch.stack([step_grads[v] for v in expected]).sum(0), alpha=-lr)
                    updates, step_grads = updates + 1, {}
                    rounds.append(expected)
            else:  # bounded staleness and asynchronous: apply each gradient on arrival
                shard.add_(grad, alpha=-lr)
                updates += 1
        elif kind == DONE:
            done.add(w)
        # How far ahead a pull for step c is: of the slowest worker, or, synchronous, of the last
        # update (the same without members; with them a worker that left stays behind).
        behind = min(clock.values()) if consistency.on_arrival else updates
        for v, c in list(waiting.items()):  # answer the pulls the bound now allows
            if c - behind <= consistency.bound:
                del waiting[v]
                gaps.append(c - behind)
                _send(torch.tensor([updates, c - behind]), v, REPLY, traffic, comm)
                _send(shard, v, PARAMS, traffic, comm)
    seconds = time.perf_counter() - start
    return ServerResult(rank, mine, shard, updates, stale, gaps, traffic, seconds, rounds)
