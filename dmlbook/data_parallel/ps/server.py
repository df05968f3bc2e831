"""A parameter server: one shard, gradients applied as its consistency model says (chapter 2).

:func:`server_loop` is the server chapter 2 shows. Behind it, :func:`requests` has one listening
thread per worker hand each request to the loop only once it is whole, so a worker that dies is
noticed at once (:class:`~dmlbook.data_parallel.ps.WorkerLost`)."""

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
    count_received,
    send_counted,
)
from dmlbook.data_parallel.ps.results import ServerResult, WorkerLost
from dmlbook.data_parallel.ps.sharding import take_shard


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


def run_server(
    model, rank, lr, consistency: Consistency, members, cluster: Cluster
) -> ServerResult:
    """Set up a server (its shard, one listening thread per worker), run :func:`server_loop`."""
    start = time.perf_counter()
    mine = cluster.ranges[rank]
    shard = take_shard(parameters_to_vector(model.parameters()).detach(), mine)
    result = ServerResult(rank, mine, shard, 0, [], [], Traffic(), 0.0)
    server_loop(shard, lr, consistency, requests(shard, cluster, result), cluster, result, members)
    result.seconds = time.perf_counter() - start
    return result


def server_loop(shard, lr, consistency, requests, cluster, result, members=None) -> None:
    """A server (chapter 2): apply the gradients pushed, answer the pulls the bound allows.

    ``requests`` yields (worker, kind, its clock, the version it pulled, gradient) as they come;
    ``result`` (a ServerResult) counts the updates, each gradient's staleness and the bytes.
    """
    workers = range(cluster.servers, cluster.servers + cluster.workers)
    clock = dict.fromkeys(workers, 0)  # gradients received from each worker
    waiting: dict[int, int] = {}  # worker -> clock of its pull not answered yet
    this_step: dict[int, torch.Tensor] = {}  # synchronous: this step's gradients, by worker
    for w, kind, c, pulled, grad in requests:
        if kind == PULL:
            waiting[w] = c
        elif kind == PUSH:
            clock[w] += 1
            result.staleness.append(result.updates - pulled)  # updates since its pull
            if consistency.on_arrival:  # bounded staleness, asynchronous: apply it now
                shard.add_(grad, alpha=-lr)
                result.updates += 1
            else:  # synchronous: sum the step's gradients, in worker order, once all are in
                this_step[w] = grad
                expected = list(workers) if members is None else sorted(members[result.updates])
                if sorted(this_step) == expected:
                    shard.add_(torch.stack([this_step[v] for v in expected]).sum(0), alpha=-lr)
                    result.updates, this_step = result.updates + 1, {}
                    result.members.append(expected)
        # How far ahead a pull for step c is: of the slowest worker, or, synchronous, of the last
        # update (the same without members; with them a worker that left stays behind).
        behind = min(clock.values()) if consistency.on_arrival else result.updates
        for v, c in list(waiting.items()):  # answer the pulls the bound now allows
            if c - behind <= consistency.bound:
                del waiting[v]
                result.clock_gap.append(c - behind)
                _reply(v, shard, c - behind, cluster, result)  # communication


def _reply(worker: int, shard, lead: int, cluster: Cluster, result: ServerResult) -> None:
    """Answer a pull: a header [version, how far the worker is ahead], then the shard."""
    result.timeline.append((worker, "reply", time.perf_counter()))  # the answer leaves now
    header = torch.tensor([result.updates, lead])
    send_counted(header, worker, REPLY, result.traffic, cluster.comm)
    send_counted(shard, worker, PARAMS, result.traffic, cluster.comm)


def requests(shard, cluster: Cluster, result: ServerResult):
    """Every worker's requests, in the order they arrive, until all are done: (worker, kind,
    clock, version pulled, gradient or None). One thread listens to each worker; a worker lost
    raises :class:`WorkerLost`, with the shard as it is (whole updates only)."""
    workers = range(cluster.servers, cluster.servers + cluster.workers)
    events: queue.Queue = queue.Queue()
    for w in workers:
        args = (w, shard.numel(), shard.dtype, events, cluster.comm)
        threading.Thread(target=_listen, args=args, daemon=True).start()
    pushed = dict.fromkeys(workers, 0)
    done: set[int] = set()
    while len(done) < cluster.workers:
        w, header, grad = events.get()
        kind, c, pulled = header.tolist()
        if kind == LOST:
            raise WorkerLost(
                f"parameter server {result.rank} lost worker rank {w} after {pushed[w]} "
                f"gradients (its shard holds {result.updates} whole updates): {grad}",
                w,
                result.updates,
                shard.clone(),
            )
        count_received(header, result.traffic)
        if kind in (PULL, PUSH):  # when the server takes it up
            result.timeline.append((w, "pull" if kind == PULL else "push", time.perf_counter()))
        if kind == PUSH:
            count_received(grad, result.traffic)
            pushed[w] += 1
        elif kind == DONE:
            done.add(w)
        yield w, kind, c, pulled, grad
