"""``run``: call one ordinary function on N ranks, fresh local processes or in place under torchrun.

The machinery behind :func:`dmlbook.launch.run` (every chapter; :mod:`dmlbook.launch` tells the
idiom). A launch ships the function (:mod:`dmlbook.runtime.shipping`), starts the ranks
(:class:`~dmlbook.runtime.rank_group.RankGroup`, in a network namespace of their own:
:mod:`dmlbook.runtime.private_net`), then waits on the ranks' channels, the socket pairs a
:class:`~dmlbook.launch.Ranks` session talks over too (:mod:`dmlbook.runtime.protocol`), and on
their exits, until every rank has sent its result, one has failed
(:mod:`dmlbook.runtime.failures` names the first) or the timeout has passed.
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

from dmlbook.runtime import errors, gloo_thread, protocol, shipping, zygote
from dmlbook.runtime.errors import (
    BACKENDS,
    INSIDE_RUN,
    RankError,
    timeout_error,
)
from dmlbook.runtime.failures import first_failure
from dmlbook.runtime.rank_group import RankGroup, resolve_backend

__all__ = ["free_port", "run", "set_helper_idle_timeout"]

WAKE_S = 0.05  # the longest wait for a message: exits and a failure's grace are checked this often


def set_helper_idle_timeout(seconds: float | None) -> None:
    """How long the warm helper that forks the ranks (:mod:`dmlbook.runtime.zygote`) stays while no
    ranks live, in seconds (``float("inf")``: for ever); the next launch starts it again (1-2 s of
    importing torch). ``None`` goes back to ``$DMLBOOK_HELPER_IDLE_S``, else 5 minutes. On a class
    server a shorter time frees each idle learner's helper sooner (its memory: README, instructors).
    """
    zygote.set_idle_exit(seconds)


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
    return _Launch(fn, world_size, args, kwargs, resolve_backend(backend, world_size), timeout)()


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
        gloo_thread.policy_from_env()  # a bad DMLBOOK_GLOO_LOOP fails before init
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        gloo_thread.follow_env()
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
            self.payload, self.sources = shipping.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"cannot ship the rank function or its arguments to the ranks: {e}"
            ) from e

    def __call__(self) -> list[Any]:
        group = RankGroup(self.world_size, self.backend, self.timeout)
        try:
            (group.workdir / protocol.PAYLOAD).write_bytes(self.payload)
            group.start(self.sources)
            return self._supervise(group)
        finally:
            group.close()

    def _supervise(self, group) -> list[Any]:
        deadline = time.monotonic() + self.timeout
        results: dict[int, Any] = {}
        failures: dict[int, tuple[tuple[bool, float], RankError]] = {}
        first_failure_seen = None
        while True:
            # Exits first: a rank sends its answer, then exits, so once its exit is seen here, the
            # wait below reads whatever it sent (its result, or the report of its failure).
            exited = set(group.exits)
            wait = min(WAKE_S, max(0.0, deadline - time.monotonic()))
            for rank, message in group.receive(wait):
                if message is not None and message[0] == "done":
                    results[rank] = _load_result(rank, message[2])
            for rank in exited - results.keys() - failures.keys():
                failures[rank] = group.failure(rank)
            if failures:
                first_failure_seen = first_failure_seen or time.monotonic()
                if time.monotonic() - first_failure_seen >= errors.FAILURE_GRACE_S:
                    raise first_failure(failures.values())
            elif len(results) == self.world_size:
                group.wait_then_kill(errors.EXIT_GRACE_S)
                return [results[r] for r in range(self.world_size)]
            elif time.monotonic() > deadline:
                stuck = [r for r in range(self.world_size) if r not in results]
                raise timeout_error(stuck, group.stack_dumps(stuck), self.timeout)


def _load_result(rank: int, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as e:  # e.g. an instance of a class this process cannot import
        raise RankError(
            f"rank {rank} returned a result the caller cannot unpickle: {e}", rank
        ) from e
