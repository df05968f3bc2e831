"""A parameter-server worker: pull the model, compute its share of the gradient, push it (ch. 2).

:func:`worker_loop` is the worker chapter 2 shows; :func:`run_worker` sets it up (device, pauses,
timing), and :func:`worker_plan` says which samples each of its steps takes."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from dmlbook.comm.groups import balanced_blocks, device
from dmlbook.data_parallel.ps.messages import (
    DONE,
    GRADIENT,
    PARAMS,
    PULL,
    PUSH,
    REPLY,
    REQUEST,
    Cluster,
    count_received,
    send_counted,
)
from dmlbook.data_parallel.ps.results import WorkerResult
from dmlbook.data_parallel.ps.sharding import load_flat, put_shard, take_shard
from dmlbook.datasets import shard_indices


def worker_plan(samples, rank, global_batch, epochs, seed, members, servers, workers):
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


def run_worker(
    model, rank, x, y, plan, config, cluster: Cluster, *, delay, loss_fn
) -> WorkerResult:
    """Set up a worker, run :func:`worker_loop`, report. ``config`` is the run's
    :class:`~dmlbook.data_parallel.ps.PSConfig`."""
    start, me = time.perf_counter(), rank - cluster.servers
    result = WorkerResult(rank, me, steps=0)
    dev = device()
    model.to(dev)

    def pause(step: int) -> None:  # a slower machine: the same pause every step, or a pattern
        if delay:
            wait = delay[me]
            time.sleep(wait if isinstance(wait, (int, float)) else wait[step % len(wait)])

    batches = ((step, idx, x[idx].to(dev), y[idx].to(dev)) for step, idx in plan)
    worker_loop(model, batches, config.global_batch, cluster, result, loss_fn, pause)
    result.seconds = time.perf_counter() - start
    return result


def worker_loop(model, batches, global_batch, cluster, result, loss_fn, pause) -> None:
    """A worker (chapter 2): pull the model, compute its share of the gradient, push it; repeat.

    ``batches`` yields (step, sample indices, inputs, targets); ``result`` (a WorkerResult)
    records each step and counts the bytes; ``pause(step)`` plays a slow machine.
    """
    params = list(model.parameters())
    flat = parameters_to_vector(params).detach().cpu()  # the model as last pulled
    for step, idx, inputs, targets in batches:
        versions, gap = pull(flat, step, cluster, result.traffic)  # communication
        load_flat(params, flat)
        loss = loss_fn(model(inputs), targets)  # the mean over its samples
        model.zero_grad(set_to_none=True)
        (loss * len(idx) / global_batch).backward()  # its share of the global batch's mean
        pause(step)
        grad = parameters_to_vector([p.grad for p in params]).cpu()
        push(grad, step, versions, cluster, result.traffic)  # communication
        result.record(step, idx, loss.item(), gap)
    _done(cluster, result)  # tell every server: no more requests


def _done(cluster: Cluster, result: WorkerResult) -> None:
    for s in range(cluster.servers):
        send_counted(
            torch.tensor([DONE, result.steps, 0]), s, REQUEST, result.traffic, cluster.comm
        )


def push(grad, clock, versions, cluster: Cluster, traffic) -> None:
    """Send each server a request header and the slice of ``grad`` it owns."""
    pending = []
    for s in range(cluster.servers):
        header = torch.tensor([PUSH, clock, versions[s]])
        pending.append(send_counted(header, s, REQUEST, traffic, cluster.comm, wait=False))
        piece = take_shard(grad, cluster.ranges[s])
        pending.append(send_counted(piece, s, GRADIENT, traffic, cluster.comm, wait=False))
    for work in pending:
        work.wait()


def pull(flat, clock, cluster: Cluster, traffic) -> tuple[list[int], int]:
    """Fetch every server's shard into ``flat``; return their versions and this worker's gap
    (how far it is ahead of the slowest worker, as the servers saw it)."""
    ranges, comm = cluster.ranges, cluster.comm
    headers = [torch.empty(2, dtype=torch.int64) for _ in ranges]
    shards = [torch.empty(sum(b - a for a, b in r), dtype=flat.dtype) for r in ranges]
    # Post the receives before asking, so that a server's answer never waits for us.
    pending = []
    for s in range(len(ranges)):
        pending.append(dist.irecv(headers[s], s, group=comm, tag=REPLY))
        pending.append(dist.irecv(shards[s], s, group=comm, tag=PARAMS))
    for s in range(len(ranges)):
        send_counted(torch.tensor([PULL, clock, 0]), s, REQUEST, traffic, comm)
    for work in pending:
        work.wait()  # a server may hold its answer back: the staleness bound
    for s, r in enumerate(ranges):
        count_received(headers[s], traffic)
        count_received(shards[s], traffic)
        put_shard(flat, r, shards[s])
    return [int(h[0]) for h in headers], max(int(h[1]) for h in headers)
