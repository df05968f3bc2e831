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
  place.

Functions travel by :mod:`dmlbook._shipping`, which keeps each code object's file name and sends
the source lines of notebook cells along, so a rank's traceback shows the user's lines whatever
the installed cloudpickle does with code objects.

Failures are loud and quick: a rank that raises or dies becomes :class:`RankError` naming the rank
that failed first (with its traceback); ranks still running at ``timeout`` become
:class:`RankTimeoutError` with a stack dump of each stuck rank. Every child is gone when ``run``
returns or raises.
"""

from __future__ import annotations

import datetime
import linecache
import math
import os
import pickle
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dmlbook import _rank_process, _shipping, _zygote

__all__ = ["run", "device", "threads_per_rank", "RankError", "RankTimeoutError"]

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
# How gloo and NCCL say that a peer went away: such a rank failed because another one did.
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote (worker|process|peer)", re.IGNORECASE
)


class RankError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed, ``exitcode`` its exit code."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None, remote_traceback=""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


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
        self.output: queue.Queue = queue.Queue()
        self.pumps: list[threading.Thread] = []
        self.exits: dict[int, tuple[float, int]] = {}  # rank -> (when it exited, exit code)
        self.stderr_tail: dict[int, list[str]] = {r: [] for r in range(world_size)}

    def __call__(self) -> list[Any]:
        self.workdir = Path(tempfile.mkdtemp(prefix="dmlbook-launch-"))
        procs: list[subprocess.Popen] = []
        self.helper = _start_helper()
        try:
            # The store lives in the caller, so the rendezvous survives any rank dying.
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
            (self.workdir / "payload.pkl").write_bytes(self.payload)
            self._write_meta(store.port)
            for rank in range(self.world_size):
                procs.append(self._start(rank, store.port))  # so that finally kills each one
            return self._supervise(procs)
        finally:
            _kill(procs)
            deadline = time.monotonic() + 1.0  # the pipes close once the ranks are gone
            for pump in self.pumps:
                pump.join(timeout=max(0.0, deadline - time.monotonic()))
            self._drain_output()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _write_meta(self, port: int) -> None:
        meta = dict(
            world_size=self.world_size,
            backend=self.backend,
            timeout=self.timeout,
            port=port,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            sources=self.sources,  # cells' lines, which IPython keeps only in memory
            parent_pid=self.helper.process.pid if self.helper else os.getpid(),
        )
        (self.workdir / "meta.pkl").write_bytes(pickle.dumps(meta))

    def _start(self, rank: int, port: int) -> subprocess.Popen:
        threads = threads_per_rank(self.world_size)
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            DMLBOOK_THREADS=str(threads),
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.world_size),
            DMLBOOK_INSIDE_RUN="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        )
        if "GLOO_SOCKET_IFNAME" not in os.environ and (lo := _loopback_interface()):
            env["GLOO_SOCKET_IFNAME"] = lo
        argv = ["-c", str(self.workdir), str(rank)]
        if self.helper:  # forked from the warm helper, which has imported torch already
            proc = self.helper.spawn(argv, env)
        else:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from dmlbook._rank_process import main; main()", *argv[1:]],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: killpg reaches its children too
            )
        for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            pump = threading.Thread(target=self._pump, args=(rank, name, stream), daemon=True)
            pump.start()
            self.pumps.append(pump)
        threading.Thread(target=self._wait_exit, args=(rank, proc), daemon=True).start()
        return proc

    def _wait_exit(self, rank: int, proc: subprocess.Popen) -> None:
        # Blocks in waitpid, so the time of death is exact: a rank that dies hard is then ordered
        # before the peers whose collectives fail *because* it died.
        code = proc.wait()
        self.exits[rank] = (time.time(), code)

    def _pump(self, rank: int, name: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.output.put((rank, name, raw.decode(errors="replace").rstrip("\n")))
        stream.close()

    def _drain_output(self) -> None:
        """Print what the ranks printed, marked with the rank, from the caller's thread."""
        while True:
            try:
                rank, name, line = self.output.get_nowait()
            except queue.Empty:
                return
            if name == "stderr":
                self.stderr_tail[rank] = (self.stderr_tail[rank] + [line])[-20:]
            print(f"[rank {rank}] {line}", file=sys.stderr if name == "stderr" else sys.stdout)

    def _supervise(self, procs: list[subprocess.Popen]) -> list[Any]:
        deadline = time.monotonic() + self.timeout
        results: dict[int, Any] = {}
        failures: dict[int, tuple[tuple[bool, float], RankError]] = {}
        first_failure_seen = None
        while True:
            self._drain_output()
            for rank in range(self.world_size):
                if rank in results or rank in failures:
                    continue
                exited = self.exits.get(rank)  # look before the result file: a rank writes
                result_file = self.workdir / f"result{rank}.pkl"  # its result, then exits
                if result_file.exists():
                    results[rank] = _load_result(rank, result_file)
                elif exited is not None:
                    failures[rank] = self._failure(rank, *exited)
            if failures:
                first_failure_seen = first_failure_seen or time.monotonic()
                if time.monotonic() - first_failure_seen >= FAILURE_GRACE_S:
                    raise _first_failure(failures.values())
            elif len(results) == self.world_size:
                _wait_then_kill(procs, EXIT_GRACE_S)
                return [results[r] for r in range(self.world_size)]
            elif time.monotonic() > deadline:
                stuck = [r for r in range(self.world_size) if r not in results]
                raise self._timeout_error(procs, stuck)
            time.sleep(0.01)

    def _failure(
        self, rank: int, died_at: float, code: int
    ) -> tuple[tuple[bool, float], RankError]:
        """A rank that exited without a result, as ((is it a knock-on failure, when), error)."""
        report_file = self.workdir / f"error{rank}.pkl"
        report = pickle.loads(report_file.read_bytes()) if report_file.exists() else None
        return _classify_failure(rank, report, died_at, code, self.stderr_tail[rank])

    def _timeout_error(self, procs, stuck: list[int]) -> RankTimeoutError:
        """Ask each stuck rank for its Python stacks (faulthandler on SIGUSR1), then report them."""
        for rank in stuck:
            if procs[rank].poll() is None:
                os.kill(procs[rank].pid, signal.SIGUSR1)
        paths = {rank: self.workdir / f"stack{rank}.txt" for rank in stuck}
        deadline = time.monotonic() + 2.0  # one wait for all the dumps (a loaded machine is slow)
        while time.monotonic() < deadline and not all(
            p.exists() and p.stat().st_size > 0 for p in paths.values()
        ):
            time.sleep(0.01)
        time.sleep(0.05)  # let the last dump finish writing
        stacks = {r: _readable_dump(p.read_text() if p.exists() else "") for r, p in paths.items()}
        body = "\n".join(f"--- rank {r} is stuck here ---\n{stacks[r]}" for r in stuck)
        return RankTimeoutError(
            f"ranks {stuck} still running after the {self.timeout:g} s timeout\n{body}",
            stuck,
            stacks,
        )


