"""Student copies and grading (:mod:`dmlbook.classroom`).

The student copy of every chapter is written, and its exercises run; each must come out "not
attempted" and nothing else may fail. The solution notebooks must grade 100%, and a planted wrong
answer must grade as failed, with the checker's message.
"""

from __future__ import annotations

import builtins
import json
import re
import symtable
from pathlib import Path

import nbformat
import pytest

from dmlbook import classroom

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb"))


def test_solution_becomes_the_stub_at_its_indentation_and_hidden_tests_go():
    source = "\n".join(
        [
            "def f(x):",
            "    ### BEGIN SOLUTION",
            "    return 2 * x",
            "    ### END SOLUTION",
            "",
            "result = check(f)",
            "### BEGIN HIDDEN TESTS",
            'assert result.status == "passed"',
            "### END HIDDEN TESTS",
        ]
    )
    assert classroom.strip_solutions(source).splitlines() == [
        "def f(x):",
        "    # YOUR CODE HERE",
        "    " + classroom.STUB[1],
        "",
        "result = check(f)",
    ]


@pytest.mark.parametrize(
    "source, complaint",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without"),
        ("### BEGIN SOLUTION\n### BEGIN HIDDEN TESTS\n", "inside an open"),
        ("### BEGIN HIDDEN TESTS\n### END SOLUTION\n", "without"),
    ],
)
def test_unbalanced_markers_are_refused(source, complaint):
    with pytest.raises(ValueError, match=complaint):
        classroom.strip_solutions(source)


def test_student_copies_keep_everything_but_solutions_and_hidden_tests(tmp_path):
    written = classroom.write_student_copies(CHAPTERS, tmp_path)
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS]
    for source_path, student_path in zip(NOTEBOOKS, written, strict=True):
        source = nbformat.read(source_path, as_version=4)
        student = nbformat.read(student_path, as_version=4)
        assert len(student.cells) == len(source.cells)
        stubs = 0
        for before, after in zip(source.cells, student.cells, strict=True):
            assert after.cell_type == before.cell_type and after.metadata == before.metadata
            text = before.source
            if before.cell_type == "code" and "### BEGIN" in text:
                assert "### BEGIN" not in after.source and "### END" not in after.source
                stubs += after.source.count(classroom.STUB[1])
            else:
                assert after.source == text
        answers = sum(
            c.cell_type == "code" and classroom.BEGIN_SOLUTION in c.source for c in source.cells
        )
        assert stubs == answers >= 2, student_path.name


def test_student_copies_are_never_written_over_the_solutions(tmp_path):
    with pytest.raises(ValueError, match="holds the solutions"):
        classroom.write_student_copies(CHAPTERS, CHAPTERS)
    with pytest.raises(FileNotFoundError):
        classroom.write_student_copies(tmp_path / "nowhere", tmp_path / "out")


# --------------------------------------------------------------------------- grading, for real


def _exercise_cells(notebook) -> list:
    """The exercise section of a notebook: from its first answer cell to the end."""
    first = next(i for i, c in enumerate(notebook.cells) if _nbgrader(c))
    return notebook.cells[first:]


def _plant_wrong_answer(cell):
    """The answer cell with its solution replaced by ``return None``: a wrong answer."""
    source = classroom.strip_solutions(cell.source)
    cell.source = re.sub(
        r"^( *)# YOUR CODE HERE\n *raise NotImplementedError\(.*\)$",
        r"\1return None  # planted: a wrong answer",
        source,
        flags=re.MULTILINE,
    )
    assert "planted" in cell.source
    return cell


# What a notebook's kernel has without any cell binding it.
KERNEL_NAMES = set(dir(builtins)) | {"get_ipython", "display"}


