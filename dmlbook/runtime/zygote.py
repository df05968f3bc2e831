"""A warm helper process that has imported torch once, and forks the ranks that ``run`` starts.

Starting a rank as a fresh interpreter spends 1-2 s of CPU importing torch. On a 2-core laptop
that is most of what a short notebook cell costs: 2 ranks took 1.3-2.9 s to start, 4 ranks
2.4-5.1 s, against 0.07 s and 0.13 s forked from here. So :func:`dmlbook.launch.run` keeps one
such process per caller (the name is Android's, whose app processes fork from one warm "zygote").
Every chapter's ranks start here.

* It imports torch and its distributed packages, and never runs a torch op: forking after an op
  has started OpenMP's thread pool can deadlock the child. Of dmlbook it imports only
  :mod:`dmlbook.runtime.protocol` and :mod:`dmlbook.runtime.private_net` (standard library
  only), so a rank runs the package's current source, as a freshly spawned one would: the child
  imports :mod:`dmlbook.runtime.rank_process` after the fork.
* Each rank is forked on request into a session of its own (``killpg`` reaches what it starts),
  with stdin on /dev/null and stdout and stderr on pipes that the caller made and passed over a
  Unix socket (``SCM_RIGHTS``). The caller reads them exactly as it reads a spawned rank's.
  Every rank also gets its end of its channel, on which it answers the caller, whose number it
  finds in ``$DMLBOOK_PASSED_FDS`` (:data:`protocol.PASSED_FDS`).
* The child, while it still has one thread, joins the run's own user and network namespace
  (:mod:`dmlbook.runtime.private_net`), whose descriptors the caller passed along. A small
  process that the helper forks first, before it imports torch, makes these namespaces, one
  per run, by a fork of its own (about 2 ms in all, where a fork of the helper took 30 ms); the
  helper itself stays in the caller's.
* The helper reaps its children and reports each exit code, so :class:`ForkedRank` offers the
  part of ``subprocess.Popen`` that the launcher uses: ``pid``, ``poll``, ``wait``, the streams.
* When the caller goes away, its end of the socket closes and the helper exits at once, even
  in the middle of an import (a thread of its own waits for that close and nothing else); its
  ranks see their parent gone and kill themselves, as spawned ranks do when the caller dies.
* It leaves when it has been idle (no ranks alive, none starting) for ``$DMLBOOK_HELPER_IDLE_S``
  seconds (default :data:`IDLE_EXIT_S`; :func:`dmlbook.launch.set_helper_idle_timeout` sets it
  from code), and the next launch starts a new one. A notebook kernel left open then costs its
  own memory only: on a class server, thirty kernels that each kept a helper (and its copy of
  torch's heap) would run out of memory first. The caller's side decides, under the same lock that
  hands out the helper, so a launch never meets a helper that is on its way out.

``DMLBOOK_START=spawn`` starts every rank as a fresh interpreter instead: use it when a variable
that torch reads only at import (``TORCH_LOGS``, ``TORCH_CPP_LOG_LEVEL``) must differ in the ranks.
"""

from __future__ import annotations

import math
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dmlbook.runtime import private_net
from dmlbook.runtime.errors import START_TIMEOUT_S
from dmlbook.runtime.protocol import PASSED_FDS

# Imported before the helper says it is ready (every rank needs them) ...
PRELOAD = ("torch", "torch.distributed", "numpy", "cloudpickle")
# ... and these while it is idle: torch's own packages that chapters' ranks import.
WARM_LATER = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
)
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 5  # stdout, stderr, the rank's channel, the run's user and network namespaces
IDLE_EXIT_S = 300.0  # how long the helper stays without ranks (configurable, see idle_exit_s)
IDLE_ENV = "DMLBOOK_HELPER_IDLE_S"


# --------------------------------------------------------------------------- the helper's side


def serve_forks(fd: int, makers_fd: int) -> None:
    """The helper's main loop: fork a rank per request, report each exit, stop with the caller.
    First, while it is small, it forks the process that makes each run's network namespace
    (:func:`dmlbook.runtime.private_net.serve_makers`; the caller holds the other end of
    ``makers_fd``)."""
    helper = os.getpid()
    if os.fork() == 0:
        try:
            os.close(fd)  # the caller's line to the helper: its end of file means the helper died
            private_net.serve_makers(makers_fd, helper)
        finally:
            os._exit(1)  # never returns into the helper's loop
    os.close(makers_fd)
    sock = socket.socket(fileno=fd)
    _exit_with_caller(sock)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the caller, not for us
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD makes select return
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for name in PRELOAD:
        __import__(name)
    sock.send(pickle.dumps(("ready", os.getpid())))
    warm_later = list(WARM_LATER)
    live: set[int] = set()  # ranks forked and not yet reaped
    while True:
        # Warm up only while no rank runs: an import takes the CPU the ranks are timed on (the
        # first launch's compute burst lost 48% of its time to it on an idle 2-core machine).
        warm_up = bool(warm_later) and not live
        readable, _, _ = select.select([sock, wake_r], [], [], 0 if warm_up else None)
        if wake_r in readable:
            while _read_nonblocking(wake_r):
                pass
        live -= _reap_children(sock)
        if sock in readable:
            try:
                message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            except ConnectionResetError:  # the caller left with our last reports unread
                message = b""
            if not message:  # the caller is gone
                os._exit(0)
            request_id, argv, env = pickle.loads(message)
            pid = os.fork()
            if pid == 0:
                _become_rank(argv, env, fds, close=(sock.fileno(), wake_r, wake_w))
            for f in fds:
                os.close(f)
            live.add(pid)
            sock.send(pickle.dumps(("started", request_id, pid)))
        elif not readable and warm_up:
            __import__(warm_later.pop(0))


