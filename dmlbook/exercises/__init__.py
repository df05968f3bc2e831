"""Automatic checkers for the chapter notebooks' exercises, one module per chapter (``ch01``, ...).

A notebook's exercise cell holds the solution between nbgrader-style markers::

    def my_shard(length, rank, world_size):
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

and the next cell checks it: ``ch01.check_shard(my_shard)``. An instructor's student version
replaces everything between the markers with ``raise NotImplementedError``, so every checker treats
that exception (raised directly, or on a rank of a distributed check) as "not attempted yet": it
prints one friendly line and returns, and a student notebook with open exercises still runs top to
bottom. A right answer prints a short "passed" line; a wrong one raises :class:`ExerciseFailed`
saying which input, what was expected and what came back.

Every checker returns a :class:`CheckResult`, and a failure carries one in ``.result``::

    try:
        result = ch01.check_shard(my_shard)
    except ExerciseFailed as failure:
        result = failure.result

When the environment variable named by :data:`GRADE_LOG` is set (``python -m dmlbook.classroom
grade`` sets it for the kernel), every check also appends its result to that file as one line of
JSON, so a grader reads verdicts rather than printed text.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal

from dmlbook.launch import RankError, RankTimeoutError

__all__ = [
    "GRADE_LOG",
    "CheckResult",
    "ExerciseFailed",
    "checker",
    "expect_value_error",
    "learner_code",
]

Status = Literal["passed", "failed", "not attempted"]
GRADE_LOG = "DMLBOOK_GRADE_LOG"  # names a file that receives each check's result, if set


@dataclass(frozen=True)
class CheckResult:
    """What one check of one exercise found: ``status`` is passed, failed or not attempted."""

    exercise: str  # the exercise's name, as the notebook and the checker call it
    status: Status
    message: str  # the line the learner saw

    def _repr_pretty_(self, p, cycle) -> None:
        # The message was already printed; a cell that ends with a check shows just this.
        p.text(f"<{self.exercise}: {self.status}>")


class ExerciseFailed(AssertionError):
    """A wrong answer: the message names the input, what was expected and what came back."""

    exercise: str | None = None  # set by @checker

    @property
    def result(self) -> CheckResult:
        """This failure as a :class:`CheckResult`, for a grader."""
        return CheckResult(self.exercise or "?", "failed", str(self))


def _not_attempted(error: BaseException) -> bool:
    """The learner's code still says ``raise NotImplementedError``, here or on some rank."""
    if isinstance(error, RankError):  # raised on a rank: launch hands us the original as cause
        error = error.__cause__
    return isinstance(error, NotImplementedError)


def checker(exercise: str) -> Callable[[Callable[..., str | None]], Callable[..., CheckResult]]:
    """Turn ``check(fn, ...)``, which raises :class:`ExerciseFailed` or returns a short summary of
    what it verified, into a notebook checker that prints one line and returns a CheckResult.
    """

    def decorate(check: Callable[..., str | None]) -> Callable[..., CheckResult]:
        @functools.wraps(check)
        def run_check(fn: Callable, *args, **kwargs) -> CheckResult:
            if not callable(fn):
                raise TypeError(
                    f"{check.__name__} takes your function itself, e.g. "
                    f"{check.__name__}(my_function), not {type(fn).__name__} {fn!r}"
                )
            try:
                summary = check(fn, *args, **kwargs)
            except ExerciseFailed as failure:
                failure.args = (f"Exercise {exercise!r} failed: {failure}",)
                failure.exercise = exercise
                _report(failure.result)
                raise
            except Exception as error:
                if not _not_attempted(error):
                    raise
                message = (
                    f"Exercise {exercise!r} not attempted yet: replace `raise NotImplementedError`"
                    " with your answer and run the cell again."
                )
                print(message)
                return _report(CheckResult(exercise, "not attempted", message))
            message = f"Exercise {exercise!r} passed" + (f": {summary}" if summary else ".")
            print(message)
            return _report(CheckResult(exercise, "passed", message))

        run_check.exercise = exercise  # type: ignore[attr-defined]  # lets a grader list them
        return run_check

    return decorate


def _report(result: CheckResult) -> CheckResult:
    """Append ``result`` to the grader's log, when a grader asked for one."""
    if log := os.environ.get(GRADE_LOG):
        with open(log, "a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
    return result


def expect_value_error(call: str, attempt: Callable[[], object], why: str) -> None:
    """Run ``attempt`` (the learner's function on bad input, described by ``call``): it must raise
    ValueError. Any other error, or a return, fails the exercise with ``why``; ``raise
    NotImplementedError`` passes through, for :func:`checker` to report "not attempted"."""
    try:
        attempt()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:
        raise ExerciseFailed(
            f"{call} raised {type(error).__name__}: {error}; raise ValueError: {why}"
        ) from error
    raise ExerciseFailed(
        f"{call} returned instead of raising ValueError: {why}; raise ValueError there"
    )


@contextmanager
def learner_code(what: str) -> Iterator[None]:
    """Run the learner's code: an error in it becomes :class:`ExerciseFailed` naming ``what``.

    ``raise NotImplementedError`` passes through untouched, for :func:`checker` to report the
    exercise as not attempted. The original error stays attached as ``__cause__``, so its
    traceback still shows the learner's line.
    """
    try:
        yield
    except ExerciseFailed:
        raise
    except Exception as error:
        if _not_attempted(error):
            raise
        if isinstance(error, RankTimeoutError):
            raise ExerciseFailed(
                f"{what} was still running on ranks {error.ranks} at the timeout. Does every "
                "rank call the same collectives, in the same order? (stacks of the stuck ranks "
                "below)"
            ) from error
        if isinstance(error, RankError):
            cause = error.__cause__
            said = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
            raise ExerciseFailed(f"{what} failed on rank {error.rank}: {said}") from error
        raise ExerciseFailed(f"{what} raised {type(error).__name__}: {error}") from error
