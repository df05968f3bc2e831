"""Ranks that live across notebook cells: start N once, then run code on them cell by cell.

:func:`dmlbook.launch.run` starts fresh ranks for every call, so nothing a rank builds survives
to the next cell. A :class:`Ranks` session keeps its ranks, each with its process group and its
own namespace, until it is closed. Chapter 2 walks through the collectives one at a time on
such ranks, printing what each rank holds after each one; chapter 9 cuts tensor-parallel layers
shard by shard and looks at each rank's piece. In a notebook, ``%load_ext dmlbook`` puts this
object behind ``%ranks`` and ``%%ranks`` (:mod:`dmlbook.runtime.magic`); in a script or a test::

    with Ranks(4) as ranks:
        ranks.exec("t = torch.tensor([float(rank)])")
        ranks.exec("dist.all_reduce(t)")
        ranks.pull("t")                      # [tensor([6.]), tensor([6.]), ...], by rank

Each rank's namespace starts with ``torch``, ``dist``, ``rank`` and ``world_size``. The ranks
start, rendezvous, report failures and die with the caller exactly as ``run``'s do
(:mod:`dmlbook.runtime.rank_group`); requests and answers travel over the same channel a launch's
ranks answer on, one socket pair per rank (:mod:`dmlbook.runtime.protocol`), served by
:mod:`dmlbook.runtime.rank_server`. Failures:

* a rank that raises gives :class:`~dmlbook.launch.RankError` with the cell's source line; the
  other ranks keep their state. Ranks still running are interrupted; one that waits inside a
  collective for the failed rank cannot be, and the session must be restarted (the error says so);
* a request still running at ``timeout`` gives :class:`~dmlbook.launch.RankTimeoutError` with each
  stuck rank's stack, then the same interruption;
* a rank that dies closes the session (every rank is killed); the next request raises
  :class:`RanksClosedError`, which says to ``restart()``;
* Ctrl-C (a kernel interrupt) interrupts every rank's request and keeps the ranks.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import signal
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dmlbook.runtime import errors, shipping
from dmlbook.runtime.errors import (
    BACKENDS,
    INSIDE_RUN,
    START_TIMEOUT_S,
    RankError,
    RanksClosedError,
    RankTimeoutError,
    timeout_error,
)
from dmlbook.runtime.failures import classify_failure, first_failure
from dmlbook.runtime.protocol import START
from dmlbook.runtime.rank_group import RankGroup, resolve_backend

__all__ = ["RankStatus", "Ranks"]

INTERRUPT_GRACE_S = 3.0  # how long interrupted ranks may take to answer
STREAM_AFTER_S = 1.0  # a request's output is shown rank by rank; after this long, as it comes
RESTART = "`%ranks restart` (or Ranks.restart()) starts new ones"
_cells = itertools.count(1)


@dataclass(frozen=True)
class RankStatus:
    """One rank of a session: its process, whether it runs a request, its resident memory."""

    rank: int
    pid: int
    alive: bool
    busy: bool
    rss_bytes: int | None  # None where /proc cannot say


class Ranks:
    """``world_size`` ranks that keep their process group and namespace until :meth:`close`."""

    def __init__(self, world_size: int, *, backend: str = "auto", timeout: float = 60.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if os.environ.get(INSIDE_RUN):
            raise RuntimeError("Ranks cannot be started inside a rank; nesting is not supported")
        self.world_size, self.timeout = world_size, _checked_timeout(timeout)
        self.backend = resolve_backend(backend, world_size)
        self._closed: str | None = "not started"
        self._start()

    # ------------------------------------------------------------------ the public requests

    def exec(self, source: str, *, on=None, timeout: float | None = None, filename=None) -> list:
        """Run ``source`` on each rank (``on``: some of them) in its namespace. Returns the value
        of the last line on each rank if it is an expression (else None), in rank order."""
        filename = filename or f"<rank-cell-{next(_cells)}>"
        lines = source.splitlines(True)
        shipping.install_sources({filename: lines})  # for stack dumps, and syntax errors
        compile(source, filename, "exec")  # a syntax error is the caller's, raised here
        return self._request("exec", (source, filename, lines), on, timeout)

    def call(self, fn, *args, on=None, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on each rank (``on``: some); the results, by rank."""
        if not callable(fn):
            raise TypeError(f"call() needs a callable, got {type(fn).__name__}")
        return self._request("call", _ship((fn, args, kwargs)), on, timeout)

    def push(self, values: Mapping[str, Any] | None = None, /, *, on=None, **names) -> None:
        """Set names in each rank's namespace (``on``: some): ``push(x=t)``, ``push({...})``."""
        values = {**(values or {}), **names}
        for name in values:
            if not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(f"push() sets Python names; {name!r} is not one")
        self._request("push", _ship(values), on, None)

    def pull(self, name: str, *, on=None) -> list:
        """The value of ``name`` on each rank (``on``: some), in rank order."""
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"pull() reads a Python name; {name!r} is not one")
        return self._request("pull", (name,), on, None)

    def status(self) -> list[RankStatus]:
        """Each rank: pid, alive, busy (running a request) and resident memory."""
        return [
            RankStatus(rank, proc.pid, proc.poll() is None, rank in self._busy, _rss(proc.pid))
            for rank, proc in enumerate(self._group.procs)
        ]

    def restart(self) -> None:
        """Stop the ranks (their state is lost) and start as many new ones."""
        self.close()
        self._start()

    def close(self) -> None:
        """Kill every rank and anything it started. Safe to call twice."""
        self._shut("stopped")

    @property
    def running(self) -> bool:
        return self._closed is None

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self._closed is None else self._closed.splitlines()[0]
        return f"<Ranks world_size={self.world_size} backend={self.backend}: {state}>"

    # ------------------------------------------------------------------ start and stop

    def _start(self) -> None:
        group = RankGroup(self.world_size, self.backend, self.timeout, serve=True)
        self._group, self._busy, self._next_id = group, {}, START
        # Closes the ranks when this object is collected or the interpreter exits (atexit).
        self._finalizer = weakref.finalize(self, group.close)
        try:
            group.start()
            self._closed = None
            self._busy = {rank: START for rank in range(self.world_size)}  # until each is ready
            self._collect(START, list(range(self.world_size)), START_TIMEOUT_S, "start")
        except BaseException:
            self._shut("failed to start")
            raise

    def _shut(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        self._finalizer()  # group.close(), once
        self._busy.clear()

    # ------------------------------------------------------------------ one request

    def _request(self, kind: str, body: tuple, on, timeout: float | None) -> list:
        __tracebackhide__ = True  # IPython shows the rank's traceback, not this frame
        ranks = self._targets(on)
        timeout = self.timeout if timeout is None else _checked_timeout(timeout)
        self._check_running()
        self._next_id += 1
        for rank in ranks:
            self._busy[rank] = self._next_id
            try:
                self._group.channels[rank].send((kind, self._next_id, *body))
            except OSError:
                pass  # the rank is gone: its channel's close reports that
        values = self._collect(self._next_id, ranks, timeout, kind)
        return [pickle.loads(values[rank]) for rank in ranks]

    def _collect(self, request_id: int, ranks: list[int], timeout: float, kind: str) -> dict:
        """Wait for every rank's answer, showing their output; turn failures into errors."""
        __tracebackhide__ = True  # IPython shows the rank's traceback, not this frame
        answers: dict[int, Any] = {}
        failures: dict[int, tuple] = {}
        output = _Output()
        started = time.monotonic()
        failed_at = None
        try:
            while len(answers) + len(failures) < len(ranks):
                now = time.monotonic()
                if now - started > timeout or (
                    failed_at and now - failed_at > errors.FAILURE_GRACE_S
                ):
                    break
                if self._take(request_id, answers, failures, output, timeout=0.05):
                    failed_at = failed_at or (time.monotonic() if failures else None)
                output.show(time.monotonic() - started)
        except KeyboardInterrupt:
            output.show(final=True)
            stuck = self._interrupt(request_id, ranks, answers, failures)
            raise KeyboardInterrupt(self._interrupted_note(ranks, stuck)) from None
        output.show(final=True)
        if self._group.exits or any(f is None for f in failures.values()):
            raise self._died(failures)
        pending = [r for r in ranks if r not in answers and r not in failures]
        if kind == "start" and pending and not failures:
            raise RankTimeoutError(f"ranks {pending} did not start in {timeout:g} s", pending, {})
        if failures:
            stuck = self._interrupt(request_id, pending, answers, failures)
            error = first_failure(failures.values())
            error.args = (f"{error}{self._stuck_note(stuck, 'waiting for the failed rank')}",)
            raise error
        if pending:
            stacks = self._group.stack_dumps(pending)
            stuck = self._interrupt(request_id, pending, answers, failures)
            note = self._stuck_note(stuck, "") or "They were interrupted and keep their state."
            raise timeout_error(pending, stacks, timeout, note)
        return answers

    def _take(self, request_id, answers, failures, output, timeout: float) -> bool:
        """Handle what the ranks send within ``timeout``; True if one answered this request."""
        answered = False
        for rank, message in self._group.receive(timeout):
            answered |= self._handle(rank, message, request_id, answers, failures, output)
        return answered

    def _handle(self, rank, message, request_id, answers, failures, output) -> bool:
        """One message from ``rank``; True if it answered this request."""
        if message is None:  # the rank's channel closed: it died
            failures[rank] = None
            return True
        kind, key, body = message
        if kind == "out":
            output.add(rank, key, body)
            return False
        if kind == "error" and key == START:
            return False  # it failed to start and exits: its report is the group's, its close next
        if kind == "ready" or key == request_id:
            self._busy.pop(rank, None)
            if kind in ("done", "ready"):
                answers[rank] = body if kind == "done" else pickle.dumps(None)
            else:
                failures[rank] = classify_failure(rank, body, 0.0, None, [])
            return True
        return False  # an answer to an earlier request that was given up on

    def _interrupt(self, request_id, ranks, answers, failures) -> list[int]:
        """SIGINT the ranks still running this request; the ones that did not stop in time."""
        running = [r for r in ranks if r not in answers and r not in failures]
        for rank in running:
            try:
                os.kill(self._group.procs[rank].pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        output, deadline = _Output(), time.monotonic() + INTERRUPT_GRACE_S
        try:
            while any(r not in answers and r not in failures for r in running):
                if time.monotonic() > deadline:
                    break
                self._take(request_id, answers, failures, output, timeout=0.05)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: stop waiting
        output.show(final=True)
        stuck = [r for r in running if r not in answers and r not in failures]
        if stuck:
            self._closed = (
                f"ranks {stuck} did not stop when interrupted (a rank inside a collective "
                "cannot be interrupted); their process group is out of step"
            )
        return stuck

    def _stuck_note(self, stuck: list[int], why: str) -> str:
        if not stuck:
            return ""
        why = f" ({why})" if why else ""
        return (
            f"\nRanks {stuck} are still stuck{why}: a rank inside a collective cannot be "
            f"interrupted. This session cannot run more cells; {RESTART}."
        )

    def _interrupted_note(self, ranks: list[int], stuck: list[int]) -> str:
        if stuck:
            return f"interrupted ranks {ranks}; {self._stuck_note(stuck, '').strip()}"
        return f"interrupted ranks {ranks}: each stopped its cell and keeps its state"

    def _died(self, failures: dict) -> RankError:
        """A rank died: close the session and name the rank that failed first."""
        deadline = time.monotonic() + 1.0  # a closed channel comes just before the exit code
        dead = [r for r, f in failures.items() if f is None]
        while not all(r in self._group.exits for r in dead) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._group.drain_output()
        known = [f for f in failures.values() if f is not None]
        known += [self._group.failure(r) for r in self._group.exits]
        error = first_failure(known) if known else RankError(f"ranks {dead} died", dead[0])
        self._shut(f"rank {error.rank} died")
        error.args = (f"{error}\nThe session is closed: every rank was stopped. {RESTART}.",)
        return error

    def _check_running(self) -> None:
        if self._closed is None and self._group.exits:  # a rank died between requests
            raise self._died({})
        if self._closed is not None:
            raise RanksClosedError(f"the ranks are not running ({self._closed}); {RESTART}")

    def _targets(self, on) -> list[int]:
        ranks = [on] if isinstance(on, int) else list(range(self.world_size) if on is None else on)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(
                f"on= takes distinct ranks from 0 to {self.world_size - 1}, got {on!r}"
            )
        return sorted(ranks)


class _Output:
    """A request's output, shown rank by rank in rank order: all of it at the end of a quick
    request, and, once it has run :data:`STREAM_AFTER_S`, each batch of whole lines as it comes."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], str] = {}  # (rank, stream) -> text not yet shown

    def add(self, rank: int, stream: str, text: str) -> None:
        self.held[rank, stream] = self.held.get((rank, stream), "") + text

    def show(self, elapsed: float = 0.0, final: bool = False) -> None:
        if not (final or elapsed >= STREAM_AFTER_S):
            return
        for rank, stream in sorted(self.held, key=lambda key: key[0]):
            text = self.held.pop((rank, stream))
            if not final:  # a line still being written waits for its end
                text, _, rest = text.rpartition("\n")
                if rest:
                    self.held[rank, stream] = rest
            file = sys.stderr if stream == "stderr" else sys.stdout
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=file)


def _ship(obj: Any) -> tuple[bytes, dict]:
    try:
        return shipping.dumps(obj)
    except Exception as e:
        raise TypeError(f"cannot ship this to the ranks: {e}") from e


def _checked_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
