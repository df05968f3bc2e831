"""No exercise has a back door (issue 36): an answer that only calls the library is rejected.

Every checker names, in ``@checker(name, writes=...)``, the library functions (dmlbook's and
torch's) that do what its exercise asks the learner to write; they are switched off while the
learner's code runs (:mod:`dmlbook.exercises`). Each chapter's exercise tests
(``test_<chapter>.py`` and ``test_<chapter>_*.py`` here) hold ``DELEGATING_ANSWERS``: for each
exercise, an answer that calls one of those functions and does nothing else. This file runs every
one of them and checks that the checker refuses it with a message that says it called the library.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import pytest

import dmlbook.exercises
from dmlbook.exercises import ExerciseFailed, SwitchedOff, switched_off

TESTS = Path(__file__).parent


def _checkers() -> list:
    found = []
    for info in pkgutil.iter_modules(dmlbook.exercises.__path__):
        module = importlib.import_module(f"dmlbook.exercises.{info.name}")
        for _, value in inspect.getmembers(module):
            if hasattr(value, "exercise") and getattr(value, "__module__", "") == module.__name__:
                found.append(value)
    return sorted(found, key=lambda c: (c.__module__, c.exercise))


def _delegating_answer(check):
    chapter = check.__module__.rsplit(".", 1)[1]
    paths = [TESTS / f"test_{chapter}.py", *sorted(TESTS.glob(f"test_{chapter}_*.py"))]
    path, answers = paths[0], {}
    for each in paths:
        spec = importlib.util.spec_from_file_location(f"_back_doors_{each.stem}", each)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        answers |= getattr(module, "DELEGATING_ANSWERS", {})
        path = each if "DELEGATING_ANSWERS" in vars(module) else path
    assert check.exercise in answers, (
        f"{path.name} has no DELEGATING_ANSWERS[{check.exercise!r}]: an answer that only calls "
        f"what the exercise asks for ({', '.join(check.writes) or 'nothing named yet'})"
    )
    return answers[check.exercise]


CHECKERS = _checkers()


def test_every_chapter_with_exercises_is_found():
    chapters = {c.__module__.rsplit(".", 1)[1] for c in CHECKERS}
    assert chapters >= {f"ch{n:02d}" for n in range(1, 14)} | {"zero"}


@pytest.mark.parametrize("check", CHECKERS, ids=lambda c: f"{c.__module__[18:]}.{c.exercise}")
def test_an_answer_that_calls_the_library_is_rejected(check, capsys):
    assert check.writes, (
        f"{check.__module__}.{check.__name__} names nothing in writes=: which library function "
        "does the job its exercise asks the learner to write?"
    )
    answer = _delegating_answer(check)
    with pytest.raises(ExerciseFailed) as failure:
        check(answer)
    message = str(failure.value)
    assert "called the library instead" in message and "switched off" in message, message
    # ... and the library is back afterwards: the checker switched it off only for the answer.
    for name in check.writes:
        assert not _is_stand_in(name), f"{name} is still switched off after the check"


@pytest.mark.parametrize("check", CHECKERS, ids=lambda c: f"{c.__module__[18:]}.{c.exercise}")
def test_the_library_function_itself_is_rejected(check, capsys):
    """``my_answer = lib.fn`` (or a partial of it) never passes through a switched-off name."""
    from dmlbook.exercises import _resolve

    for name in check.writes:
        original = _resolve(name)[2]
        for answer in (original, functools.partial(original)):
            with pytest.raises(ExerciseFailed, match="called the library instead.*switched off"):
                check(answer)


def _is_stand_in(name: str) -> bool:
    from dmlbook.exercises import _resolve

    code = getattr(_resolve(name)[2], "__code__", None)
    return code is not None and code.co_name == "switched_off"


def test_switched_off_reaches_every_binding_and_restores_them():
    """Switching a function off replaces its module attribute, every other module's name for it
    and the answer's own globals, and puts each back after the block."""
    from dmlbook.model_parallel import pipeline

    original = pipeline.one_f_one_b_schedule
    namespace = {"schedule": original}
    exec("def answer():\n    return schedule(2, 4)", namespace)
    with switched_off(
        ["dmlbook.model_parallel.pipeline.one_f_one_b_schedule"], namespace["answer"]
    ):
        assert pipeline.one_f_one_b_schedule is not original
        with pytest.raises(SwitchedOff, match="one_f_one_b_schedule is switched off"):
            namespace["answer"]()
    assert pipeline.one_f_one_b_schedule is original and namespace["schedule"] is original
    assert namespace["answer"]() == original(2, 4)


def test_switched_off_reaches_defaults_and_closures():
    from dmlbook.model_parallel import pipeline

    original = pipeline.one_f_one_b_schedule

    def by_default(q=original, *, k=original):
        return q(2, 4), k(2, 4)

    def make():
        captured = original
        return lambda: captured(2, 4)

    by_closure = make()
    name = "dmlbook.model_parallel.pipeline.one_f_one_b_schedule"
    for answer in (by_default, by_closure):
        with switched_off([name], answer), pytest.raises(SwitchedOff):
            answer()
        answer()  # restored
    assert by_default.__defaults__ == (original,) and by_default.__kwdefaults__ == {"k": original}