def _exit_with_caller(sock: socket.socket) -> None:
    """Exit the moment the caller's end of ``sock`` closes. The main loop sees that only between
    imports, and one warm-up import (torch.distributed.fsdp: 1.4 s on a slow 2-core machine,
    several beside other work) kept a killed caller's helper alive past 3 s once. The thread
    waits in poll() for the hang-up alone (not POLLIN: requests do not wake it), holding no lock
    a forked rank could inherit."""
    hang_up = select.poll()
    hang_up.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP)

    def wait() -> None:
        hang_up.poll()  # blocks until the caller's end closes (EINTR is retried, PEP 475)
        os._exit(0)

    threading.Thread(target=wait, daemon=True, name="dmlbook-caller-gone").start()


def _read_nonblocking(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def _reap_children(sock: socket.socket) -> set[int]:
    """Report every rank that has exited; return their pids."""
    reaped: set[int] = set()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.add(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            sock.send(pickle.dumps(("exited", pid, code)))
        except OSError:  # the caller is gone; its ranks follow
            os._exit(0)


def _become_rank(argv: list[str], env: dict[str, str], fds: list[int], close) -> None:
    """In the forked child: become what a spawned rank (``python -c`` of
    :data:`dmlbook.runtime.rank_group.RANK_MAIN`) would have been, then run it. Never returns."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for f in close:
            os.close(f)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in (devnull, *fds[:2]):
            os.close(f)
        os.environ.clear()
        os.environ.update(env)
        os.environ[PASSED_FDS] = ",".join(map(str, fds[2:]))  # kept open, where they arrived
        private_net.enter()  # join the run's network, while we have one thread
        sys.argv = list(argv)
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        import torch.distributed as dist

        dist.set_debug_level_from_env()  # read at import; the caller may have changed it since
        from dmlbook.runtime.rank_process import main  # after the fork: the current source

        main()  # ends in os._exit
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


# --------------------------------------------------------------------------- the caller's side


class ForkedRank:
    """A rank forked by the helper: the part of ``subprocess.Popen`` that the launcher uses."""

    def __init__(self, pid: int, stdout, stderr, helper: Zygote) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._helper = helper

    def poll(self) -> int | None:
        helper = self._helper
        if self.pid in helper._exit_codes:
            self.returncode = helper._exit_codes[self.pid]
        elif not helper._alive:  # the helper died; orphaned ranks kill themselves
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._helper._changed:
            if not self._helper._changed.wait_for(lambda: self.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode


class Zygote:
    """The caller's handle on its helper process."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        makers, makers_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        )
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-c",
                "from dmlbook.runtime.zygote import serve_forks; "
                f"serve_forks({theirs.fileno()}, {makers_theirs.fileno()})",
            ],
            pass_fds=[theirs.fileno(), makers_theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the caller's terminal does not reach it
        )
        theirs.close()
        makers_theirs.close()
        self.sock, self.makers = mine, makers
        self.owner = os.getpid()
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._started: dict[int, int] = {}  # request id -> pid
        self._exit_codes: dict[int, int] = {}  # pid -> exit code (negative: killed by a signal)
        self._next_id = 0
        self._alive = True
        self._users = 0  # rank groups holding it (a lease each); it may leave only at 0
        self._idle = threading.Condition()  # guards _users and _idle_since
        self._idle_since = time.monotonic()
        ready = select.select([self.sock], [], [], START_TIMEOUT_S)[0]
        message = self.sock.recv(_MAX_MESSAGE) if ready else b""
        if not message or pickle.loads(message)[0] != "ready":
            self.close()
            raise RuntimeError("the rank helper process did not start")
        threading.Thread(target=self._listen, daemon=True, name="dmlbook-zygote").start()
        threading.Thread(target=self._leave_when_idle, daemon=True, name="dmlbook-idle").start()

    def alive(self) -> bool:
        return self._alive and self.owner == os.getpid() and self.process.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], pass_fds=()) -> ForkedRank:
        """Fork a rank that runs ``argv`` as ``python -c ...`` would, with ``env``, and with
        ``pass_fds`` open (where, ``$DMLBOOK_PASSED_FDS`` tells the rank)."""
        if len(pass_fds) > _MAX_FDS - 2:
            raise ValueError(f"at most {_MAX_FDS - 2} file descriptors beside stdout and stderr")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self._lock:
                self._next_id += 1
                request = self._next_id
                socket.send_fds(
                    self.sock, [pickle.dumps((request, argv, env))], [out_w, err_w, *pass_fds]
                )
            with self._changed:
                if (
                    not self._changed.wait_for(
                        lambda: request in self._started or not self._alive, START_TIMEOUT_S
                    )
                    or not self._alive
                ):
                    raise RuntimeError("the rank helper process stopped answering")
                pid = self._started.pop(request)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)  # the child holds the only write ends now: EOF when it exits
            os.close(err_w)
        return ForkedRank(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), self)

    def make_network(self, report_fd: int) -> None:
        """Ask for a new user and network namespace, sent back on the socket ``report_fd``
        (:func:`dmlbook.runtime.private_net.make`); a helper that is gone never answers, and the
        caller sees the end of that socket once it has closed its own copy."""
        try:
            socket.send_fds(self.makers, [b"make"], [report_fd])
        except OSError:
            pass

    def _listen(self) -> None:
        while True:
            try:
                message = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                message = b""
            with self._changed:
                if not message:  # the helper is gone, and with it every rank it forked
                    self._alive = False
                    self._changed.notify_all()
                    with self._idle:
                        self._idle.notify_all()  # its idle watch ends too
                    return
                kind, key, value = pickle.loads(message)
                if kind == "started":
                    self._started[key] = value
                    self._exit_codes.pop(value, None)  # a reused pid's old exit
                else:
                    self._exit_codes[key] = value
                self._changed.notify_all()

    def release(self) -> None:
        """A rank group is done with the helper (its ranks are gone): the idle clock starts."""
        with self._idle:
            self._users -= 1
            self._idle_since = time.monotonic()
            self._idle.notify_all()

    def _idle_left(self) -> float | None:
        """Seconds until the helper may leave; None while rank groups hold it."""
        if self._users:
            return None
        try:
            limit = idle_exit_s()
        except ValueError:  # a bad setting: the caller hears of it at its next launch
            limit = IDLE_EXIT_S
        return max(0.0, limit - (time.monotonic() - self._idle_since))

    def _leave_when_idle(self) -> None:
        global _helper
        while True:
            with self._idle:
                while self._alive and (left := self._idle_left()) != 0.0:
                    # None while ranks hold it, and for ever (inf): Condition.wait(inf) overflows
                    self._idle.wait(None if left is None or math.isinf(left) else left)
                if not self._alive:
                    return
            with _helper_lock, self._idle:  # the order lease() takes them in
                if self._idle_left() == 0.0:  # no launch leased it meanwhile
                    self.close()
                    if _helper is self:
                        _helper = None
                    return

    def close(self) -> None:
        with self._idle:
            self._alive = False
            self._idle.notify_all()
        self.sock.close()
        self.makers.close()
        self.process.kill()
        self.process.wait()


