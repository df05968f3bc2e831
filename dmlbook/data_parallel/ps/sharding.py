"""Which slices of the flat parameter vector each server holds, and what a step moves (ch. 2)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from dmlbook.comm.groups import balanced_blocks
from dmlbook.data_parallel.ps.results import ServerResult, WorkerResult

SHARDINGS = ("flat", "tensor")


def assign_shards(sizes: Sequence[int], servers: int, loads: list[int] | None = None) -> list[int]:
    """The server that owns each tensor: largest first, each to the least-loaded server so far.

    When a tensor is placed, the least-loaded server holds at most the mean load so far, so the
    busiest server ends with at most ``sum(sizes) / servers + max(sizes)``. ``loads``: what each
    server holds already, updated in place, so that successive calls continue one partition
    (chapter 9b's :func:`~dmlbook.advanced.zero.sharded_optimizer.partition_parameters` places
    parameter group after parameter group this way).
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    load = [0] * servers if loads is None else loads
    if len(load) != servers:
        raise ValueError(f"loads has {len(load)} entries, one per server needs {servers}")
    owner = [0] * len(sizes)
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


def load_flat(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy the flat vector into the parameters (the inverse of ``parameters_to_vector``)."""
    with torch.no_grad():
        for p, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(value.view_as(p))


def take_shard(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The slices ``ranges`` of the flat vector, one after the other: a server's shard."""
    return torch.cat([flat[a:b] for a, b in ranges])


def put_shard(flat: torch.Tensor, ranges: list[tuple[int, int]], shard: torch.Tensor) -> int:
    """Write a shard back into its slices of the flat vector (the inverse of ``take_shard``)."""
    offset = 0
    for a, b in ranges:
        flat[a:b] = shard[offset : offset + b - a]
        offset += b - a
    return offset


def assemble_model(model: nn.Module, results: Sequence[ServerResult | WorkerResult]) -> nn.Module:
    """Load the servers' shards (the results of
    :func:`~dmlbook.data_parallel.ps.train_parameter_server`, in any order) into ``model``."""
    flat = parameters_to_vector(model.parameters()).detach().clone()
    covered = sum(
        put_shard(flat, r.ranges, r.shard) for r in results if isinstance(r, ServerResult)
    )
    if covered != flat.numel():
        raise ValueError(f"the servers' shards cover {covered} of {flat.numel()} parameters")
    load_flat(list(model.parameters()), flat)
    return model
