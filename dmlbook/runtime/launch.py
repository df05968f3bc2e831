"""Run one ordinary function on N ranks: fresh local processes, or in place under torchrun.

Every chapter starts here (chapter 1 first; chapter 3 explains world size, rank and local rank).
A *rank function* is a plain function that uses ``torch.distributed``. The same function runs

* from a notebook cell, a test or a script: ``run(fn, 4)`` starts 4 processes, ships ``fn`` by
  value with cloudpickle, gives every rank an initialised process group and returns
  ``[fn's result on rank 0, ..., rank 3]``. The caller itself is never forked (forking a process
  that has run torch ops can deadlock); on Linux the ranks fork from a warm helper that has only
  imported torch (:mod:`dmlbook._zygote`; about 20x faster to start, measured), elsewhere or with
  ``DMLBOOK_START=spawn`` each is a fresh interpreter;
* under ``torchrun --nnodes N --nproc-per-node M script.py`` on many machines: ``run`` sees the
  ``RANK``/``WORLD_SIZE`` that torchrun set, initialises from the environment and calls ``fn`` in
  place. End such a script with :func:`exit_now`, as ``examples/`` do: the interpreter's teardown
  of torch can abort a rank after its work is done, and torchrun would fail the job.

Functions travel by :mod:`dmlbook._shipping`, which keeps each code object's file name and sends
the source lines of notebook cells along, so a rank's traceback shows the user's lines whatever
the installed cloudpickle does with code objects.

Failures are loud and quick: a rank that raises or dies becomes :class:`RankError` naming the rank
that failed first (with its traceback); ranks still running at ``timeout`` become
:class:`RankTimeoutError` with a stack dump of each stuck rank. Every child is gone when ``run``
returns or raises.

The warm helper leaves after a few idle minutes (:func:`set_helper_idle_timeout`) and comes back
on the next launch. The ranks rendezvous through a ``FileStore`` in the launch's private folder,
and their own sockets stay on the loopback interface (:func:`dmlbook._rank_group.rendezvous_env`):
no other user, and nothing on the network, can join or reach them through the rendezvous.

``run`` starts fresh ranks every call. For ranks that live across notebook cells (chapters 2
and 9), :class:`Ranks` (``dmlbook.launch.Ranks``, from :mod:`dmlbook.ranks`) keeps them and their
namespaces until it is closed; ``%load_ext dmlbook`` puts it behind ``%ranks`` and ``%%ranks``.
Both start, watch and stop ranks through :mod:`dmlbook._rank_group`.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dmlbook import _shipping
from dmlbook._rank_process import exit_now

__all__ = [
    "run",
    "set_helper_idle_timeout",
    "Ranks",  # noqa: F822 (imported on first use, by __getattr__ below)
    "device",
    "exit_now",
    "free_port",
    "threads_per_rank",
    "RankError",
    "RankTimeoutError",
]

BACKENDS = ("auto", "gloo", "nccl")
# After the last rank has returned its result, how long it may take to exit before it is killed.
# torch's DDP can deadlock in teardown (pytorch#56297); a finished rank must never hang the caller.
EXIT_GRACE_S = 3.0
# After the first failure, how long to wait for other ranks' error reports before killing them,
# so that the rank that failed *first* is named, not the one we happened to notice first.
FAILURE_GRACE_S = 0.3
# Set in every rank that run() starts, so that a nested run() is refused rather than mistaken for
# torchrun (the ranks also carry RANK and WORLD_SIZE).
INSIDE_RUN = "DMLBOOK_INSIDE_RUN"


class RankError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed, ``exitcode`` its exit code;
    for a rank that died without a traceback (a signal), ``stderr`` holds the last lines it wrote
    to its stderr (the message quotes the last few: gloo's reason for an abort is there)."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None, remote_traceback=""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback
        self.stderr = ""


class RankTimeoutError(TimeoutError):
    """Ranks still ran at the timeout: ``ranks`` lists them, ``stacks`` maps rank -> stack dump."""

    def __init__(self, message: str, ranks: list[int], stacks: dict[int, str]):
        super().__init__(message)
        self.ranks = ranks
        self.stacks = stacks


def device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_helper_idle_timeout(seconds: float | None) -> None:
    """How long the warm helper that forks the ranks (:mod:`dmlbook._zygote`) stays while no ranks
    live, in seconds (``float("inf")``: for ever); the next launch starts it again (1-2 s of
    importing torch). ``None`` goes back to ``$DMLBOOK_HELPER_IDLE_S``, else 5 minutes. On a class
    server a shorter time frees each idle learner's helper sooner (its memory: README, instructors).
    """
    from dmlbook import _zygote

    _zygote.set_idle_exit(seconds)


def threads_per_rank(world_size: int) -> int:
    """CPU threads each of ``world_size`` local ranks gets, so that together they fill the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def run(
    fn: Callable[..., Any],
    world_size: int | None,
    *args: Any,
    backend: str = "auto",
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results, by rank."""
    if not callable(fn):
        raise TypeError(f"run() needs a callable rank function, got {type(fn).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if os.environ.get(INSIDE_RUN):
        raise RuntimeError(
            "run() was called inside a rank that run() started; nesting is not supported"
        )
    if _under_torchrun():
        return _run_in_place(fn, world_size, args, kwargs, backend, timeout)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    return _Launch(fn, world_size, args, kwargs, _resolve_backend(backend, world_size), timeout)()


# --------------------------------------------------------------------------- backend choice


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for an address several processes must agree on before
    anyone listens (torchrun's ``--rdzv-endpoint``, ``MASTER_PORT``).

    It is taken from *below* the kernel's ephemeral range. A port from that range (what binding to
    port 0 gives) may be handed out again, a moment later, as the source port of any outgoing
    connection on the machine, before the rendezvous host has bound it; chapter 3's two-agent
    torchrun job failed that way once in a loaded ``make test`` here. Ports below the range are
    never given out that way.
    """
    low = _ephemeral_range()[0]
    candidates = random.Random().sample(range(max(1024, low - 10_000), low), 64)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # someone listens there (or did a moment ago)
            return port
    raise RuntimeError(f"no free TCP port below the ephemeral range (from {low}) on {host}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):  # not Linux: IANA's range, which BSDs and Windows use
        return 49152, 65535


def _resolve_backend(backend: str, ranks_on_this_host: int) -> str:
    """``auto`` is NCCL when every local rank can have its own GPU, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= ranks_on_this_host else "gloo"
    if backend == "nccl" and gpus < ranks_on_this_host:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_on_this_host} ranks, {gpus} GPUs"
        )
    return backend


# --------------------------------------------------------------------------- torchrun: in place


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_in_place(fn, world_size, args, kwargs, backend, timeout) -> list[Any]:
    """torchrun already started one process per rank: initialise from the env and call fn here."""
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size is not None and world_size != env_world:
        raise ValueError(
            f"run(fn, world_size={world_size}) under torchrun, which started "
            f"WORLD_SIZE={env_world} processes; pass world_size=None to take torchrun's"
        )
    initialised_here = not dist.is_initialized()
    if initialised_here:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        backend = _resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(*args, **kwargs)
        results: list[Any] = [None] * env_world
        dist.all_gather_object(results, result)  # every rank returns the full list, as run() does
        return results
    finally:
        if initialised_here:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- fresh processes


class _Launch:
    """One call of ``run``: start the ranks, stream their output, collect results or failures."""

    def __init__(self, fn, world_size, args, kwargs, backend, timeout):
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        try:
            self.payload, self.sources = _shipping.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"cannot ship the rank function or its arguments to the ranks: {e}"
            ) from e

    def __call__(self) -> list[Any]:
        from dmlbook._rank_group import RankGroup  # here: it imports this module's names

        group = RankGroup(self.world_size, self.backend, self.timeout)
        try:
            (group.workdir / "payload.pkl").write_bytes(self.payload)
            group.start(self.sources)
            return self._supervise(group)
        finally:
            group.close()

    def _supervise(self, group) -> list[Any]:
        from dmlbook._rank_group import first_failure

        deadline = time.monotonic() + self.timeout
        results: dict[int, Any] = {}
        failures: dict[int, tuple[tuple[bool, float], RankError]] = {}
        first_failure_seen = None
        while True:
            group.drain_output()
            for rank in range(self.world_size):
                if rank in results or rank in failures:
                    continue
                exited = group.exits.get(rank)  # look before the result file: a rank writes
                result_file = group.workdir / f"result{rank}.pkl"  # its result, then exits
                if result_file.exists():
                    results[rank] = _load_result(rank, result_file)
                elif exited is not None:
                    failures[rank] = group.failure(rank)
            if failures:
                first_failure_seen = first_failure_seen or time.monotonic()
                if time.monotonic() - first_failure_seen >= FAILURE_GRACE_S:
                    raise first_failure(failures.values())
            elif len(results) == self.world_size:
                group.wait_then_kill(EXIT_GRACE_S)
                return [results[r] for r in range(self.world_size)]
            elif time.monotonic() > deadline:
                stuck = [r for r in range(self.world_size) if r not in results]
                raise timeout_error(stuck, group.stack_dumps(stuck), self.timeout)
            time.sleep(0.01)


def timeout_error(stuck: list[int], stacks: dict[int, str], timeout: float, note: str = ""):
    """The :class:`RankTimeoutError` for ranks still running at ``timeout``, with their stacks."""
    body = "\n".join(f"--- rank {r} is stuck here ---\n{stacks[r]}" for r in stuck)
    message = f"ranks {stuck} still running after the {timeout:g} s timeout\n{body}"
    return RankTimeoutError(message + (f"\n{note}" if note else ""), stuck, stacks)


def _load_result(rank: int, path: Path) -> Any:
    try:
        return pickle.loads(path.read_bytes())
    except Exception as e:  # e.g. an instance of a class this process cannot import
        raise RankError(
            f"rank {rank} returned a result the caller cannot unpickle: {e}", rank
        ) from e


def __getattr__(name: str):
    # ``dmlbook.launch.Ranks``: persistent ranks (dmlbook.ranks), imported on first use.
    if name == "Ranks":
        from dmlbook.ranks import Ranks

        return Ranks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
