"""Start N rank processes and watch them: what :func:`dmlbook.launch.run` and
:class:`dmlbook.launch.Ranks` share, so that both start, report and stop ranks one way (every
chapter starts its ranks here).

A :class:`RankGroup` owns, for one launch or one interactive session:

* a private folder (mode 0700: what the ranks read first, :mod:`dmlbook.runtime.protocol`) that
  also holds the store the ranks rendezvous on: a ``FileStore``, so the rendezvous is a file only
  this user can open, outlives any rank, and costs no socket (see :func:`rendezvous_env`);
* the processes, forked from the warm helper (:mod:`dmlbook.runtime.zygote`) or spawned as fresh
  interpreters, each in a session of its own, with :func:`threads_per_rank` threads, all in a
  user and network namespace of the group's own (:mod:`dmlbook.runtime.private_net`), so that
  no other user can connect to their sockets;
* their stdout and stderr pipes, read by threads and printed marked ``[rank r]`` from the
  caller's thread; the exit of each, timed exactly;
* one socket pair per rank, the :class:`~dmlbook.runtime.protocol.Channel` every answer comes
  back on (a launch's result, a session's replies); :meth:`RankGroup.receive` waits on all of
  them at once, showing the ranks' output meanwhile.

A rank that failed becomes an exception through :mod:`dmlbook.runtime.failures`, from the report
it sent before it exited (or, if it died without one, its exit and its last lines on stderr);
:meth:`RankGroup.stack_dumps` asks stuck ranks for their Python stacks (faulthandler on SIGUSR1).
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from dmlbook.runtime import gloo_thread, private_net, protocol, zygote
from dmlbook.runtime.errors import INSIDE_RUN, START_TIMEOUT_S, RankError
from dmlbook.runtime.failures import classify_failure, readable_dump
from dmlbook.runtime.owners import Owner

# What a spawned rank runs, as ``python -c``; a forked one does the same (zygote.py): first it
# joins the run's network (while it has one thread: before torch, whose import may start some).
RANK_MAIN = (
    "from dmlbook.runtime.private_net import enter; enter(); "
    "from dmlbook.runtime.rank_process import main; main()"
)
# What makes a spawned run's network namespace (the warm helper has a process for it).
MAKE_NETWORK = "import sys; from dmlbook.runtime.private_net import make; make(int(sys.argv[1]))"
STACK_DUMP_WAIT_S = 2.0  # one wait for all the dumps (a loaded machine is slow)
# A rank that dies without a Python traceback (a signal, os._exit) is reported with the last lines
# it wrote to stderr: gloo's reason for an abort is there and nowhere else. Its pipe ends when it
# is gone; a child it started may hold the pipe open, so the wait for its last lines is bounded.
LAST_WORDS_WAIT_S = 0.5
_STDERR_KEPT = 400  # lines kept per rank: a faulthandler dump of many threads is long


_FOLDER = re.compile(r"dmlbook-(?:ranks|launch)-(?P<owner>\d+-\d+@[A-Za-z0-9._-]+)-\w+")
_swept = False


def _remove_dead_callers_folders() -> None:
    """Once per process: remove the private folders of callers that were killed before they
    could (a kernel killed with ``kill -9``), recognised by their dead owner, never by name;
    only this user's, and never a live caller's."""
    global _swept
    if _swept:
        return
    _swept = True
    root = Path(tempfile.gettempdir())
    for entry in os.scandir(root):
        found = _FOLDER.fullmatch(entry.name)
        if not (found and entry.is_dir(follow_symlinks=False)):
            continue
        owner = Owner.parse(found["owner"])
        if owner and entry.stat(follow_symlinks=False).st_uid == os.getuid() and owner.is_dead():
            shutil.rmtree(entry.path, ignore_errors=True)


def threads_per_rank(world_size: int) -> int:
    """CPU threads each of ``world_size`` local ranks gets, so that together they fill the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def resolve_backend(backend: str, ranks_on_this_host: int) -> str:
    """``auto`` is NCCL when every local rank can have its own GPU, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= ranks_on_this_host else "gloo"
    if backend == "nccl" and gpus < ranks_on_this_host:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_on_this_host} ranks, {gpus} GPUs"
        )
    return backend


class RankGroup:
    """``world_size`` rank processes with a process group each; ``close()`` kills them all."""

    def __init__(self, world_size: int, backend: str, timeout: float, serve: bool = False):
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.serve = serve  # a session's ranks serve requests; a launch's call one function
        gloo_thread.policy_from_env()  # a bad DMLBOOK_GLOO_LOOP fails here, in the caller
        self.private_net = private_net.wanted()  # so does a bad DMLBOOK_PRIVATE_NET
        self.helper = _start_helper()  # first: it may refuse (a bad setting) before we own anything
        kind = "ranks" if serve else "launch"
        try:
            _remove_dead_callers_folders()
            # mode 0700: this user's only; the name says whose it is, should the caller be killed
            self.workdir = Path(tempfile.mkdtemp(prefix=f"dmlbook-{kind}-{Owner.me().token()}-"))
        except BaseException:
            if self.helper is not None:
                self.helper.release()
            raise
        self.procs: list = []
        self.channels: list[protocol.Channel] = []  # the caller's end of each rank's channel
        self.waiting = selectors.DefaultSelector()  # the channels still open, keyed by rank
        self.reports: dict[int, dict] = {}  # rank -> the report it sent as it failed and exited
        self.unread: list[tuple[int, Any]] = []  # read, not yet returned (a Ctrl-C came)
        self.output: queue.Queue = queue.Queue()
        self.pumps: list[threading.Thread] = []
        self.stderr_pumps: dict[int, threading.Thread] = {}
        self.exits: dict[int, tuple[float, int]] = {}  # rank -> (when it exited, exit code)
        self.stderr_tail: dict[int, list[str]] = {r: [] for r in range(world_size)}

    def start(self, sources: dict[str, list[str]] | None = None) -> None:
        """Write what every rank reads first, then start them, rank 0 first, in a network
        namespace of their own (:mod:`dmlbook.runtime.private_net`) unless the kernel refuses."""
        meta = dict(
            world_size=self.world_size,
            backend=self.backend,
            timeout=self.timeout,
            store=str(self.workdir / protocol.STORE),  # the rendezvous, in the private folder
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            sources=sources or {},  # cells' lines, which IPython keeps only in memory
            parent_pid=self.helper.process.pid if self.helper else os.getpid(),
            serve=self.serve,
        )
        (self.workdir / protocol.META).write_bytes(pickle.dumps(meta))
        net = self.make_network() if self.private_net else private_net.Outcome()
        if net.refused:
            warnings.warn(private_net.exposed_warning(net.refused), RuntimeWarning, stacklevel=4)
        try:
            for rank in range(self.world_size):
                self._start(rank, net.fds)  # appends to self.procs first: close() kills each one
        finally:
            net.close()  # the ranks hold the namespaces now: they vanish with the last one

    def make_network(self) -> private_net.Outcome:
        """A new user and network namespace for this group's ranks, made by a small process of
        its own (:func:`dmlbook.runtime.private_net.make`), or why there is none."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            maker = None
            try:
                if self.helper:
                    self.helper.make_network(theirs.fileno())
                else:
                    maker = subprocess.Popen(
                        [sys.executable, "-c", MAKE_NETWORK, str(theirs.fileno())],
                        env=dict(os.environ, PYTHONPATH=_package_path()),
                        stdin=subprocess.DEVNULL,
                        pass_fds=[theirs.fileno()],
                    )
            finally:
                theirs.close()  # the maker holds the only other end: end of file if it dies
            net = private_net.receive(mine, START_TIMEOUT_S)
            if maker is not None:
                maker.wait()  # it exits once it has answered
            return net
        finally:
            mine.close()

    def _start(self, rank: int, net_fds: list[int]) -> None:
        threads = threads_per_rank(self.world_size)
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
            PYTHONPATH=_package_path(),
            **rendezvous_env(),
        )
        env[INSIDE_RUN] = "1"
        for name in ("MASTER_ADDR", "MASTER_PORT"):  # nothing listens for this rendezvous
            env.pop(name, None)
        env.pop(private_net.JOIN, None)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channels.append(protocol.Channel(mine))
        self.waiting.register(mine, selectors.EVENT_READ, rank)
        pass_fds = [theirs.fileno()]  # the rank's end of its channel comes first
        if net_fds:  # the namespaces' descriptors come last (private_net.enter)
            env[private_net.JOIN] = "1"
            pass_fds += net_fds
        argv = ["-c", str(self.workdir), str(rank)]
        try:
            if self.helper:  # forked from the warm helper, which has imported torch already
                proc = self.helper.spawn(argv, env, pass_fds)
            else:
                env[protocol.PASSED_FDS] = ",".join(map(str, pass_fds))
                proc = subprocess.Popen(
                    [sys.executable, "-c", RANK_MAIN] + argv[1:],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=pass_fds,
                    start_new_session=True,  # its own process group: killpg reaches its children
                )
        finally:
            theirs.close()  # the rank holds it now: EOF on ours when the rank is gone
        self.procs.append(proc)
        for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            pump = threading.Thread(target=self._pump, args=(rank, name, stream), daemon=True)
            pump.start()
            self.pumps.append(pump)
            if name == "stderr":
                self.stderr_pumps[rank] = pump
        threading.Thread(target=self._wait_exit, args=(rank, proc), daemon=True).start()

    def _wait_exit(self, rank: int, proc) -> None:
        # Blocks in waitpid, so the time of death is exact: a rank that dies hard is then ordered
        # before the peers whose collectives fail *because* it died.
        code = proc.wait()
        self.exits[rank] = (time.time(), code)

    def _pump(self, rank: int, name: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.output.put((rank, name, raw.decode(errors="replace").rstrip("\n")))
        stream.close()

    def receive(self, timeout: float) -> list[tuple[int, Any]]:
        """Wait up to ``timeout`` seconds for the ranks' messages, and show their output first.

        Returns ``(rank, message)`` for each rank whose channel had one (empty if none came in
        time); the message is None once that rank's end has closed: it is gone. A rank's report
        as it fails (``("error", START, report)``) is also kept for :meth:`failure`.
        """
        self.drain_output()
        ready = self.waiting.select(0 if self.unread else timeout)  # a Ctrl-C here loses nothing
        with protocol.interrupt_after():  # one that lands while reading waits until it is kept
            for key, _ in ready:
                rank = key.data
                try:
                    message = self.channels[rank].recv()
                except (OSError, EOFError, pickle.UnpicklingError):
                    message = None
                if message is None:
                    self.waiting.unregister(key.fileobj)
                elif message[:2] == ("error", protocol.START):
                    self.reports[rank] = message[2]
                self.unread.append((rank, message))
        messages, self.unread = self.unread, []  # a Ctrl-C raised above leaves them for the next
        return messages

    def drain_output(self) -> None:
        """Print what the ranks wrote to their pipes, marked with the rank, from this thread."""
        while True:
            try:
                rank, name, line = self.output.get_nowait()
            except queue.Empty:
                return
            if name == "stderr":
                self.stderr_tail[rank] = (self.stderr_tail[rank] + [line])[-_STDERR_KEPT:]
            print(f"[rank {rank}] {line}", file=sys.stderr if name == "stderr" else sys.stdout)

    def failure(self, rank: int) -> tuple[tuple[bool, float], RankError]:
        """A rank that exited without a result, as ((is it a knock-on failure, when), error): from
        the report it sent, which :meth:`receive` has read once it returns after the exit."""
        died_at, code = self.exits[rank]
        report = self.reports.get(rank)  # what it sent before it exited, if anything
        if report is None and rank in self.stderr_pumps:  # its last words are all we will have
            self.stderr_pumps[rank].join(timeout=LAST_WORDS_WAIT_S)
            self.drain_output()
        return classify_failure(rank, report, died_at, code, self.stderr_tail[rank])

    def stack_dumps(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's Python stacks, from faulthandler (SIGUSR1), with the user's source lines."""
        paths = {rank: protocol.stack_file(self.workdir, rank) for rank in ranks}
        for rank in ranks:
            paths[rank].write_text("")  # the rank appends: a session's rank may be asked again
            if self.procs[rank].poll() is None:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(
            p.exists() and p.stat().st_size > 0 for p in paths.values()
        ):
            time.sleep(0.01)
        time.sleep(0.05)  # let the last dump finish writing
        return {r: readable_dump(p.read_text() if p.exists() else "") for r, p in paths.items()}

    def wait_then_kill(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Kill every rank and anything it started (its whole process group), then reap it."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()

    def close(self) -> None:
        """Kill the ranks, print what they had left to say, remove the folder. Idempotent."""
        self.kill()
        self.waiting.close()
        for channel in self.channels:
            channel.close()
        deadline = time.monotonic() + 1.0  # the pipes close once the ranks are gone
        for pump in self.pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))
        self.drain_output()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.helper is not None:
            self.helper.release()  # its ranks are gone: the helper's idle clock starts
            self.helper = None


def _start_helper() -> zygote.Zygote | None:
    """The warm process that forks ranks (:mod:`dmlbook.runtime.zygote`), or None to spawn them."""
    if not zygote.enabled():
        return None
    try:
        return zygote.lease()  # given back in close()
    except (OSError, RuntimeError) as e:
        print(f"dmlbook.launch: starting ranks as fresh interpreters ({e})", file=sys.stderr)
        return None


def _package_path() -> str:
    """``$PYTHONPATH`` for a process we start: this package's root first."""
    package_root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))


def rendezvous_env() -> dict[str, str]:
    """What keeps local ranks' own sockets on the loopback interface.

    The rendezvous itself is a ``FileStore`` in the run's private folder. It replaced a
    ``TCPStore``, which (1) listened on every interface (``*:PORT``, whatever host it was given),
    so any user or machine that could reach the port could join the rendezvous or write into it,
    and (2) stalled one launch in ten or so for 5 s here: each ``TCPStore`` connect makes a reverse
    DNS query for ``127.0.0.1`` (strace: a PTR query for 1.0.0.127.in-addr.arpa to the resolver),
    and a lost UDP answer costs glibc's 5 s resolver timeout (``socket.getnameinfo`` on
    ``::ffff:127.0.0.1`` took 5.01 s in 6 of 300 calls here).

    Beyond the store, gloo's pairs and NCCL's bootstrap listen on the interface that these
    variables name; on one host that is loopback, never an interface the network can reach, and
    the loopback of the ranks' own network namespace (:mod:`dmlbook.runtime.private_net`), which
    no other process can reach, unless the kernel refused one. They are set for every local rank,
    whatever the caller's environment says (that would be meant for torchrun across hosts, which
    does not start ranks through here).
    """
    lo = _loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo} if lo else {}


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), None)
