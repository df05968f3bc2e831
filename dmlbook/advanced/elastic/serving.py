"""Elastic serving: a pool of inference processes sized by an autoscaler (chapter 11)."""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

# --------------------------------------------------------------------------- elastic serving


def _inference_worker(model_bytes: bytes, requests, answers, ready, service_s: float) -> None:
    """Answer requests until a ``None`` arrives; each holds the worker for ``service_s``."""
    torch.set_num_threads(1)
    model = torch.load(io.BytesIO(model_bytes), weights_only=False)  # a copy of its own
    ready.put(("up", os.getpid(), time.time()))
    free_at = time.monotonic()  # when this worker can begin its next request
    with torch.no_grad():
        while (item := requests.get()) is not None:
            request_id, features, sent_at = item  # sent_at: the sender's time.monotonic()
            out = model(torch.from_numpy(features)).numpy()
            # Stand-in for a bigger model on an accelerator: a request takes service_s of the
            # worker's own clock, from when it was sent or when the one before was done,
            # whichever is later. The pace holds even when a busy machine wakes us late.
            free_at = max(free_at, sent_at) + service_s
            time.sleep(max(0.0, free_at - time.monotonic()))
            answers.put((request_id, out, os.getpid()))


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

    def waiting(self, at: float) -> int:
        """The queue at time ``at``: requests sent by then and not yet answered."""
        return sum(1 for s, w in zip(self.sent, self.latency, strict=True) if s <= at < s + w)


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
        # the workers are forked from a server that imported these once: a new worker starts
        # without importing anything
        self.ctx.set_forkserver_preload(["torch", "dmlbook.models", __name__])
        # simple queues: a put writes to the pipe at once, with no feeder thread to wake
        self.requests, self.answers = self.ctx.SimpleQueue(), self.ctx.SimpleQueue()
        self.ready = self.ctx.Queue()  # ("up", pid, wall time) from each worker that started
        buffer = io.BytesIO()
        torch.save(model, buffer)  # each worker loads its own copy: nothing shared to set up
        self.model_bytes, self.service_s = buffer.getvalue(), service_s
        self.procs: list[mp.process.BaseProcess] = []
        self.asked: list[float] = []  # when each was asked for (wall clock)
        self.live = 0  # started and not yet told to stop

    def grow(self) -> None:
        args = (self.model_bytes, self.requests, self.answers, self.ready, self.service_s)
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

    def first_up(self, timeout: float = 60) -> tuple:
        """The next ("up", pid, time) a worker sends; a clear error if the workers die first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.ready.get(timeout=0.2)
            except queue.Empty:
                if self.procs and all(p.exitcode is not None for p in self.procs):
                    raise RuntimeError(
                        "the serving workers exited before they were up: run serve_elastic from a "
                        'notebook, or in a script under `if __name__ == "__main__":` (each '
                        "worker process imports the script, which must not serve again)"
                    ) from None
        raise TimeoutError(f"no serving worker was up within {timeout} s")

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
            _, pid, at = pool.first_up()  # ("up", pid, wall time)
            up_times[pid] = at
        _send_and_collect(pool, scaling, schedule, inputs, report, outputs)
    finally:
        pool.close()
    while not pool.ready.empty():  # when each later worker was up (every one has stopped)
        _, pid, at = pool.ready.get()
        up_times[pid] = at
    report.answers = torch.from_numpy(np.concatenate(outputs))
    report.pids = [p.pid for p in pool.procs]
    report.started = [
        up_times[p.pid] - a
        for p, a in zip(pool.procs, pool.asked, strict=True)
        if p.pid in up_times
    ]
    return report


def serve_side_by_side(
    model: nn.Module,
    inputs: torch.Tensor,
    phases: Sequence[tuple[float, float]],
    scalings: Sequence[Autoscaler | FixedPool],
    *,
    service_s: float = 0.02,
) -> list[ServingReport]:
    """:func:`serve_elastic` for each of ``scalings`` at the same time, each pool with its own
    copy of the traffic: the pools share the machine as it is during those seconds, so a busy
    machine slows them alike and their comparison stays fair."""
    with ThreadPoolExecutor(len(scalings)) as threads:
        runs = [threads.submit(serve_elastic, model, inputs, phases, service_s=service_s,
                               scaling=scaling) for scaling in scalings]  # fmt: skip
        return [run.result() for run in runs]


def _send_and_collect(pool, scaling, schedule, inputs, report, outputs) -> None:
    """Send every request on time while two threads collect the answers and resize the pool."""
    origin, lock, done = time.perf_counter(), threading.Lock(), threading.Event()
    arrivals: list[float] = []

    def collect() -> None:
        received = 0
        while received < len(schedule):
            request_id, output, pid = pool.answers.get()
            report.latency[request_id] = time.perf_counter() - (origin + report.sent[request_id])
            outputs[request_id], report.worker_of[request_id] = output, pid
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
        features = inputs[i % len(inputs)].unsqueeze(0).numpy()
        pool.requests.put((i, features, time.monotonic()))
    if not done.wait(timeout=60):
        raise TimeoutError("the serving pool did not answer every request within 60 s")
    scaler.join(timeout=5)
