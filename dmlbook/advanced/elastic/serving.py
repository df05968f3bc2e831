"""Elastic serving: a pool of inference processes sized by an autoscaler (chapter 11)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

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
class FixedPool:
    """A pool that keeps ``workers`` whatever the rate: the baseline an autoscaler is measured
    against (it still records the rate it sees every ``interval``, over ``window``)."""

    workers: int = 2
    interval: float = 0.2
    window: float = 0.6

    def __post_init__(self) -> None:
        if self.workers < 1 or self.interval <= 0 or self.window <= 0:
            raise ValueError("need workers >= 1, and interval, window > 0")

    @property
    def min_workers(self) -> int:
        return self.workers

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
    scaling: Autoscaler | FixedPool | None = None,
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
