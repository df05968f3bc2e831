"""For instructors: student copies of the chapter notebooks, and grading them. Every chapter.

Each chapter ends with exercises. An exercise is two cells, marked the way nbgrader marks them
(in the source and in nbgrader's cell metadata), so an instructor who uses nbgrader can use the
notebooks as they are:

* the answer cell, with the solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
* the checker cell, which calls a checker from :mod:`dmlbook.exercises`, then, between
  ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``, asserts that the check passed.

Without nbgrader, two commands do the same job::

    python -m dmlbook.classroom student chapters/ OUT/    # or: make student
    python -m dmlbook.classroom grade OUT/                 # a table, and OUT/grades.json

``student`` writes each notebook with every solution replaced by nbgrader's stub (``# YOUR CODE
HERE`` and a ``raise NotImplementedError`` that says what to do), hidden tests removed and outputs
cleared. Each checker reports that exception, raised in the learner's function, as "not
attempted", so a student copy runs top to bottom.

``grade`` runs each notebook in a fresh kernel of this Python, cell by cell, and reports each
exercise as passed, failed (with the checker's message) or not attempted. The checkers append
their results to the file named by :data:`dmlbook.exercises.GRADE_LOG`, which the grader sets for
the kernel, so the grader never parses printed text. A cell outside the exercises that raises is
reported as an error of that notebook.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from dmlbook.exercises import GRADE_LOG

__all__ = [
    "ExerciseGrade",
    "GradingKernel",
    "NotebookGrade",
    "grade",
    "grade_notebook",
    "main",
    "student_notebook",
    "strip_solutions",
    "write_student_copies",
]

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
# nbgrader's own code stub, with a message that says what to do
STUB = (
    "# YOUR CODE HERE",
    'raise NotImplementedError("exercise not yet implemented: replace these two lines with your '
    'answer")',
)
STATUSES = ("passed", "failed", "not attempted")


# --------------------------------------------------------------------------- student copies


def strip_solutions(source: str) -> str:
    """A code cell's source with each solution replaced by the stub and hidden tests removed."""
    out: list[str] = []
    inside: str | None = None
    for number, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker in (BEGIN_SOLUTION, BEGIN_HIDDEN):
            if inside:
                raise ValueError(f"line {number}: {marker!r} inside an open {inside!r} region")
            inside = marker
            if marker == BEGIN_SOLUTION:
                indent = line[: len(line) - len(line.lstrip())]
                out.extend(indent + stub for stub in STUB)
        elif marker in (END_SOLUTION, END_HIDDEN):
            expected = BEGIN_SOLUTION if marker == END_SOLUTION else BEGIN_HIDDEN
            if inside != expected:
                raise ValueError(f"line {number}: {marker!r} without {expected!r}")
            inside = None
        elif inside is None:
            out.append(line)
    if inside:
        raise ValueError(f"{inside!r} is never closed")
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def student_notebook(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student version of a notebook: solutions stubbed, hidden tests gone, no outputs."""
    student = copy.deepcopy(notebook)
    for number, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
        try:
            cell.source = strip_solutions(cell.source)
        except ValueError as e:
            raise ValueError(f"cell {number}: {e}") from None
        cell.outputs = []
        cell.execution_count = None
    return student


def write_student_copies(source: Path, out: Path) -> list[Path]:
    """Write the student version of each notebook in ``source`` (a folder or one notebook) into
    the folder ``out``, with any other files beside them; return the notebooks written."""
    source, out = Path(source), Path(out)
    notebooks = _notebooks(source)
    if out.resolve() == (source if source.is_dir() else source.parent).resolve():
        raise ValueError(f"{out} holds the solutions: write the student copies somewhere else")
    out.mkdir(parents=True, exist_ok=True)
    if source.is_dir():  # data or pictures the notebooks may read
        for other in sorted(source.iterdir()):
            if other.is_file() and other.suffix != ".ipynb" and not other.name.startswith("."):
                shutil.copy2(other, out / other.name)
    written = []
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        try:
            student = student_notebook(notebook)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        target = out / path.name
        nbformat.write(student, target)
        written.append(target)
    return written


def _notebooks(path: Path) -> list[Path]:
    if path.is_file() and path.suffix == ".ipynb":
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a notebook nor a folder")
    notebooks = sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {path}")
    return notebooks


# --------------------------------------------------------------------------- grading


@dataclass
class ExerciseGrade:
    """One exercise of one notebook: passed, failed or not attempted, and why."""

    exercise: str
    status: str
    message: str
    cell: int  # the checker cell's index in the notebook


@dataclass
class NotebookGrade:
    """What grading one notebook found."""

    notebook: str
    exercises: list[ExerciseGrade] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # cells outside the exercises that raised
    seconds: float = 0.0


def _nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _is_checker(cell) -> bool:
    return cell.cell_type == "code" and (
        bool(_nbgrader(cell).get("grade")) or ".check_" in cell.source
    )


def _is_answer(cell) -> bool:
    return cell.cell_type == "code" and (
        bool(_nbgrader(cell).get("solution"))
        or BEGIN_SOLUTION in cell.source
        or STUB[0] in cell.source
    )


def _error_of(cell) -> str | None:
    for output in cell.get("outputs", []):
        if output.output_type == "error":
            return f"{output.ename}: {output.evalue}"
    return None


class GradingKernel:
    """A fresh kernel of this Python, in which notebooks' cells run one by one and each exercise
    is graded as its checker cell runs. One kernel can run several notebooks' cells in turn, as a
    learner does who runs the notebook, then fills in an answer and runs the exercise again."""

    def __init__(self, folder: Path, timeout: float = 600.0) -> None:
        self.folder, self.timeout = Path(folder), timeout

    def __enter__(self) -> GradingKernel:
        from nbclient import NotebookClient

        self._tmp = tempfile.TemporaryDirectory(prefix="dmlbook-grade-")
        self.log = Path(self._tmp.name) / "checks.jsonl"
        self.log.touch()
        self.client = NotebookClient(
            nbformat.v4.new_notebook(),
            kernel_name="python3",
            timeout=self.timeout,
            allow_errors=True,
            shutdown_kernel="graceful",  # it exits as a learner's does: its atexit work runs
            resources={"metadata": {"path": str(self.folder)}},
        )
        # nbclient's own (asynchronous) kernel manager: it notices a dead kernel within seconds
        kernel = self.client.create_kernel_manager()
        # this interpreter, whatever `python` means on PATH
        kernel.kernel_spec.argv = [
            sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"
        ]  # fmt: skip
        if sys.platform == "linux":  # Unix sockets: no unencrypted TCP for the kernel to warn of
            kernel.transport, kernel.ip = "ipc", str(Path(self._tmp.name) / "kernel")
        env = {**os.environ, GRADE_LOG: str(self.log), "MPLBACKEND": "Agg"}
        self._kernel = self.client.setup_kernel(env=env, cwd=str(self.folder))
        self._kernel.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._kernel.__exit__(*exc)  # shuts the kernel down
        finally:
            self._tmp.cleanup()

    def run(self, notebook: nbformat.NotebookNode, name: str) -> NotebookGrade:
        """Run every code cell of ``notebook`` in this kernel and grade its exercises."""
        result = NotebookGrade(name)
        self.client.nb = notebook  # nbclient writes each executed cell back into it
        started = time.monotonic()
        answer_error: str | None = None  # of the answer cell before the next checker
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        stopped: str | None = None  # why the rest of the notebook could not run
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code":
                continue
            if stopped:
                if _is_checker(cell):
                    name = _nbgrader(cell).get("grade_id", f"cell {index}")
                    result.exercises.append(ExerciseGrade(name, "failed", stopped, index))
                continue
            seen = self.log.stat().st_size
            try:
                self.client.execute_cell(cell, index)
            except (DeadKernelError, CellTimeoutError) as e:
                what = (
                    "the kernel died"
                    if isinstance(e, DeadKernelError)
                    else (f"it ran past the {self.timeout:g} s timeout")
                )
                stopped = f"not run: cell {index} stopped the notebook ({what})"
                result.errors.append(f"cell {index}: {what}")
                if _is_checker(cell):
                    name = _nbgrader(cell).get("grade_id", f"cell {index}")
                    result.exercises.append(ExerciseGrade(name, "failed", f"{what}", index))
                continue
            error = _error_of(cell)
            if _is_checker(cell):
                with self.log.open() as f:
                    f.seek(seen)
                    reports = [json.loads(line) for line in f if line.strip()]
                result.exercises.append(_exercise_grade(cell, index, reports, error, answer_error))
                answer_error = None
            elif _is_answer(cell):
                answer_error = error
            elif error:
                result.errors.append(f"cell {index}: {error}")
        result.seconds = time.monotonic() - started
        return result


def grade_notebook(path: Path, timeout: float = 600.0) -> NotebookGrade:
    """Run one notebook in a fresh kernel of this Python and grade each of its exercises."""
    path = Path(path)
    with GradingKernel(path.parent, timeout) as kernel:
        return kernel.run(nbformat.read(path, as_version=4), path.name)


def _exercise_grade(cell, index, reports, error, answer_error) -> ExerciseGrade:
    name = _nbgrader(cell).get("grade_id", f"cell {index}")
    if reports:  # the checker's own verdict (the last one, if the cell checks twice)
        last = reports[-1]
        return ExerciseGrade(last["exercise"], last["status"], last["message"], index)
    why = error or "the checker cell ran, but no checker reported a result"
    if answer_error:
        why = f"the answer cell raised {answer_error}; then {why}"
    return ExerciseGrade(name, "failed", why, index)


def grade(paths: Iterable[Path], timeout: float = 600.0, progress=None) -> list[NotebookGrade]:
    """Grade each notebook (a folder means every notebook in it), one fresh kernel each."""
    notebooks = [nb for path in paths for nb in _notebooks(Path(path))]
    grades = []
    for notebook in notebooks:
        if progress:
            progress(f"grading {notebook.name} ...")
        grades.append(grade_notebook(notebook, timeout))
        if progress:
            progress(f"  {grades[-1].seconds:.1f} s")
    return grades


def summary(grades: list[NotebookGrade]) -> dict:
    """Counts of each status over every exercise, and the share passed."""
    counts = {status: 0 for status in STATUSES}
    for notebook in grades:
        for exercise in notebook.exercises:
            counts[exercise.status] += 1
    total = sum(counts.values())
    return dict(counts, total=total, score=counts["passed"] / total if total else 0.0)


def to_json(grades: list[NotebookGrade]) -> dict:
    return dict(notebooks=[asdict(g) for g in grades], summary=summary(grades))


def table(grades: list[NotebookGrade]) -> str:
    """A plain-text table: one row per exercise, then errors and the total."""
    rows = [("notebook", "exercise", "status", "message")]
    for notebook in grades:
        for e in notebook.exercises:
            message = e.message.splitlines()[0] if e.message else ""
            rows.append((notebook.notebook, e.exercise, e.status, message[:90]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  -------")
    for notebook in grades:
        lines += [f"ERROR in {notebook.notebook}, {error}" for error in notebook.errors]
    s = summary(grades)
    lines.append(
        f"{s['passed']}/{s['total']} passed ({100 * s['score']:.0f}%), {s['failed']} failed, "
        f"{s['not attempted']} not attempted"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.classroom", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    student = commands.add_parser("student", help="write student copies of the notebooks")
    student.add_argument("source", type=Path, help="the chapters folder, or one notebook")
    student.add_argument("out", type=Path, help="the folder to write the student copies into")
    grader = commands.add_parser("grade", help="run notebooks and grade their exercises")
    grader.add_argument("paths", type=Path, nargs="+", help="folders or notebooks to grade")
    grader.add_argument(
        "--json",
        type=Path,
        help="where to write the JSON report (default: grades.json in the "
        "first folder given; '-' prints it)",
    )
    grader.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    args = parser.parse_args(argv)

    if args.command == "student":
        written = write_student_copies(args.source, args.out)
        print(f"wrote {len(written)} student notebooks to {args.out}")
        return 0
    grades = grade(args.paths, args.timeout, progress=lambda line: print(line, file=sys.stderr))
    print(table(grades))
    report = json.dumps(to_json(grades), indent=2)
    if args.json == Path("-"):
        print(report)
    else:
        first = args.paths[0] if args.paths[0].is_dir() else args.paths[0].parent
        target = args.json or first / "grades.json"
        target.write_text(report + "\n")
        print(f"JSON report: {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
