"""How a rank's failure travels to the caller and becomes the exception the caller raises.

A rank that raises sends a report on its channel (:func:`failure_report`: when, a one-line
summary, its traceback, the exception itself); a rank that dies without a word leaves only its
exit code and its last lines on stderr. :func:`classify_failure` turns either into a
:class:`RankError`, and :func:`first_failure` names the rank that failed *first*, never one whose
collective broke because a peer died. :func:`readable_dump` keeps the user's frames of a stuck
rank's faulthandler dump. Shared by :func:`dmlbook.launch.run` and :class:`dmlbook.launch.Ranks`
(every chapter; chapter 1 shows a failing rank).
"""

from __future__ import annotations

import linecache
import pickle
import re
import signal
import traceback
from pathlib import Path

from dmlbook.runtime import shipping
from dmlbook.runtime.errors import RankError

# How gloo and NCCL say that a peer went away: such a rank failed because another one did.
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote (worker|process|peer)", re.IGNORECASE
)
LAST_WORDS_LINES = 10  # lines of a dead rank's stderr shown in the error
# Frames of the runtime itself, left out of a stuck rank's stack: the modules a rank runs in.
_RANK_PROCESS = str(Path(__file__).with_name("rank_process.py"))
_OWN_FILES = (
    _RANK_PROCESS,
    str(Path(__file__).with_name("rank_server.py")),
    str(Path(__file__).with_name("zygote.py")),
    "<string>",
)


def failure_report(e: BaseException, failed_at: float, hide: tuple[str, ...]) -> dict:
    """What the caller needs to name a failure: when, a one-line summary, the traceback (without
    the leading frames of the files in ``hide``: the runtime's own) and the exception itself."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in hide:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(e), e, tb))
    try:
        exception = shipping.dumps(e)[0]
    except Exception:
        exception = b""
    try:
        summary = f"{type(e).__name__}: {e}"
    except Exception:  # an exception whose __str__ itself fails
        summary = f"{type(e).__name__}: <str() failed>"
    return dict(time=failed_at, summary=summary, traceback=text, exception=exception)


def classify_failure(
    rank: int, report: dict | None, died_at: float, code: int | None, stderr_tail: list[str]
) -> tuple[tuple[bool, float], RankError]:
    """A failed rank as ((is it a knock-on failure, when it failed), the error to raise).

    ``report`` is what the rank wrote when it raised (None if it died without a word).
    """
    if report is None:
        how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        said, stack = last_words(stderr_tail)
        message = f"rank {rank} failed first: it died with {how} and no Python traceback"
        if said:
            message += "\nIts last lines on stderr:\n" + "\n".join(f"  {line}" for line in said)
        if stack:
            message += f"\nWhere it was when it died (faulthandler):\n{stack}"
        error = RankError(message, rank, code)
        error.stderr = "\n".join(stderr_tail)
        return (False, died_at), error
    error = RankError(
        f"rank {rank} failed first: {report['summary']}\n\nOn rank {rank}:\n{report['traceback']}",
        rank,
        code,
        report["traceback"],
    )
    try:
        error.__cause__ = pickle.loads(report["exception"])
    except Exception:
        pass
    return (bool(PEER_LOST.search(report["summary"])), report["time"]), error


def last_words(stderr_tail: list[str]) -> tuple[list[str], str]:
    """What a rank that died without a traceback wrote last, and where its Python code was.

    A fatal signal makes faulthandler (enabled in every rank) write ``Fatal Python error: ...``
    and each thread's stack after whatever the rank wrote before, such as gloo's ``terminate
    called after throwing an instance of 'gloo::EnforceNotMet' ... Received data size doesn't
    match expected size``. The lines before the dump are its reason; the dump, without the
    runtime's own threads and frames, says where the user's code was.
    """
    fatal = next(
        (
            i
            for i in range(len(stderr_tail) - 1, -1, -1)
            if stderr_tail[i].startswith("Fatal Python")
        ),
        None,
    )
    if fatal is None:
        return stderr_tail[-LAST_WORDS_LINES:], ""
    said = [line for line in stderr_tail[:fatal] if line.strip()][-LAST_WORDS_LINES:]
    dump = [line for line in stderr_tail[fatal + 1 :] if not line.startswith("Extension modules")]
    stack = readable_dump("\n".join(dump))
    return said + [stderr_tail[fatal]], stack if "File " in stack else ""


def first_failure(failures) -> RankError:
    """The error of the rank that failed first, knock-on failures last.

    A rank whose collective broke because a peer vanished failed as a *consequence*. It can even
    report before the caller sees the peer's death (a dying process closes its sockets before
    the kernel reports its exit), so it is named only when no other rank failed.
    """
    _, error = min(failures, key=lambda f: f[0])
    return error


def readable_dump(dump: str) -> str:
    """Keep the user's threads and frames of a faulthandler dump, each with its source line."""
    if not dump.strip():
        return "(no stack dump: the rank did not answer SIGUSR1)"
    threads = []
    for block in dump.strip().split("\n\n"):
        if f'File "{_RANK_PROCESS}", line' in block and " in watch" in block:
            continue  # the launcher's parent-watching thread
        lines = []
        for line in block.splitlines():
            m = re.match(r'\s+File "(.+)", line (\d+) in ', line)
            if m and m.group(1) in _OWN_FILES:
                continue  # the launcher's own frames
            lines.append(line)
            if m and (src := linecache.getline(m.group(1), int(m.group(2))).strip()):
                lines.append(f"    {src}")
        threads.append("\n".join(lines))
    return "\n\n".join(threads)
