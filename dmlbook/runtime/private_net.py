"""A run's own network: the ranks of one launch or one session in a user and network namespace of
their own, so that no other user of the machine can connect to any of their sockets.

Every chapter's ranks start this way (:mod:`dmlbook.runtime.rank_group`). gloo does not ask who
connects to its listeners: on a shared machine (a class server) another user could open a
connection to a learner's ranks on 127.0.0.1, and did, in a test. In a network namespace of their
own the ranks have a loopback of their own, which nothing outside can reach, and the machine's
``/proc/net/tcp`` does not list their sockets. An unprivileged user may make one inside a new
user namespace (``unshare -rn`` does the same):

* for each run, a small process made for the purpose (:func:`make`) makes both namespaces, maps
  its own user and group to themselves inside (files, ``os.getuid()`` and the home folder stay the
  same), brings ``lo`` up, sends the two namespaces back to the caller as file descriptors over a
  socket pair, and exits. ``unshare`` of a user namespace refuses a process with threads, and one
  that fails half-way cannot go back, so neither the caller nor a rank does it. With the warm
  helper (:mod:`dmlbook.runtime.zygote`) that process is forked by a small process the helper
  forked before it imported torch (:func:`serve_makers`: a fork of the helper itself took 30 ms
  here, and the whole round trip this way takes about 2 ms); ranks spawned as fresh
  interpreters get one spawned too;
* every rank joins them (:func:`join`) first thing, while it is single-threaded (``setns`` into
  a user namespace requires it), and the caller closes its copies once all ranks have started,
  so the namespaces vanish with the run's last rank.

The caller talks to its ranks through channels that do not depend on the network: the private
folder's files, pipes and socket pairs (:mod:`dmlbook.runtime.protocol`). NCCL on one machine
should work too (reasoned, not yet run on GPUs): ``/dev/shm`` and the devices stay shared (the
mount namespace is the caller's), its bootstrap listens on the ranks' ``lo``, and its abstract
Unix sockets, which belong to a network namespace, are the run's own as well.

The ranks then have no network but their own loopback: a rank cannot download anything (the
book never does; fetch a learner's own data in the notebook, before the launch) nor reach a
server on the machine's 127.0.0.1.

Where the kernel forbids it (user namespaces turned off: ``/proc/sys/user/max_user_namespaces``
is 0; ``unshare`` refused by a seccomp filter or AppArmor), the ranks run as before, in the
machine's network namespace, and the caller warns (:func:`exposed_warning`) with the reason.
``DMLBOOK_PRIVATE_NET=0`` turns the whole thing off. What it does not hide: another user can
still read ``/proc/PID/net/tcp`` of a rank's pid, which lists the ports inside the rank's
namespace, one they can neither enter nor reach. Multi-host runs under torchrun do not start
ranks through here and are unchanged.

Standard library only, beside the leaf :mod:`dmlbook.runtime.protocol`: the warm helper imports
it before it imports torch.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import sys

from dmlbook.runtime.protocol import PASSED_FDS

__all__ = [
    "JOIN",
    "SWITCH",
    "Outcome",
    "enter",
    "exposed_warning",
    "join",
    "make",
    "receive",
    "serve_makers",
    "wanted",
]

SWITCH = "DMLBOOK_PRIVATE_NET"  # "0": ranks share the machine's network namespace
# Set by the caller in a rank's environment when the last two descriptors of $DMLBOOK_PASSED_FDS
# are the run's user and network namespaces, for the rank to join.
JOIN = "DMLBOOK_JOIN_NET"

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: the name, then ifr_flags in a 24-byte union
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def wanted() -> bool:
    """Put ranks in a network namespace of their own: on Linux, unless ``DMLBOOK_PRIVATE_NET=0``."""
    value = os.environ.get(SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH} must be '0' (off) or '1' (on, the default), got {value!r}")
    return value == "1" and _libc is not None


# --------------------------------------------------------------------------- making one


def make(report_fd: int) -> None:
    """In a process of its own, single-threaded, that exits next: move into a new user and
    network namespace with ``lo`` up, and send both to the caller on the socket ``report_fd``
    (closed here); if the kernel refuses any step, send the reason instead."""
    uid, gid = os.geteuid(), os.getegid()
    with socket.socket(fileno=report_fd) as report:
        step = "unshare"
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)
            step = "map the user"  # AppArmor's restriction of user namespaces refuses this
            _write("/proc/self/uid_map", f"{uid} {uid} 1")  # we stay who we are inside
            _write("/proc/self/setgroups", "deny")  # (an unprivileged gid_map needs this first)
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
            step = "bring lo up"
            _loopback_up()
            step = "open the namespaces"
            user = os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, str(e.errno))
            hint = "; user namespaces are off (/proc/sys/user/max_user_namespaces)" * (
                e.errno == errno.ENOSPC
            )
            report.sendall(f"unavailable: {step} failed: {name}{hint}".encode())
            return
        socket.send_fds(report, [b"ok"], [user, net])


def serve_makers(fd: int, parent: int) -> None:
    """A small process's loop (forked by the warm helper before it imports torch, so that a fork
    of it is cheap): for each socket the caller sends on ``fd``, fork a child that runs
    :func:`make` on it. It ends with the caller's end of ``fd``, or with the helper."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the helper died before prctl
        os._exit(0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 16, 1)
        if not message:  # the caller is gone
            os._exit(0)
        for report in fds:
            if os.fork() == 0:
                try:
                    sock.close()
                    make(report)
                finally:
                    os._exit(0)
            os.close(report)


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    """``ip link set lo up``, by the ioctl that ``ip`` and ``ifconfig`` use (no ``ip`` needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = _IFREQ.pack(b"lo", 0)
        flags = _IFREQ.unpack(fcntl.ioctl(s, _SIOCGIFFLAGS, name))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


# --------------------------------------------------------------------------- joining it


def enter() -> None:
    """First thing in a rank, while it has one thread: join the run's namespaces if
    ``$DMLBOOK_JOIN_NET`` says so, and leave in ``$DMLBOOK_PASSED_FDS`` the other descriptors."""
    if os.environ.pop(JOIN, None) is None:
        return
    passed = [int(f) for f in os.environ.get(PASSED_FDS, "").split(",") if f]
    *rest, user, net = passed
    join(user, net)
    os.environ[PASSED_FDS] = ",".join(map(str, rest))


def join(user_fd: int, net_fd: int) -> None:
    """Move this process into the run's namespaces (the descriptors are closed here)."""
    try:
        for fd, kind in ((user_fd, CLONE_NEWUSER), (net_fd, CLONE_NEWNET)):
            if _libc.setns(fd, kind) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"setns into the run's namespace: {os.strerror(code)}")
    finally:
        os.close(user_fd)
        os.close(net_fd)


# --------------------------------------------------------------------------- in the caller


class Outcome:
    """What the maker said: the namespaces' descriptors (``fds``: user, net), or ``refused``,
    why there are none."""

    def __init__(self, fds: list[int] | None = None, refused: str = "") -> None:
        self.fds, self.refused = fds or [], refused

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def receive(sock: socket.socket, timeout: float) -> Outcome:
    """The maker's answer on the caller's end of its socket pair."""
    if not select.select([sock], [], [], timeout)[0]:
        return Outcome(refused=f"no answer from the process that makes it in {timeout:g} s")
    message, fds, _, _ = socket.recv_fds(sock, 512, 2)
    if message == b"ok" and len(fds) == 2:
        return Outcome(fds=fds)
    for fd in fds:
        os.close(fd)
    text = message.decode(errors="replace").removeprefix("unavailable: ")
    return Outcome(refused=text or "the process that makes it died")


def exposed_warning(reason: str) -> str:
    """The one line the caller warns with when there is no private network: what is exposed."""
    return (
        f"dmlbook: these ranks are not on a network of their own ({reason}); their gloo "
        f"listeners on 127.0.0.1 are reachable by other local users ({SWITCH}=0 silences this)"
    )
