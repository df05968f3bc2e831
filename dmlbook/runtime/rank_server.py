"""The rank side of :class:`dmlbook.launch.Ranks`: a loop that serves the caller's requests
(the ``%%ranks`` cells of chapters 2 and 9).

A session's rank, once its process group is up (:mod:`dmlbook.runtime.rank_process`), reads
requests from its end of a socket pair that the caller made for it, and answers each one on the
same channel, in order (the messages: :mod:`dmlbook.runtime.protocol`):

* ``exec``: run a cell's source in this rank's namespace, which lives as long as the rank; the
  value of a final expression goes back, as IPython shows a cell's last value;
* ``call``: call a function shipped by :mod:`dmlbook.runtime.shipping`; ``push``: set names;
  ``pull``: send names' values back.

What the cell prints travels on the channel too, ahead of the answer (``("out", stream, text)``),
so the caller has shown all of a cell's output by the time it returns. A request that raises is
answered with a failure report (:func:`dmlbook.runtime.failures.failure_report`) and the loop goes
on. SIGINT interrupts the running request only (``KeyboardInterrupt`` in the cell, answered as
``interrupted``); between requests it is ignored. The loop ends when the caller closes the channel.
"""

from __future__ import annotations

import ast
import builtins
import io
import os
import pickle
import signal
import sys
import time
from typing import Any

from dmlbook.runtime import shipping
from dmlbook.runtime.failures import failure_report
from dmlbook.runtime.protocol import Channel, Shown


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
    return failure_report(e, time.time(), hide=(__file__,))


def _pack(kind: str, value: Any) -> bytes:
    try:
        return shipping.dumps(value)[0]
    except Exception as e:
        if kind != "exec":
            raise TypeError(f"cannot send the value back to the caller: {e}") from e
        return shipping.dumps(Shown(f"{value!r}  # (not picklable: its repr)"))[0]


def _exec(namespace: dict, source: str, filename: str, lines: list[str]) -> Any:
    """Run a cell; return the value of its last line if that is an expression (as IPython)."""
    shipping.install_sources({filename: lines})  # tracebacks and stack dumps show its lines
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


def _call(namespace: dict, payload: bytes, sources: dict) -> Any:
    shipping.install_sources(sources)
    fn, args, kwargs = pickle.loads(payload)
    return fn(*args, **kwargs)


def _push(namespace: dict, payload: bytes, sources: dict) -> None:
    shipping.install_sources(sources)
    namespace.update(pickle.loads(payload))


def _pull(namespace: dict, name: str) -> Any:
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined on this rank")
    return namespace[name]


_HANDLERS = {"exec": _exec, "call": _call, "push": _push, "pull": _pull}
