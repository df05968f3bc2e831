"""The rank side of :class:`dmlbook.ranks.Ranks`: a loop that serves the caller's requests.

A session's rank, once its process group is up (:mod:`dmlbook._rank_process`), reads requests
from its end of a socket pair that the caller made for it, and answers each one on the same
channel, in order:

* ``exec``: run a cell's source in this rank's namespace, which lives as long as the rank; the
  value of a final expression goes back, as IPython shows a cell's last value;
* ``call``: call a function shipped by :mod:`dmlbook._shipping`; ``push``: set names;
  ``pull``: send names' values back.

What the cell prints travels on the channel too, ahead of the answer (``("out", stream, text)``),
so the caller has shown all of a cell's output by the time it returns. A request that raises is
answered with a failure report (:func:`dmlbook._rank_process.failure_report`) and the loop goes
on. SIGINT interrupts the running request only (``KeyboardInterrupt`` in the cell, answered as
``interrupted``); between requests it is ignored. The loop ends when the caller closes the channel.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

from dmlbook import _shipping, _zygote

_HEADER = struct.Struct("!Q")  # the length of the pickle that follows


class Channel:
    """Length-prefixed pickles over a connected stream socket, whole messages or none."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()  # a cell's threads may print at once

    @classmethod
    def passed_in(cls) -> Channel:
        """In a rank: the channel whose descriptor the caller passed (``$DMLBOOK_PASSED_FDS``)."""
        return cls(socket.socket(fileno=int(os.environ[_zygote.PASSED_FDS].split(",")[0])))

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


class _Forward(io.TextIOBase):
    """A rank's ``sys.stdout`` or ``sys.stderr``: each line goes to the caller as it is written."""

    def __init__(self, channel: Channel, name: str) -> None:
        self.channel, self.name, self.pending = channel, name, ""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        # Code that writes to the descriptor itself (faulthandler, C extensions) reaches the
        # rank's pipe, which the caller shows marked with the rank too.
        return 1 if self.name == "stdout" else 2

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in text:
            self.flush()
        return len(text)

    def flush(self) -> None:
        text, self.pending = self.pending, ""
        if text:
            self.channel.send(("out", self.name, text))


class _Interrupts:
    """SIGINT raises KeyboardInterrupt while a request runs, and is ignored between requests."""

    running = False

    def handle(self, signum, frame) -> None:
        if self.running:
            raise KeyboardInterrupt


def serve(channel: Channel, rank: int, world_size: int) -> None:
    """Answer the caller's requests until it closes the channel."""
    import torch
    import torch.distributed as dist

    namespace = {
        "__name__": "__main__",
        "__builtins__": builtins,
        "torch": torch,
        "dist": dist,
        "rank": rank,
        "world_size": world_size,
    }
    streams = [_Forward(channel, "stdout"), _Forward(channel, "stderr")]
    sys.stdout, sys.stderr = streams
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts.handle)
    channel.send(("ready", 0, os.getpid()))
    while True:
        try:
            request = channel.recv()
            if request is None:
                return
            reply = _answer(request, namespace, interrupts)
            for stream in streams:
                stream.flush()  # the cell's output reaches the caller before the answer
            channel.send(reply)
        except KeyboardInterrupt:
            continue  # a second Ctrl-C as a request ended: there is nothing left to stop


def _answer(request: tuple, namespace: dict, interrupts: _Interrupts) -> tuple:
    kind, request_id, *body = request
    try:
        interrupts.running = True
        value = _HANDLERS[kind](namespace, *body)
        interrupts.running = False
        return "done", request_id, _pack(kind, value)
    except KeyboardInterrupt as e:
        interrupts.running = False
        return "interrupted", request_id, _report(e)
    except BaseException as e:  # SystemExit too: a cell cannot end its rank
        interrupts.running = False
        return "error", request_id, _report(e)


def _report(e: BaseException) -> dict:
    from dmlbook._rank_process import failure_report

    return failure_report(e, time.time(), hide=(__file__,))


def _pack(kind: str, value: Any) -> bytes:
    try:
        return _shipping.dumps(value)[0]
    except Exception as e:
        if kind != "exec":
            raise TypeError(f"cannot send the value back to the caller: {e}") from e
        return _shipping.dumps(Shown(f"{value!r}  # (not picklable: its repr)"))[0]


def _exec(namespace: dict, source: str, filename: str, lines: list[str]) -> Any:
    """Run a cell; return the value of its last line if that is an expression (as IPython)."""
    _shipping.install_sources({filename: lines})  # tracebacks and stack dumps show its lines
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


def _call(namespace: dict, payload: bytes, sources: dict) -> Any:
    _shipping.install_sources(sources)
    fn, args, kwargs = pickle.loads(payload)
    return fn(*args, **kwargs)


def _push(namespace: dict, payload: bytes, sources: dict) -> None:
    _shipping.install_sources(sources)
    namespace.update(pickle.loads(payload))


def _pull(namespace: dict, name: str) -> Any:
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined on this rank")
    return namespace[name]


_HANDLERS = {"exec": _exec, "call": _call, "push": _push, "pull": _pull}
