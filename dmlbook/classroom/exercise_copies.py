"""The learners' exercise copies of the chapters: every solution replaced by a stub. Every chapter.

Each chapter ends with exercises. An exercise is two cells, marked the way nbgrader marks them
(in the source and in nbgrader's cell metadata), so an instructor who uses nbgrader can use the
notebooks as they are:

* the answer cell, with the solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
* the checker cell, which calls a checker from :mod:`dmlbook.exercises`, then, between
  ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``, asserts that the check passed.

Without nbgrader, ``make copy-exercises`` writes each notebook with every solution replaced by
nbgrader's stub (``# YOUR CODE HERE`` and a ``raise NotImplementedError`` that says what to do),
hidden tests removed and outputs cleared::

    python -m dmlbook.classroom copy-exercises chapters/ OUT/

Each checker reports that exception, raised in the learner's function, as "not attempted", so an
exercise copy runs top to bottom; :mod:`dmlbook.classroom.grading` grades it.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import nbformat

__all__ = [
    "BEGIN_HIDDEN",
    "BEGIN_SOLUTION",
    "END_HIDDEN",
    "END_SOLUTION",
    "STUB",
    "exercise_notebook",
    "notebooks_in",
    "strip_solutions",
    "write_exercise_copies",
]

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
# nbgrader's own code stub, with a message that says what to do
STUB = (
    "# YOUR CODE HERE",
    'raise NotImplementedError("exercise not yet implemented: replace these two lines with your '
    'answer")',
)


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


def exercise_notebook(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A notebook's exercise copy: solutions stubbed, hidden tests gone, no outputs."""
    exercises = copy.deepcopy(notebook)
    for number, cell in enumerate(exercises.cells):
        if cell.cell_type != "code":
            continue
        try:
            cell.source = strip_solutions(cell.source)
        except ValueError as e:
            raise ValueError(f"cell {number}: {e}") from None
        cell.outputs = []
        cell.execution_count = None
    return exercises


def write_exercise_copies(source: Path, out: Path) -> list[Path]:
    """Write the exercise copy of each notebook in ``source`` (a folder or one notebook) into
    the folder ``out``, with any other files beside them; return the notebooks written."""
    source, out = Path(source), Path(out)
    notebooks = notebooks_in(source)
    if out.resolve() == (source if source.is_dir() else source.parent).resolve():
        raise ValueError(f"{out} holds the solutions: write the exercise copies somewhere else")
    out.mkdir(parents=True, exist_ok=True)
    if source.is_dir():  # data or pictures the notebooks may read
        for other in sorted(source.iterdir()):
            if other.is_file() and other.suffix != ".ipynb" and not other.name.startswith("."):
                shutil.copy2(other, out / other.name)
    written = []
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        try:
            exercises = exercise_notebook(notebook)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        target = out / path.name
        nbformat.write(exercises, target)
        written.append(target)
    return written


def notebooks_in(path: Path) -> list[Path]:
    """``path`` if it is a notebook, else the notebooks in the folder ``path``, sorted."""
    path = Path(path)
    if path.is_file() and path.suffix == ".ipynb":
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a notebook nor a folder")
    notebooks = sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {path}")
    return notebooks
