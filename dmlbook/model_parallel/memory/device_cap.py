"""A small device: a memory cap on one rank, past which an allocation raises OOM (chapter 5)."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from dmlbook.model_parallel.memory.estimate import format_bytes
from dmlbook.model_parallel.memory.measure import cpu_peak_bytes, make_optimizer
from dmlbook.model_parallel.memory.spec import OPTIMIZERS
from dmlbook.runtime.errors import INSIDE_RUN

# ---- A small device: a memory cap for one rank -------------------------------------------------


@contextmanager
def onednn_disabled() -> Iterator[None]:
    """CPU kernels without oneDNN, on PyTorch's own. oneDNN's bf16 kernels keep workspace of
    their own outside any tensor (as cuDNN and cuBLAS do on a GPU): a :func:`memory_cap` counts
    it, the estimator does not (chapter 5)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _set_up_a_first_step() -> None:
    """Run a tiny training step (measured, with each optimizer) so that what a first step sets up
    once, the intra-op thread pool (a stack per thread) and the modules that autograd, the
    optimizers and the profiler import lazily, is not charged to a memory cap's budget."""
    layer = nn.Linear(256, 256)
    for optimizer in OPTIMIZERS:
        opt = make_optimizer(optimizer, layer.parameters())
        cpu_peak_bytes(lambda: layer(torch.ones(1024, 256)).sum().backward())
        opt.step()


_OOM_SIGNS = ("can't allocate memory", "could not create a primitive", "bad_alloc")


@contextmanager
def memory_cap(budget_bytes: int) -> Iterator[None]:
    """Give this process only ``budget_bytes`` more memory, like a small device: an allocation
    beyond it raises ``torch.OutOfMemoryError``, as CUDA's allocator does (chapter 5).

    Linux only, and only inside a rank that :func:`dmlbook.launch.run` started, so that a
    notebook kernel is never the process that runs out. The cap is ``RLIMIT_DATA`` (the
    process's private writable memory, ``VmData``) at its current size plus the budget; glibc is
    told to map every block of 128 kB or more on its own, so that freed tensors give their
    memory back at once. (``RLIMIT_AS`` would be the obvious limit, but it counts the 64 MB that
    glibc reserves for each thread's heap when reserved, so a thread heap's memory is never
    charged: a step then "fits" in less than it uses.)
    """
    if not os.environ.get(INSIDE_RUN):
        raise RuntimeError(
            "memory_cap only runs inside a rank started by dmlbook.launch.run, never in the "
            "notebook's own process: call it from a rank function"
        )
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"memory_cap needs Linux (RLIMIT_DATA and /proc), not {sys.platform}")
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    import resource  # Unix only

    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD fixed at 128 kB: freed blocks are unmapped
    _set_up_a_first_step()
    before = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(
        resource.RLIMIT_DATA, (_proc_status("VmData") + int(budget_bytes), before[1])
    )
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, torch.OutOfMemoryError) or not (
            isinstance(error, MemoryError) or any(s in str(error) for s in _OOM_SIGNS)
        ):
            raise
        said = (str(error).splitlines() or ["(no message)"])[0]
        raise torch.OutOfMemoryError(
            f"out of memory: this rank may use {format_bytes(budget_bytes)} more "
            f"({type(error).__name__}: {said})"
        ) from error
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


def _proc_status(field_name: str) -> int:
    """A ``/proc/self/status`` memory figure, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")