def _unbound_reads(cells) -> list[str]:
    """The names ``cells``, run in order, read before one of them binds (assigns, defines or
    imports) them: at the top level of a cell, or as globals inside its functions and classes.
    Each cell is read as IPython runs it (magics included), with :mod:`symtable`'s scopes."""
    from IPython.core.inputtransformer2 import TransformerManager

    known, missing = set(KERNEL_NAMES), []
    for index, cell in enumerate(c for c in cells if c.cell_type == "code"):
        source = TransformerManager().transform_cell(cell.source)
        table = symtable.symtable(source, f"code cell {index}", "exec")
        known |= {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
        missing += [name for name in _global_reads(table) if name not in known]
    return missing


def _global_reads(table: symtable.SymbolTable):
    """Names a scope and the scopes inside it read from the cell's top level."""
    top = table.get_type() == "module"  # a str, or in Python 3.13 a StrEnum equal to it
    for symbol in table.get_symbols():
        if symbol.is_referenced() and (
            not (symbol.is_assigned() or symbol.is_imported()) if top else symbol.is_global()
        ):
            yield symbol.get_name()
    for child in table.get_children():
        yield from _global_reads(child)


def _first_code_cell(notebook):
    return next(c for c in notebook.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_exercises_come_last_and_need_only_the_first_code_cell(path):
    """What lets the test below run a student copy's first code cell and its exercises, not the
    whole chapter: no cell of the chapter's body can use an answer (the exercises come after it,
    and the copies differ only in the answer cells), and the exercises read no name but their own
    and the first cell's imports. nbval runs the body, the same in both copies, from the top."""
    notebook = nbformat.read(path, as_version=4)
    exercises = _exercise_cells(notebook)
    assert all(_nbgrader(c) for c in exercises if c.cell_type == "code"), (
        f"{path.name}: a code cell of the chapter's body follows its first exercise"
    )
    missing = _unbound_reads([_first_code_cell(notebook), *exercises])
    assert missing == [], (
        f"the exercises of {path.name} read {missing} from the chapter's body: bind them in the "
        "first code cell or in the exercise section, so that the student copy's test holds"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_finds_files_relative_to_its_notebook(path):
    """Student copies are run from another folder (``make student``, a grader's copy): data and
    scripts are found through the package (``dmlbook.datasets.EXAMPLES_DIR``), never ``../``."""
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            found = re.findall(r"""["'](\.\.(?:/[^"']*)?|\./[^"']*)["']|os\.pardir""", cell.source)
            assert found == [], f"{path.name} cell {index} names {found} relative to its folder"


def _nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_exercises_are_not_attempted_solutions_pass_and_a_wrong_answer_fails(
    path, tmp_path
):
    """In one kernel, in the student copy's folder, as a learner would: the student copy's first
    code cell and exercises (every exercise "not attempted", nothing else failing); then the
    solutions' exercise cells (all "passed"); then a planted wrong answer to exercise 1 (graded
    "failed", with the checker's message).

    The chapter's body is not run again here: the test above shows the exercises need nothing
    of it but the first cell, and nbval runs it (and the solutions' hidden tests) from the top.
    """
    student_path = classroom.write_student_copies(path, tmp_path)[0]
    student = nbformat.read(student_path, as_version=4)
    solution = nbformat.read(path, as_version=4)
    answers = [c for c in solution.cells if _nbgrader(c).get("solution")]
    blank_cells = [_first_code_cell(student), *_exercise_cells(student)]
    with classroom.GradingKernel(tmp_path) as kernel:
        blank = kernel.run(nbformat.v4.new_notebook(cells=blank_cells), path.name)
        solved = kernel.run(nbformat.v4.new_notebook(cells=_exercise_cells(solution)), path.name)
        planted_cells = [_plant_wrong_answer(nbformat.from_dict(answers[0]))]
        planted_cells.append(solution.cells[solution.cells.index(answers[0]) + 1])
        planted = kernel.run(nbformat.v4.new_notebook(cells=planted_cells), path.name)

    assert blank.errors == [], "the student copy's cells must run"
    assert len(blank.exercises) == len(answers) >= 2
    assert [e.status for e in blank.exercises] == ["not attempted"] * len(answers)
    assert all("not attempted" in e.message for e in blank.exercises)

    assert solved.errors == []
    assert [e.status for e in solved.exercises] == ["passed"] * len(answers)
    assert [e.exercise for e in solved.exercises] == [e.exercise for e in blank.exercises]
    assert classroom.summary([solved])["score"] == 1.0
    assert classroom.summary([blank])["score"] == 0.0

    (wrong,) = planted.exercises
    assert wrong.exercise == blank.exercises[0].exercise
    assert wrong.status == "failed" and wrong.message.startswith(
        f"Exercise {wrong.exercise!r} failed"
    )


def test_grade_command_writes_a_table_and_json(tmp_path, capsys):
    # a notebook of one exercise per status, plus a crash outside the exercises
    source = nbformat.read(CHAPTERS / "01_splitting_input_data.ipynb", as_version=4)
    setup = [c for c in source.cells if c.cell_type == "code"][0]
    exercises = _exercise_cells(source)
    answers = [c for c in exercises if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    checks = [exercises[exercises.index(a) + 1] for a in answers]
    cells = [setup, nbformat.v4.new_code_cell("1 / 0")]
    cells += [answers[0], checks[0]]  # solved
    cells += [_plant_wrong_answer(nbformat.from_dict(answers[1])), checks[1]]  # wrong
    untouched = nbformat.from_dict(answers[2])
    untouched.source = classroom.strip_solutions(untouched.source)
    cells += [untouched, checks[2]]  # not attempted
    folder = tmp_path / "class"
    folder.mkdir()
    nbformat.write(
        nbformat.v4.new_notebook(cells=cells, metadata=source.metadata), folder / "mix.ipynb"
    )

    assert classroom.main(["grade", str(folder)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mix\.ipynb +shard +passed", out)
    assert re.search(r"mix\.ipynb +lr_schedule +failed +Exercise 'lr_schedule' failed", out)
    assert re.search(r"mix\.ipynb +average_gradients +not attempted", out)
    assert "ERROR in mix.ipynb, cell 1: ZeroDivisionError: division by zero" in out
    assert "1/3 passed (33%), 1 failed, 1 not attempted" in out
    report = json.loads((folder / "grades.json").read_text())
    assert report["summary"] == {
        "passed": 1, "failed": 1, "not attempted": 1, "total": 3, "score": 1 / 3
    }  # fmt: skip
    (notebook,) = report["notebooks"]
    assert [e["status"] for e in notebook["exercises"]] == ["passed", "failed", "not attempted"]
    assert notebook["errors"] == ["cell 1: ZeroDivisionError: division by zero"]


@pytest.mark.parametrize(
    "stopper, timeout, what",
    [
        ("import os\nos._exit(3)", 60, "the kernel died"),
        ("import time\ntime.sleep(60)", 3, "it ran past the 3 s timeout"),
    ],
    ids=["kernel dies", "cell hangs"],
)
def test_a_notebook_that_kills_its_kernel_or_hangs_is_reported_not_fatal(
    tmp_path, stopper, timeout, what
):
    source = nbformat.read(CHAPTERS / "01_splitting_input_data.ipynb", as_version=4)
    exercises = _exercise_cells(source)
    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(stopper)]
    cells += exercises[:2]  # exercise 1's answer and checker: never reached
    path = tmp_path / "stops.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=source.metadata), path)

    grade = classroom.grade_notebook(path, timeout=timeout)
    assert grade.errors == [f"cell 1: {what}"]
    (exercise,) = grade.exercises
    assert exercise.status == "failed" and "cell 1 stopped the notebook" in exercise.message
    assert grade.seconds < timeout + 30
