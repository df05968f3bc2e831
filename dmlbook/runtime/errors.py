"""What a failed launch raises, and the limits the runtime's modules share (a leaf: it imports no
other module of dmlbook).

Every chapter meets these through :mod:`dmlbook.launch`, which re-exports them: a rank that
raised or died is a :class:`RankError` naming the rank that failed *first*, ranks still running
at the timeout are a :class:`RankTimeoutError` with each stuck rank's stack, and a persistent
session (:mod:`dmlbook.runtime.session`, chapters 2 and 9) whose ranks are gone raises
:class:`RanksClosedError`.
"""

from __future__ import annotations

__all__ = [
    "BACKENDS",
    "EXIT_GRACE_S",
    "FAILURE_GRACE_S",
    "INSIDE_RUN",
    "RankError",
    "RankTimeoutError",
    "RanksClosedError",
    "START_TIMEOUT_S",
    "timeout_error",
]

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
# How long starting may take: the warm helper importing torch (10 s has been seen on a loaded
# 2-core machine), a rank's fork, and a session's ranks meeting at the rendezvous.
START_TIMEOUT_S = 120.0


class RankError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed, ``exitcode`` its exit code;
    for a rank that died without a traceback (a signal), ``stderr`` holds the last lines it wrote
    to its stderr (the message quotes the last few: gloo's reason for an abort is there)."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None, remote_traceback=""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback
        self.stderr = ""


class RankTimeoutError(TimeoutError):
    """Ranks still ran at the timeout: ``ranks`` lists them, ``stacks`` maps rank -> stack dump."""

    def __init__(self, message: str, ranks: list[int], stacks: dict[int, str]):
        super().__init__(message)
        self.ranks = ranks
        self.stacks = stacks


class RanksClosedError(RuntimeError):
    """The session's ranks are not running (stopped, or one died); ``restart()`` starts new ones."""


def timeout_error(stuck: list[int], stacks: dict[int, str], timeout: float, note: str = ""):
    """The :class:`RankTimeoutError` for ranks still running at ``timeout``, with their stacks."""
    body = "\n".join(f"--- rank {r} is stuck here ---\n{stacks[r]}" for r in stuck)
    message = f"ranks {stuck} still running after the {timeout:g} s timeout\n{body}"
    return RankTimeoutError(message + (f"\n{note}" if note else ""), stuck, stacks)