_helper: Zygote | None = None
_helper_lock = threading.Lock()


def enabled() -> bool:
    """Fork ranks from the helper: on Linux, unless ``DMLBOOK_START=spawn``."""
    start = os.environ.get("DMLBOOK_START", "fork")
    if start not in ("fork", "spawn"):
        raise ValueError(f"DMLBOOK_START must be 'fork' or 'spawn', got {start!r}")
    return start == "fork" and sys.platform == "linux"


_idle_exit_override: float | None = None


def idle_exit_s() -> float:
    """How long the helper stays without ranks: :func:`set_idle_exit`'s value, else
    ``$DMLBOOK_HELPER_IDLE_S``, else :data:`IDLE_EXIT_S` (seconds; ``inf``: never leaves)."""
    if _idle_exit_override is not None:
        return _idle_exit_override
    value = os.environ.get(IDLE_ENV)
    return IDLE_EXIT_S if value is None else _checked_idle(value, f"${IDLE_ENV}")


def set_idle_exit(seconds: float | None) -> None:
    """Set how long the helper stays without ranks (None: back to the environment's value)."""
    global _idle_exit_override
    _idle_exit_override = None if seconds is None else _checked_idle(seconds, "seconds")
    with _helper_lock:
        current = _helper
    if current is not None:
        with current._idle:
            current._idle.notify_all()  # it looks at its deadline again


def _checked_idle(value, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not seconds > 0:  # also rejects nan
        raise ValueError(f"{name} must be a number of seconds > 0 (or inf), got {value!r}")
    return seconds


def helper() -> Zygote:
    """This process's helper, started on first use (and again if it died or left)."""
    global _helper
    with _helper_lock:
        if _helper is None or not _helper.alive():
            _helper = Zygote()
        return _helper


def lease() -> Zygote:
    """The helper, held by a rank group until it calls ``release()``: it does not leave before."""
    global _helper
    idle_exit_s()  # a bad $DMLBOOK_HELPER_IDLE_S is the caller's error, raised here
    with _helper_lock:
        if _helper is None or not _helper.alive():
            _helper = Zygote()
        with _helper._idle:
            _helper._users += 1
        return _helper
