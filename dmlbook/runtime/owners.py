"""Who owns what a run leaves on the machine: a process identity that survives pid reuse.

A run that claims something outside itself (the network lab's namespaces in chapters 4 and 13, a
checkpoint's temporary file in chapter 3) records its owner: the pid, the process's start time
(field 22 of ``/proc/PID/stat``, clock ticks since boot) and the host's name. A later run then
tells a crash's leftover (its owner is dead) from a live run's claim (its owner still runs),
whatever the names say: a pid that the kernel gave to a new process has a new start time. On a
shared server this is what lets thirty learners run the same chapter at once, and lets each
run clean what a killed run left without ever touching another learner's live one.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

__all__ = ["Owner"]

_TOKEN = re.compile(r"(\d+)-(\d+)@([A-Za-z0-9._-]+)")


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # a zombie or a dying process owns nothing any more
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


@dataclass(frozen=True)
class Owner:
    """A process on a host: pid, start time and host name (see the module docstring)."""

    pid: int
    start: int
    host: str

    @classmethod
    def of(cls, pid: int) -> Owner:
        """The live process ``pid`` on this host (ValueError if there is none)."""
        start = start_time(pid)
        if start is None:
            raise ValueError(f"no live process {pid}")
        return cls(pid, start, _host())

    @classmethod
    def me(cls) -> Owner:
        """This process."""
        return cls.of(os.getpid())

    def is_dead(self) -> bool:
        """True only where we can tell: on this host, no process has this pid AND start time.

        An owner on another host (a shared filesystem), or on a system without ``/proc``,
        counts as alive: what it claimed is never removed on a guess.
        """
        if self.host != _host() or not os.path.isdir("/proc/self"):
            return False
        return start_time(self.pid) != self.start

    def token(self) -> str:
        """``PID-START@HOST``, for a file name (see :meth:`parse`)."""
        return f"{self.pid}-{self.start}@{self.host}"

    @classmethod
    def parse(cls, token: str) -> Owner | None:
        """The owner a :meth:`token` names; None if ``token`` is not one."""
        m = _TOKEN.fullmatch(token)
        return cls(int(m[1]), int(m[2]), m[3]) if m else None

    def as_dict(self) -> dict:
        return {"pid": self.pid, "start": self.start, "host": self.host}
