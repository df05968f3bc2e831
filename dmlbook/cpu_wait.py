"""Waiting for a CPU: how much of a rank's time other work on the machine took (chapters 7, 12).

A pipeline overlaps its stages only when each stage has a core of its own, which a shared machine
(a laptop, a CI runner) does not always give; a timing then says more about the other work on the
machine than about the algorithm. Linux counts, for every thread, the time it was ready to run
but waited for a CPU (the run-queue delay in ``/proc/<pid>/task/*/schedstat``), so a notebook
can tell:

- :func:`scheduler_clock` is the seconds given threads have run and waited so far, and
  :func:`cpu_wait_s` the seconds this process has waited. Chapter 7's training and
  serving loops (:mod:`dmlbook.model_parallel.pipeline_workflows`,
  :mod:`dmlbook.model_parallel.pipeline_serving`) record it beside their step times.
- :func:`cpu_wait_in_burst` and :func:`cores_are_free` ask before a timing claim is checked:
  every rank runs a one-thread compute burst at once and reports the share of it lost waiting
  for a CPU. Chapter 7 (pipelining, serving) and chapter 12 (profiling) gate their timing asserts
  on the answer.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.comm.groups import device as rank_device

__all__ = [
    "cores_are_free",
    "cpu_wait_in_burst",
    "cpu_wait_s",
    "scheduler_clock",
    "thread_cpu_wait_s",
]


def scheduler_clock(threads=None) -> tuple[float, float]:
    """Seconds the given threads (ids; all of this process's by default) have so far spent on a
    CPU, and ready to run but waiting for one: Linux's /proc/self/task/<tid>/schedstat, summed.
    (0.0, 0.0) where that is not available; a thread that has ended counts nothing. Chapter 4
    reads it for gloo's transport thread and the rank's own."""
    on = waiting = 0
    try:
        tids = os.listdir("/proc/self/task") if threads is None else threads
    except OSError:
        return 0.0, 0.0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]  # on-cpu ns, run-queue ns, time slices
        except (OSError, ValueError):
            continue
        on, waiting = on + int(ran), waiting + int(waited)
    return on / 1e9, waiting / 1e9


def cpu_wait_s() -> float:
    """Seconds this process's threads have so far spent ready to run but waiting for a CPU (the
    run-queue delay in Linux's ``/proc/<pid>/task/*/schedstat``); 0.0 where that is not available.
    Other work on the machine shows up here: time a stage lost, not time it chose to wait."""
    return scheduler_clock()[1]


def _thread_wait_s() -> float:
    """:func:`cpu_wait_s` for the calling thread alone: a share of its wall time is at most 1."""
    return scheduler_clock([threading.get_native_id()])[1]


def thread_cpu_wait_s() -> float:
    """:func:`cpu_wait_s` for the calling thread alone (chapter 6 sets it beside each forward a
    stage runs on that thread): what other work on the machine took from this thread's work."""
    return _thread_wait_s()


def cpu_wait_in_burst(seconds: float = 0.3, group: dist.ProcessGroup | None = None) -> float:
    """Every rank of ``group`` runs a one-thread matrix-multiply burst at the same time; returns
    the largest share of the burst (0 to 1) any rank's thread spent ready to run but without a
    CPU (see :func:`cpu_wait_s`). About 0.0-0.05 when each rank has a core of its own; more
    when other work shares the cores, and then any timing of a pipeline's overlap says little."""
    _, size = group_rank_size(group)
    a = torch.randn(256, 256)
    barrier(group)
    waited, start = _thread_wait_s(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
    share = torch.tensor(
        [(_thread_wait_s() - waited) / (time.perf_counter() - start)], device=rank_device()
    )
    if size > 1:
        dist.all_reduce(share, op=dist.ReduceOp.MAX, group=group)
    return share.item()


def cores_are_free(threshold: float = 0.15, seconds: float = 0.3, group=None) -> bool:
    """True when no rank lost more than ``threshold`` of a compute burst waiting for a CPU."""
    return cpu_wait_in_burst(seconds, group) < threshold
