"""The chapter notebooks as files: no stored outputs, one kernel spec, well-formed exercises, and
no call to a ``dmlbook`` name that does not exist (the drift guard).

The drift guard is the d2l class of break: a refactor removes or renames a function, the tests of
the package still pass, and a notebook that calls it fails only when somebody runs it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from dmlbook.classroom import exercise_copies

CHAPTERS = Path(__file__).resolve().parents[2] / "chapters"
NOTEBOOKS = sorted(p for p in CHAPTERS.glob("*.ipynb") if p.name[0].isdigit())  # not the glossary
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def _code(path: Path) -> list[str]:
    notebook = nbformat.read(path, as_version=4)
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def _parse(source: str, where: str) -> ast.Module:
    try:
        return ast.parse(_python(source, where))
    except SyntaxError as e:
        raise AssertionError(f"{where}: not plain Python: {e}") from e


def _python(source: str, where: str) -> str:
    """A cell as Python. The chapters' only IPython syntax is dmlbook's own magics: a ``%%ranks``
    cell's body is Python that runs on the ranks (its names are checked like any other), and a
    line magic becomes the call IPython makes of it."""
    if source.startswith("%%"):
        magic, _, body = source.partition("\n")
        assert magic.split()[0] == "%%ranks", f"{where}: a cell magic other than %%ranks: {magic}"
        return body
    return TransformerManager().transform_cell(source)


def dmlbook_names(sources: list[str], where: str) -> set[tuple[str, str]]:
    """Every (module, attribute) that the code uses from dmlbook: ``from dmlbook.m import a``,
    and ``alias.a`` where alias names a dmlbook module (``from dmlbook import m``,
    ``import dmlbook.m as alias``, ``from dmlbook.exercises import ch01``)."""
    used: set[tuple[str, str]] = set()
    modules: dict[str, str] = {}  # local name -> dmlbook module it names
    trees = [_parse(source, where) for source in sources]
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dmlbook"):
                for alias in node.names:
                    used.add((node.module, alias.name))
                    full = f"{node.module}.{alias.name}"
                    if _is_module(full):
                        modules[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("dmlbook"):
                        used.add((alias.name, ""))
                        if alias.asname:
                            modules[alias.asname] = alias.name
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in modules:
                    used.add((modules[node.value.id], node.attr))
    return used


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def missing(used: set[tuple[str, str]]) -> list[str]:
    gone = []
    for module_name, attribute in sorted(used):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            gone.append(module_name)
            continue
        if (
            attribute
            and not hasattr(module, attribute)
            and not _is_module(f"{module_name}.{attribute}")
        ):
            gone.append(f"{module_name}.{attribute}")
    return gone


def test_the_chapters_are_all_here():
    assert len(NOTEBOOKS) == 14, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_dmlbook_name_a_notebook_uses_exists(path):
    used = dmlbook_names(_code(path), path.name)
    assert len(used) >= 3, (
        f"{path.name} uses too little of dmlbook for this guard to mean much: {used}"
    )
    assert missing(used) == []


def test_the_drift_guard_catches_a_removed_function():
    sources = [
        "from dmlbook.comm import collectives as c\n"
        "from dmlbook.launch import run, no_such_helper\n",
        "c.chunk_holdings\nc.all_reduce_that_was_renamed(t)\n",
        "from dmlbook.exercises import ch01\nch01.check_shard\nch01.check_removed\n",
        "from dmlbook.module_that_was_split import helper\n",
        "%%ranks --on 0\nfrom dmlbook.comm import collectives\ncollectives.gone_from_the_ranks()\n",
        "%load_ext dmlbook\nshards = %ranks pull shard\n",
    ]
    assert missing(dmlbook_names(sources, "planted")) == [
        "dmlbook.comm.collectives.all_reduce_that_was_renamed",
        "dmlbook.comm.collectives.gone_from_the_ranks",
        "dmlbook.exercises.ch01.check_removed",
        "dmlbook.launch.no_such_helper",
        "dmlbook.module_that_was_split",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs_and_with_the_python3_kernel(path):
    raw = json.loads(path.read_text())
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))
    assert raw["metadata"]["kernelspec"] == KERNELSPEC
    for number, cell in enumerate(raw["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {number} has stored outputs"
            assert cell["execution_count"] is None, f"cell {number} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_are_answer_then_checker_cells_marked_for_nbgrader(path):
    notebook = nbformat.read(path, as_version=4)
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    answers = [i for i, c in enumerate(cells) if exercise_copies.BEGIN_SOLUTION in c.source]
    assert len(answers) >= 2, "every chapter has at least two exercises"
    ids = []
    for i in answers:
        answer, check = cells[i], cells[i + 1]
        meta, check_meta = answer.metadata["nbgrader"], check.metadata["nbgrader"]
        assert meta["solution"] and not meta["grade"]
        assert check_meta["grade"] and not check_meta["solution"] and check_meta["locked"]
        assert check_meta["points"] == 1
        assert ".check_" in check.source and 'result.status == "passed"' in check.source
        assert exercise_copies.BEGIN_HIDDEN in check.source
        ids += [meta["grade_id"], check_meta["grade_id"]]
    assert len(ids) == len(set(ids)), "nbgrader needs unique grade ids"
    graded = [c for c in cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) == len(answers), "a checker cell without an answer cell before it"
