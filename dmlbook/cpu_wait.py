"""Waiting for a CPU: how much of a rank's time other work on the machine took (chapters 7, 12).

A pipeline overlaps its stages only when each stage has a core of its own, which a shared machine
(a laptop, a CI runner) does not always give; a timing then says more about the other work on the
machine than about the algorithm. Linux counts, for every thread, the time it was ready to run but
waited for a CPU (the run-queue delay in /proc/<pid>/task/*/schedstat), so a notebook can tell:

- :func:`cpu_wait_s` is the seconds this process has waited so far. Chapter 7's training and
  serving loops (:mod:`dmlbook.model_parallel.pipeline_workflows`,
  :mod:`dmlbook.model_parallel.pipeline_serving`) record it beside their step times.
- :func:`cpu_wait_in_burst` and :func:`cores_are_free` ask before a timing claim is checked:
  every rank runs a one-thread compute burst at once and reports the share of it lost waiting
  for a CPU. Chapter 7 (pipelining, serving) and chapter 12 (profiling) gate their timing asserts
  on the answer.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.comm.groups import device as rank_device

__all__ = ["cores_are_free", "cpu_wait_in_burst", "cpu_wait_s"]


def cpu_wait_s() -> float:
    """Seconds this process's threads have so far spent ready to run but waiting for a CPU (the
    run-queue delay in Linux's /proc/<pid>/task/*/schedstat); 0.0 where that is not available.
    Other work on the machine shows up here: time a stage lost, not time it chose to wait."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])  # on-cpu ns, run-queue ns, time slices
    except (OSError, IndexError, ValueError):
        return 0.0
    return total / 1e9


def _thread_wait_s() -> float:
    """:func:`cpu_wait_s` for the calling thread alone: a share of its wall time is at most 1."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


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
