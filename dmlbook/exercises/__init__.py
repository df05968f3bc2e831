"""Automatic checkers for the chapter notebooks' exercises, one module per chapter (``ch01``, ...).

A notebook's exercise cell holds the solution between nbgrader-style markers::

    def my_shard(length, rank, world_size):
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

and the next cell checks it: ``ch01.check_shard(my_shard)``. An instructor's exercise copy
replaces everything between the markers with ``raise NotImplementedError``, so every checker treats
that exception (raised directly, or on a rank of a distributed check) as "not attempted yet": it
prints one friendly line and returns, and an exercise copy with open exercises still runs top to
bottom. A right answer prints a short "passed" line; a wrong one raises :class:`ExerciseFailed`
saying which input, what was expected and what came back.

**No back door.** An exercise asks the learner to write a mechanism that the library (or torch)
already implements. ``@checker(name, writes=(...))`` names those implementations by their dotted
paths; while the learner's code runs (inside :func:`learner_code`, and on every rank of
:func:`run_answer`), each of them is switched off: wherever a module, the learner's globals or a
class holds it, it is replaced by a stand-in that raises :class:`SwitchedOff`, so an answer that
only calls the library is told to write the mechanism instead. The checker's own reference runs
outside those blocks, with the library intact. ``tests/chapters/exercises/test_back_doors.py`` runs
a delegating answer against every exercise, and the spoiler test reads ``writes`` to find a cell
that calls an answer before its exercise.

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

import contextvars
import functools
import importlib
import inspect
import json
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal

from dmlbook import launch
from dmlbook.launch import RankError, RankTimeoutError

__all__ = [
    "GRADE_LOG",
    "CheckResult",
    "ExerciseFailed",
    "SwitchedOff",
    "checker",
    "expect_value_error",
    "learner_code",
    "run_answer",
    "switched_off",
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


class SwitchedOff(RuntimeError):
    """The learner's answer called a library function that does the exercise's job."""


# What the check in progress switches off while the learner's code runs: (dotted names, answer).
_CURRENT: contextvars.ContextVar[tuple[tuple[str, ...], Callable | None]] = contextvars.ContextVar(
    "dmlbook_exercise_writes", default=((), None)
)


def checker(
    exercise: str, *, writes: Iterable[str] = ()
) -> Callable[[Callable[..., str | None]], Callable[..., CheckResult]]:
    """Turn ``check(fn, ...)``, which raises :class:`ExerciseFailed` or returns a short summary of
    what it verified, into a notebook checker that prints one line and returns a CheckResult.

    ``writes`` holds the dotted names of the library functions (dmlbook's and torch's) that do
    what the exercise asks the learner to write: switched off while ``fn`` runs.
    """
    writes = tuple(writes)
    for name in writes:
        _resolve(name)  # a misspelt name fails at import, not in a learner's check

    def decorate(check: Callable[..., str | None]) -> Callable[..., CheckResult]:
        @functools.wraps(check)
        def run_check(fn: Callable, *args, **kwargs) -> CheckResult:
            if not callable(fn):
                raise TypeError(
                    f"{check.__name__} takes your function itself, e.g. "
                    f"{check.__name__}(my_function), not {type(fn).__name__} {fn!r}"
                )
            token = _CURRENT.set((writes, fn))
            try:
                _refuse_the_library_itself(fn, writes)
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
            finally:
                _CURRENT.reset(token)
            message = f"Exercise {exercise!r} passed" + (f": {summary}" if summary else ".")
            print(message)
            return _report(CheckResult(exercise, "passed", message))

        run_check.exercise = exercise  # type: ignore[attr-defined]  # lets a grader list them
        run_check.writes = writes  # type: ignore[attr-defined]  # what the learner must write
        return run_check

    return decorate


def _refuse_the_library_itself(fn: Callable, writes: tuple[str, ...]) -> None:
    """An answer that *is* a switched-off function (``my_answer = lib.fn``, or a partial of it)
    is never called through a name the switch replaces: refuse it here."""
    answers, inner = set(), fn
    while inner is not None and id(inner) not in answers:
        answers |= {id(inner), id(inspect.unwrap(inner))}
        inner = getattr(inner, "__func__", None) or getattr(inner, "func", None)  # method, partial
    for name in writes:
        target = _resolve(name)[2]
        if answers & {id(target), id(inspect.unwrap(target))}:
            raise ExerciseFailed(
                f"your answer called the library instead: it is {name} itself, which is switched "
                "off in this exercise because it does the very job you are asked to write. Write "
                "the mechanism yourself"
            )


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
    names, answer = _CURRENT.get()
    try:
        with switched_off(names, answer):
            yield
    except ExerciseFailed:
        raise
    except Exception as error:
        if _not_attempted(error):
            raise
        if switched := _switched_off_cause(error):
            raise ExerciseFailed(f"{what} called the library instead: {switched}") from error
        if isinstance(error, RankTimeoutError):
            raise ExerciseFailed(
                f"{what} was still running on ranks {error.ranks} at the timeout. Does every "
                "rank call the same collectives, in the same order, and is every send matched by "
                "a recv on the rank it names (a rank that never receives leaves its sender "
                "waiting; two ranks that both send first can wait for each other: post sends "
                "with isend)? The stuck ranks' stacks are attached to this error"
            ) from error
        if isinstance(error, RankError):
            cause = error.__cause__
            said = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
            raise ExerciseFailed(f"{what} failed on rank {error.rank}: {said}") from error
        raise ExerciseFailed(f"{what} raised {type(error).__name__}: {error}") from error


# ------------------------------------------------------------------------- switching a library off


def run_answer(rank_fn: Callable, world_size: int, *args, **kwargs) -> list:
    """:func:`dmlbook.launch.run` for a check: ``rank_fn(*args, **kwargs)`` on ``world_size``
    ranks, with the exercise's ``writes`` switched off on every rank (functions among ``args``,
    the learner's answer, lose their globals' references to them too). Call it inside
    :func:`learner_code`, which turns a rank's error into the learner's failure."""
    names, _ = _CURRENT.get()
    return launch.run(_switched_off_on_rank, world_size, names, rank_fn, *args, **kwargs)


def _switched_off_on_rank(names: tuple[str, ...], rank_fn: Callable, *args, **kwargs):
    answers = [a for a in args if isinstance(a, types.FunctionType)]
    with switched_off(names, *answers):
        return rank_fn(*args, **kwargs)


@contextmanager
def switched_off(names: Iterable[str], *answers: Callable | None) -> Iterator[None]:
    """While the block runs, every function named in ``names`` (dotted paths) raises
    :class:`SwitchedOff` when called: its attribute on its owner (module or class), every loaded
    module's name bound to the same object, and the same in each answer's globals, defaults and
    closure."""
    targets = {}
    for name in names:
        owner, attribute, original = _resolve(name)
        targets[id(original)] = (name, owner, attribute, original)
    if not targets:
        yield
        return
    stand_ins = {key: _stand_in(name, original) for key, (name, _, _, original) in targets.items()}
    undo: list[Callable[[], None]] = []
    try:
        for key, (_, owner, attribute, original) in targets.items():
            setattr(owner, attribute, stand_ins[key])
            undo.append(functools.partial(setattr, owner, attribute, original))
        functions = [a for a in answers if isinstance(a, types.FunctionType)]
        spaces = [vars(m) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]
        spaces += [f.__globals__ for f in functions]
        for space in spaces:
            for key, value in [(k, v) for k, v in list(space.items()) if id(v) in targets]:
                space[key] = stand_ins[id(value)]
                undo.append(functools.partial(space.__setitem__, key, value))
        for function in functions:  # captured as a default (q=quantize) or in a closure
            undo += _replace_captured(function, targets, stand_ins)
        yield
    finally:
        for restore in reversed(undo):
            restore()


def _replace_captured(function: types.FunctionType, targets: dict, stand_ins: dict) -> list:
    """Swap the switched-off functions among ``function``'s defaults and closure cells; return
    the calls that put them back."""
    undo = []
    if function.__defaults__ and any(id(v) in targets for v in function.__defaults__):
        original = function.__defaults__
        function.__defaults__ = tuple(stand_ins.get(id(v), v) for v in original)
        undo.append(functools.partial(setattr, function, "__defaults__", original))
    if function.__kwdefaults__ and any(id(v) in targets for v in function.__kwdefaults__.values()):
        original_kw = function.__kwdefaults__
        function.__kwdefaults__ = {k: stand_ins.get(id(v), v) for k, v in original_kw.items()}
        undo.append(functools.partial(setattr, function, "__kwdefaults__", original_kw))
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if id(value) in targets:
            cell.cell_contents = stand_ins[id(value)]
            undo.append(functools.partial(setattr, cell, "cell_contents", value))
    return undo


def _resolve(name: str) -> tuple[object, str, object]:
    """``"torch.distributed.all_gather"`` -> (its module or class, its attribute, the object)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:-1]:
            owner = getattr(owner, attribute)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ImportError(f"cannot find {name!r}")


def _stand_in(name: str, original: object) -> Callable:
    def switched_off(*args, **kwargs):
        raise SwitchedOff(
            f"{name} is switched off in this exercise: it does the very job you are asked to "
            "write. Write the mechanism yourself instead of calling it"
        )

    switched_off.__name__ = getattr(original, "__name__", name)
    switched_off.__qualname__ = getattr(original, "__qualname__", name)
    return switched_off


def _switched_off_cause(error: BaseException) -> str | None:
    """The message of the :class:`SwitchedOff` behind ``error``, here or on a rank."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, SwitchedOff):
            return str(error)
        error = error.__cause__ or error.__context__
    return None