def _start_helper() -> _zygote.Zygote | None:
    """The warm process that forks ranks (:mod:`dmlbook._zygote`), or None to spawn them."""
    if not _zygote.enabled():
        return None
    try:
        return _zygote.helper()
    except (OSError, RuntimeError) as e:
        print(f"dmlbook.launch: starting ranks as fresh interpreters ({e})", file=sys.stderr)
        return None


def _classify_failure(
    rank: int, report: dict | None, died_at: float, code: int, stderr_tail: list[str]
) -> tuple[tuple[bool, float], RankError]:
    """A failed rank as ((is it a knock-on failure, when it failed), the error to raise).

    ``report`` is what the rank wrote when it raised (None if it died without a word).
    """
    if report is None:
        how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        tail = "\n".join(stderr_tail[-10:])
        message = f"rank {rank} failed first: it died with {how} and no Python traceback"
        message += f"\nLast stderr lines:\n{tail}" if tail else ""
        return (False, died_at), RankError(message, rank, code)
    error = RankError(
        f"rank {rank} failed first: {report['summary']}\n\nOn rank {rank}:\n{report['traceback']}",
        rank,
        code,
        report["traceback"],
    )
    try:
        error.__cause__ = pickle.loads(report["exception"])
    except Exception:
        pass
    return (bool(PEER_LOST.search(report["summary"])), report["time"]), error


def _first_failure(failures) -> RankError:
    """The error of the rank that failed first, knock-on failures last.

    A rank whose collective broke because a peer vanished failed as a *consequence*. It can even
    report before the caller sees the peer's death (a dying process closes its sockets before
    the kernel reports its exit), so it is named only when no other rank failed.
    """
    _, error = min(failures, key=lambda f: f[0])
    return error


def _readable_dump(dump: str) -> str:
    """Keep the user's threads and frames of a faulthandler dump, each with its source line."""
    if not dump.strip():
        return "(no stack dump: the rank did not answer SIGUSR1)"
    threads = []
    for block in dump.strip().split("\n\n"):
        if f'File "{_rank_process.__file__}", line' in block and " in watch" in block:
            continue  # the launcher's parent-watching thread
        lines = []
        for line in block.splitlines():
            m = re.match(r'\s+File "(.+)", line (\d+) in ', line)
            if m and m.group(1) in (_rank_process.__file__, _zygote.__file__, "<string>"):
                continue  # the launcher's own frames
            lines.append(line)
            if m and (src := linecache.getline(m.group(1), int(m.group(2))).strip()):
                lines.append(f"    {src}")
        threads.append("\n".join(lines))
    return "\n\n".join(threads)


def _load_result(rank: int, path: Path) -> Any:
    try:
        return pickle.loads(path.read_bytes())
    except Exception as e:  # e.g. an instance of a class this process cannot import
        raise RankError(
            f"rank {rank} returned a result the caller cannot unpickle: {e}", rank
        ) from e


def _wait_then_kill(procs: list[subprocess.Popen], grace: float) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill every rank and anything it started (its whole process group), then reap it."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), None)
