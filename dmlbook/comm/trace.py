"""Record what a rank communicates, for every chapter that counts traffic (2, 4, 9, 9b, 13).

One mechanism for every kind of record. Code that communicates calls :func:`record` with an event
(a :class:`Send` per message in chapter 2's collectives, chapter 13's all-to-all and ring
attention; a :class:`~dmlbook.advanced.tensor_parallel.comm.CommRecord` per collective in chapter
9's tensor-parallel layers); ``with recording(Send) as sends:`` collects, into ``sends``, the
events of that kind recorded inside the block. The active recorders live in a context variable, not
a module global: nested blocks each get their own list (an outer block also receives the inner
block's events), and another thread or asyncio task records only into its own blocks.

Backward passes on CUDA run on autograd's device threads, which do not see the caller's context:
there a block collects what forward records. On the CPU, where the chapters run, backward runs
in the caller's thread and is recorded too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["Send", "is_recording", "record", "recording"]

# The recorders open in this context, innermost last: (the list they fill, the kind they keep).
_recorders: ContextVar[tuple[tuple[list, type], ...]] = ContextVar("dmlbook_recorders", default=())


@contextmanager
def recording(kind: type = object) -> Iterator[list]:
    """Collect every event of type ``kind`` recorded inside the block into the yielded list."""
    events: list = []
    outer = _recorders.get()
    token = _recorders.set((*outer, (events, kind)))
    try:
        yield events
    finally:
        _recorders.reset(token)


def is_recording() -> bool:
    """Is any recorder open here? (Lets a hot path skip building events nobody keeps.)"""
    return bool(_recorders.get())


def record(event: object) -> None:
    """Hand ``event`` to every open recorder that keeps its kind; nothing when none is open."""
    for events, kind in _recorders.get():
        if isinstance(event, kind):
            events.append(event)


@dataclass(frozen=True)
class Send:
    """One message: ``src`` sent ``nbytes`` to ``dst`` at ``step`` of a collective (global ranks)"""

    collective: str
    phase: str
    step: int
    src: int
    dst: int
    nbytes: int
    chunk: int | None = None  # which chunk of the tensor, for the ring algorithms
