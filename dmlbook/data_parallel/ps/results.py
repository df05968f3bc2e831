"""What a parameter-server run returns: each server's shard, each worker's steps (chapter 2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dmlbook.data_parallel.ps.messages import Traffic


@dataclass
class ServerResult:
    """A server's shard after training, and what it saw."""

    rank: int
    ranges: list[tuple[int, int]]  # the slices of the flat parameter vector it holds
    shard: torch.Tensor  # their values, concatenated
    updates: int  # updates applied: steps if Synchronous(), else gradients
    staleness: list[int]  # per gradient: updates applied between its pull and its push
    clock_gap: list[int]  # per pull answered: how far that worker was ahead of the slowest
    traffic: Traffic
    seconds: float
    members: list[list[int]] = field(default_factory=list)  # sync: whose gradients made each step
    # (worker rank, "pull" | "reply" | "push", time.perf_counter()) of each request as the server
    # took it up and each answer to a pull as the server sent it: the timeline chapter 2 draws
    timeline: list[tuple[int, str, float]] = field(default_factory=list)

    def held_pulls(self) -> list[tuple[int, int, float]]:
        """The pulls this server held back: (worker rank, the worker's clock, seconds held).
        A pull answered at once is answered before the server takes up its next request; a
        held one has other requests between it and its answer."""
        held, asked, clock = [], {}, {}
        for i, (w, kind, t) in enumerate(self.timeline):
            if kind == "pull":
                asked[w] = (i, t, clock.get(w, 0))
            elif kind == "push":
                clock[w] = clock.get(w, 0) + 1
            elif kind == "reply" and w in asked:
                i0, t0, c = asked.pop(w)
                if any(k != "reply" for _, k, _ in self.timeline[i0 + 1 : i]):
                    held.append((w, c, t - t0))
        return held


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

    def record(self, step: int, samples, loss: float, clock_gap: int) -> None:
        """One step done: its global step, samples, mean loss and lead over the slowest."""
        self.steps += 1
        self.loss.append(loss)
        self.rounds.append(step)
        self.samples.append(list(samples))
        self.clock_gap.append(clock_gap)


class WorkerLost(RuntimeError):
    """A server lost a worker. ``shard`` is the server's model then: whole updates only."""

    def __init__(self, message: str, worker_rank: int, updates: int, shard: torch.Tensor):
        super().__init__(message)
        self.worker_rank, self.updates, self.shard = worker_rank, updates, shard

    def __reduce__(self):
        return type(self), (str(self), self.worker_rank, self.updates, self.shard)


def global_losses(results: Sequence[ServerResult | WorkerResult], global_batch: int) -> list:
    """The global batch's mean loss at each step, from the workers' results."""
    total: dict[int, float] = {}
    for r in results:
        if isinstance(r, WorkerResult):
            for step, loss, idx in zip(r.rounds, r.loss, r.samples, strict=True):
                total[step] = total.get(step, 0.0) + loss * len(idx) / global_batch
    return [total[step] for step in sorted(total)]
