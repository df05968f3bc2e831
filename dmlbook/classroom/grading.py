"""Grading the learners' exercise copies without nbgrader: every exercise passed, failed or not
attempted, as a table and JSON. Every chapter.

``python -m dmlbook.classroom grade OUT/`` (``make grade``) runs each notebook in a fresh kernel
of this Python, cell by cell, and reports each exercise as passed, failed (with the checker's
message) or not attempted (the stub of :mod:`dmlbook.classroom.exercise_copies` still in place).
The checkers append their results to the file named by :data:`dmlbook.exercises.GRADE_LOG`, which
the grader sets for the kernel, so the grader never parses printed text. A cell outside the
exercises that raises is reported as an error of that notebook.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from dmlbook.classroom.exercise_copies import BEGIN_SOLUTION, STUB, notebooks_in
from dmlbook.exercises import GRADE_LOG

__all__ = ["GradingKernel", "grade", "grade_notebook", "summary", "table", "to_json"]

STATUSES = ("passed", "failed", "not attempted")


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
    notebooks = [nb for path in paths for nb in notebooks_in(Path(path))]
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
    """The grades as JSON-ready data: every notebook's exercises and errors, and the summary."""
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
