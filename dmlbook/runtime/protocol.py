"""The wire protocol between the caller, the warm helper and the ranks (a leaf: standard library
only, so that the helper, which must not import the package's torch code, can share it).

Used by every chapter through :func:`dmlbook.launch.run` and, for ranks that live across cells
(chapters 2 and 9), :class:`dmlbook.launch.Ranks`. Two channels carry it:

* **The launch's private folder** (mode 0700, made by :mod:`dmlbook.runtime.rank_group`). The
  caller writes :data:`META` (what every rank reads first) and, for a launch, :data:`PAYLOAD`
  (the shipped function and its arguments); a rank answers with :func:`result_file` or
  :func:`error_file` (a failure report, :func:`dmlbook.runtime.failures.failure_report`), each
  written whole by :func:`write_atomic`, and appends a faulthandler dump to :func:`stack_file`
  when the caller sends SIGUSR1. :data:`STORE` is the ``FileStore`` the ranks rendezvous on.
* **A session's socket pair per rank**, as :class:`Channel` messages (length-prefixed pickles).
  The caller sends requests ``(kind, id, *body)``, kind ``exec``, ``call``, ``push`` or ``pull``
  (:mod:`dmlbook.runtime.rank_server`); the rank answers
  ``("ready", 0, pid)`` once, then for each request ``("done", id, value)``, ``("error", id,
  report)`` or ``("interrupted", id, report)``, after any number of ``("out", stream, text)``
  lines the request printed. A value that cannot be pickled comes back as :class:`Shown`.

A rank finds the descriptors it was given beyond stdout and stderr (a session's end of its
channel) in the environment variable :data:`PASSED_FDS`, whether the helper forked it or the
caller spawned it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import struct
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "META",
    "PASSED_FDS",
    "PAYLOAD",
    "STORE",
    "Channel",
    "Shown",
    "error_file",
    "result_file",
    "stack_file",
    "write_atomic",
]

META = "meta.pkl"  # dict: world_size, backend, timeout, store, sys_path, cwd, sources, ...
PAYLOAD = "payload.pkl"  # a launch's (fn, args, kwargs), shipped by dmlbook.runtime.shipping
STORE = "store"  # the FileStore the ranks rendezvous on
# A rank's file descriptors beyond stdout and stderr (a session's control channel), as the rank
# finds them: comma-separated numbers in this environment variable.
PASSED_FDS = "DMLBOOK_PASSED_FDS"


def result_file(workdir: Path, rank: int) -> Path:
    """Where rank ``rank`` of a launch writes its pickled result."""
    return workdir / f"result{rank}.pkl"


def error_file(workdir: Path, rank: int) -> Path:
    """Where a rank that raised writes its failure report (a pickled dict)."""
    return workdir / f"error{rank}.pkl"


def stack_file(workdir: Path, rank: int) -> Path:
    """Where a rank appends its stacks when the caller sends SIGUSR1."""
    return workdir / f"stack{rank}.txt"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that a reader sees the whole file or none of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


_HEADER = struct.Struct("!Q")  # the length of the pickle that follows


class Channel:
    """Length-prefixed pickles over a connected stream socket, whole messages or none."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()  # a cell's threads may print at once

    @classmethod
    def passed_in(cls) -> Channel:
        """In a rank: the channel whose descriptor the caller passed (``$DMLBOOK_PASSED_FDS``)."""
        return cls(socket.socket(fileno=int(os.environ[PASSED_FDS].split(",")[0])))

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock, _interrupt_after():
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> Any:
        """The next message, or None once the other end has closed."""
        header = self._read(_HEADER.size)
        if header is None:
            return None
        data = self._read(_HEADER.unpack(header)[0])
        return None if data is None else pickle.loads(data)

    def _read(self, size: int) -> bytes | None:
        chunks, left = [], size
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def _interrupt_after():
    """Hold a Ctrl-C (SIGINT) until the block is done, so a message is never cut in half."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run in the main thread only
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, None)
        elif held and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


class Shown:
    """Stands in for a cell's value that cannot be pickled: its ``repr``, made on the rank."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text
