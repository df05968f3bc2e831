"""The wire protocol between the caller, the warm helper and the ranks (a leaf: standard library
only, so that the helper, which must not import the package's torch code, can share it).

Used by every chapter through :func:`dmlbook.launch.run` and, for ranks that live across cells
(chapters 2 and 9), :class:`dmlbook.launch.Ranks`. What goes in, every rank reads from files;
every answer comes back on a channel:

* **The private folder** (mode 0700, made by :mod:`dmlbook.runtime.rank_group`). The caller
  writes :data:`META` (what every rank reads first) and, for a launch, :data:`PAYLOAD` (the
  shipped function and its arguments, written once for all ranks); :data:`STORE` is the
  ``FileStore`` the ranks rendezvous on; a rank appends a faulthandler dump to
  :func:`stack_file` when the caller sends SIGUSR1.
* **A socket pair per rank**, as :class:`Channel` messages (length-prefixed pickles), for a
  launch and a session alike. The start is request :data:`START`: a launch's rank answers it
  with ``("done", 0, value)``, the pickled result of its function, and a session's rank with
  ``("ready", 0, pid)``; a rank that fails (its function raised, its process group did not come
  up) answers ``("error", 0, report)`` (:func:`dmlbook.runtime.failures.failure_report`) and
  exits. A session's rank then serves requests ``(kind, id, *body)``, kind ``exec``, ``call``,
  ``push`` or ``pull`` (:mod:`dmlbook.runtime.rank_server`), answering each with ``("done", id,
  value)``, ``("error", id, report)`` or ``("interrupted", id, report)``, after any number of
  ``("out", stream, text)`` lines the request printed. A value that cannot be pickled comes back
  as :class:`Shown`. The caller waits on all the ranks' channels at once
  (:meth:`dmlbook.runtime.rank_group.RankGroup.receive`).

A rank finds the descriptors it was given beyond stdout and stderr (its end of its channel
first) in the environment variable :data:`PASSED_FDS`, whether the helper forked it or the
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
    "START",
    "STORE",
    "Channel",
    "Shown",
    "interrupt_after",
    "stack_file",
]

META = "meta.pkl"  # dict: world_size, backend, timeout, store, sys_path, cwd, sources, ...
PAYLOAD = "payload.pkl"  # a launch's (fn, args, kwargs), shipped by dmlbook.runtime.shipping
STORE = "store"  # the FileStore the ranks rendezvous on
# A rank's file descriptors beyond stdout and stderr (its channel first), as the rank finds
# them: comma-separated numbers in this environment variable.
PASSED_FDS = "DMLBOOK_PASSED_FDS"
START = 0  # the id of the start request, which every rank answers first


def stack_file(workdir: Path, rank: int) -> Path:
    """Where a rank appends its stacks when the caller sends SIGUSR1."""
    return workdir / f"stack{rank}.txt"


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
        with self._lock, interrupt_after():
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> Any:
        """The next message, or None once the other end has closed. A caller that reads in its
        main thread, where Ctrl-C lands, holds it around this and what it does with the message
        (:func:`interrupt_after`), so that a message read is never dropped."""
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
def interrupt_after():
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
