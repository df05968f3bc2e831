"""The learners' exercise copies and grading them (:mod:`dmlbook.classroom.exercise_copies`,
:mod:`dmlbook.classroom.grading`, ``python -m dmlbook.classroom``).

The exercise copy of every chapter is written, and its exercises run; each must come out "not
attempted" and nothing else may fail. The solution notebooks must grade 100%, and a planted wrong
answer must grade as failed, with the checker's message.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import json
import re
import symtable
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from dmlbook.classroom import exercise_copies, grading
from dmlbook.classroom.__main__ import main

CHAPTERS = Path(__file__).resolve().parents[3] / "chapters"
NOTEBOOKS = sorted(p for p in CHAPTERS.glob("*.ipynb") if p.name[0].isdigit())  # not the glossary


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
    assert exercise_copies.strip_solutions(source).splitlines() == [
        "def f(x):",
        "    # YOUR CODE HERE",
        "    " + exercise_copies.STUB[1],
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
        exercise_copies.strip_solutions(source)


def test_exercise_copies_keep_everything_but_solutions_and_hidden_tests(tmp_path):
    written = exercise_copies.write_exercise_copies(CHAPTERS, tmp_path)
    # the glossary goes along, unchanged: the chapters' terms link to it
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS] + ["glossary.ipynb"]
    glossary = nbformat.read(CHAPTERS / "glossary.ipynb", as_version=4)
    assert nbformat.read(written[-1], as_version=4).cells == glossary.cells
    for source_path, copy_path in zip(NOTEBOOKS, written[:-1], strict=True):
        source = nbformat.read(source_path, as_version=4)
        exercises = nbformat.read(copy_path, as_version=4)
        assert len(exercises.cells) == len(source.cells)
        stubs = 0
        for before, after in zip(source.cells, exercises.cells, strict=True):
            assert after.cell_type == before.cell_type and after.metadata == before.metadata
            text = before.source
            if before.cell_type == "code" and "### BEGIN" in text:
                assert "### BEGIN" not in after.source and "### END" not in after.source
                stubs += after.source.count(exercise_copies.STUB[1])
            else:
                assert after.source == text
        answers = sum(  # a cell may hold several solution regions (a class's methods)
            c.source.count(exercise_copies.BEGIN_SOLUTION) for c in source.cells
            if c.cell_type == "code"
        )  # fmt: skip
        assert stubs == answers >= 2, copy_path.name


def test_exercise_copies_are_never_written_over_the_solutions(tmp_path, capsys):
    with pytest.raises(ValueError, match="holds the solutions"):
        exercise_copies.write_exercise_copies(CHAPTERS, CHAPTERS)
    with pytest.raises(FileNotFoundError):
        exercise_copies.write_exercise_copies(tmp_path / "nowhere", tmp_path / "out")
    # the command says the same in one line, and exits 1
    assert main(["copy-exercises", str(CHAPTERS), str(CHAPTERS)]) == 1
    assert "copy-exercises: " in (err := capsys.readouterr().err) and "holds the solutions" in err
    assert main(["grade", str(tmp_path / "nowhere")]) == 1
    assert "neither a notebook nor a folder" in capsys.readouterr().err


def test_copy_exercises_command_writes_each_chapter(tmp_path, capsys):
    out = tmp_path / "copies"
    assert main(["copy-exercises", str(CHAPTERS / NOTEBOOKS[0].name), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 1 exercise copies to {out}"
    (written,) = out.iterdir()
    assert written.name == NOTEBOOKS[0].name
    cells = nbformat.read(written, as_version=4).cells
    assert any(exercise_copies.STUB[1] in c.source for c in cells)


# --------------------------------------------------------------------------- grading, for real


def _exercise_cells(notebook) -> list:
    """The exercise section of a notebook: from its first answer cell to the end."""
    first = next(i for i, c in enumerate(notebook.cells) if _nbgrader(c))
    return notebook.cells[first:]


def _plant_wrong_answer(cell):
    """The answer cell with its solution replaced by ``return None``: a wrong answer."""
    source = exercise_copies.strip_solutions(cell.source)
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
    """What lets the test below run an exercise copy's first code cell and its exercises, not the
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
        "first code cell or in the exercise section, so that the exercise copy's test holds"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_finds_files_relative_to_its_notebook(path):
    """Exercise copies run from another folder (``make copy-exercises``, a grader's copy): data and
    scripts are found through the package (``dmlbook.datasets.EXAMPLES_DIR``), never ``../``."""
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            found = re.findall(r"""["'](\.\.(?:/[^"']*)?|\./[^"']*)["']|os\.pardir""", cell.source)
            assert found == [], f"{path.name} cell {index} names {found} relative to its folder"


def _nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


# Forget every name the last chapter's cells bound and work in the next chapter's folder. What a
# kernel keeps besides its names (imported modules, the warm rank helper) is the same code a
# fresh kernel would load, and the test above shows each chapter's exercises read no name but
# those of their own first cell and exercise section.
_FRESH_NAMESPACE = """\
%reset -f
import os as _os
import matplotlib.pyplot as _plt
_plt.close("all")
_os.chdir({folder!r})
del _os, _plt
"""


@pytest.fixture(scope="module")
def grading_kernel(tmp_path_factory):
    """One kernel for every chapter's exercises below. A kernel of its own per chapter cost 14
    kernels and 14 rank helpers, each importing torch (52 of the module's CPU-seconds here went
    to these 14 tests); a kernel that died is replaced before the next chapter."""
    kernels = []
    reset = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell()])

    def kernel_for(folder: Path) -> grading.GradingKernel:
        reset.cells[0].source = _FRESH_NAMESPACE.format(folder=str(folder))
        for _ in range(2):
            if not kernels:
                kernel = grading.GradingKernel(tmp_path_factory.mktemp("kernel"))
                kernels.append(kernel.__enter__())
            done = kernels[-1].run(reset, "reset")
            if done.errors == []:
                return kernels[-1]
            kernels.pop().__exit__(None, None, None)  # it died, or cannot forget: a new one
        raise AssertionError(f"a fresh kernel could not start in {folder}: {done.errors}")

    yield kernel_for
    for kernel in kernels:
        kernel.__exit__(None, None, None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercise_copies_are_not_attempted_solutions_pass_and_a_wrong_answer_fails(
    path, tmp_path, grading_kernel
):
    """In the module's kernel, its names forgotten, in the exercise copy's folder, as a learner
    would: the exercise copy's first code cell and exercises (every exercise "not attempted",
    nothing else failing); then the solutions' exercise cells (all "passed"); then a planted
    wrong answer to exercise 1 (graded "failed", with the checker's message).

    The chapter's body is not run again here: the test above shows the exercises need nothing
    of it but the first cell, and nbval runs it (and the solutions' hidden tests) from the top.
    """
    copy_path = exercise_copies.write_exercise_copies(path, tmp_path)[0]
    exercises = nbformat.read(copy_path, as_version=4)
    solution = nbformat.read(path, as_version=4)
    answers = [c for c in solution.cells if _nbgrader(c).get("solution")]
    blank_cells = [_first_code_cell(exercises), *_exercise_cells(exercises)]
    kernel = grading_kernel(tmp_path)
    blank = kernel.run(nbformat.v4.new_notebook(cells=blank_cells), path.name)
    solved = kernel.run(nbformat.v4.new_notebook(cells=_exercise_cells(solution)), path.name)
    planted_cells = [_plant_wrong_answer(nbformat.from_dict(answers[0]))]
    planted_cells.append(solution.cells[solution.cells.index(answers[0]) + 1])
    planted = kernel.run(nbformat.v4.new_notebook(cells=planted_cells), path.name)

    assert blank.errors == [], "the exercise copy's cells must run"
    assert len(blank.exercises) == len(answers) >= 2
    assert [e.status for e in blank.exercises] == ["not attempted"] * len(answers)
    assert all("not attempted" in e.message for e in blank.exercises)

    assert solved.errors == []
    assert [e.status for e in solved.exercises] == ["passed"] * len(answers)
    assert [e.exercise for e in solved.exercises] == [e.exercise for e in blank.exercises]
    assert grading.summary([solved])["score"] == 1.0
    assert grading.summary([blank])["score"] == 0.0

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
    untouched.source = exercise_copies.strip_solutions(untouched.source)
    cells += [untouched, checks[2]]  # not attempted
    folder = tmp_path / "class"
    folder.mkdir()
    nbformat.write(
        nbformat.v4.new_notebook(cells=cells, metadata=source.metadata), folder / "mix.ipynb"
    )

    assert main(["grade", str(folder)]) == 0
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

    grade = grading.grade_notebook(path, timeout=timeout)
    assert grade.errors == [f"cell 1: {what}"]
    (exercise,) = grade.exercises
    assert exercise.status == "failed" and "cell 1 stopped the notebook" in exercise.message
    assert grade.seconds < timeout + 30


# ----------------------------------------------------------------- no answer before its exercise

SHOW_SOURCE = {"getsource", "getsourcelines", "show_source"}  # calls that print an object's code


def _imports_namespace(notebook) -> dict:
    """The names a notebook binds by its import statements and plain aliases (``x = mod.y``),
    run in order: enough to resolve what a cell shows the source of, or what a checker is."""
    namespace: dict = {}
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.parse(TransformerManager().transform_cell(cell.source)).body:
            alias = (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute | ast.Name)
            )
            if isinstance(node, ast.Import | ast.ImportFrom) or alias:
                try:
                    exec(compile(ast.Module([node], []), "<imports>", "exec"), namespace)
                except (AttributeError, NameError):
                    pass  # an alias of something a cell computes: not a library object
    return namespace


def _shown_sources(cell, namespace) -> list[tuple[str, object]]:
    """What ``cell`` prints the source of: (expression, the object it names). A call inside a
    ``for name in <library objects>:`` loop names each of them in turn."""
    tree = ast.parse(TransformerManager().transform_cell(cell.source))
    return [shown for statement in tree.body for shown in _shown_in(statement, [dict(namespace)])]


def _shown_in(node, scopes: list[dict]) -> list[tuple[str, object]]:
    if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
        try:
            items = list(eval(ast.unparse(node.iter), scopes[0]))
        except Exception:  # noqa: BLE001 (a loop over computed values: read it as it stands)
            items = None
        if items is not None:
            scopes = [{**scope, node.target.id: item} for scope in scopes for item in items]
    shown = []
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in SHOW_SOURCE:
            expression = ast.unparse(node.args[0])
            for scope in scopes:
                try:
                    shown.append((expression, eval(expression, scope)))
                except Exception as e:  # noqa: BLE001 (say which, below)
                    raise AssertionError(
                        f"cannot tell what `{ast.unparse(node)}` shows ({e}): name it through "
                        "an import or an alias of one, so this check can see it"
                    ) from e
    for child in ast.iter_child_nodes(node):
        shown += _shown_in(child, scopes)
    return shown


def _library_objects_used_by(check) -> set[int]:
    """The ids of the dmlbook objects (outside the checkers) that a checker reads: globals and
    attribute chains in its code, its nested functions' and the exercise helpers' it calls. The
    checker's reference answer is among them."""
    import dis
    import types

    found: dict[int, object] = {}
    seen_code: set[int] = set()
    todo = [inspect.unwrap(check)]
    while todo:
        function = todo.pop()
        codes, globals_ = [function.__code__], function.__globals__
        while codes:
            code = codes.pop()
            if id(code) in seen_code:
                continue
            seen_code.add(id(code))
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            value = None
            for instruction in dis.get_instructions(code):
                if instruction.opname == "LOAD_GLOBAL":
                    value = globals_.get(instruction.argval)
                elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and value is not None:
                    value = getattr(value, instruction.argval, None)
                else:
                    value = None
                    continue
                module = getattr(value, "__module__", None) or ""
                if isinstance(value, types.ModuleType) or not module.startswith("dmlbook"):
                    continue
                if module.startswith("dmlbook.exercises"):
                    if isinstance(value, types.FunctionType) and id(value) not in found:
                        found[id(value)] = value
                        todo.append(value)
                else:
                    found[id(value)] = value
    return {key for key, value in found.items() if not _is_exercise_helper(value)}


def _is_exercise_helper(value) -> bool:
    return (getattr(value, "__module__", "") or "").startswith("dmlbook.exercises")


def _checks(cell, namespace) -> list:
    """The checker functions a checker cell calls (``chXX.check_something(answer)``)."""
    checks = []
    for node in ast.walk(ast.parse(cell.source)):
        if isinstance(node, ast.Call):
            try:
                target = eval(ast.unparse(node.func), dict(namespace))
            except Exception:  # noqa: BLE001 (the learner's own names)
                continue
            if hasattr(target, "exercise") and hasattr(target, "__wrapped__"):
                checks.append(target)
    return checks


def answers_shown_early(notebook) -> list[str]:
    """Each exercise whose answer a cell before the exercises prints: the reference a checker
    compares against, shown with ``inspect.getsource`` (or a helper that prints code)."""
    namespace = _imports_namespace(notebook)
    exercises = _exercise_cells(notebook)
    body = notebook.cells[: len(notebook.cells) - len(exercises)]
    shown = [
        (index, expression, obj)
        for index, cell in enumerate(body)
        if cell.cell_type == "code"
        for expression, obj in _shown_sources(cell, namespace)
    ]
    called = [
        (index, expression, obj)
        for index, cell in enumerate(body)
        if cell.cell_type == "code"
        for expression, obj in _called(cell, namespace)
    ]
    found = []
    for cell in exercises:
        if not (cell.cell_type == "code" and _nbgrader(cell).get("grade")):
            continue
        for check in _checks(cell, namespace):
            used = _library_objects_used_by(check)
            answers = {id(_resolve_dotted(name)) for name in getattr(check, "writes", ())}
            for index, expression, obj in shown:
                if id(inspect.unwrap(obj)) in used | answers or id(obj) in used | answers:
                    found.append(
                        f"cell {index} prints the source of {expression}, which "
                        f"{check.__name__} (exercise {check.exercise!r}) checks the answer against"
                    )
            for index, expression, obj in called:
                if id(obj) in answers or id(inspect.unwrap(obj)) in answers:
                    found.append(
                        f"cell {index} calls {expression}, which does what exercise "
                        f"{check.exercise!r} asks the learner to write: its output is the answer"
                    )
    return found


def _resolve_dotted(name: str):
    from dmlbook.exercises import _resolve

    return _resolve(name)[2]


def _called(cell, namespace) -> list[tuple[str, object]]:
    """What ``cell`` calls, where the callee is a name or attribute chain the notebook's imports
    resolve: (expression, the object). Calls inside a ``%%ranks`` cell count too."""
    source = cell.source
    if source.startswith("%%ranks"):  # the cell's body is Python that runs on the ranks
        source = source.partition("\n")[2]
    tree = ast.parse(TransformerManager().transform_cell(source))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            expression = ast.unparse(node.func)
            try:
                found.append((expression, eval(expression, dict(namespace))))
            except Exception:  # noqa: BLE001 (the notebook's own names: not library objects)
                continue
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_before_an_exercise_prints_its_answer(path):
    """A learner who reads the chapter top to bottom meets each exercise before its answer:
    no cell of the body prints the source of what an exercise's checker compares the answer
    with (issue 22: chapter 6 printed ``one_f_one_b_schedule`` six cells before exercise 1)."""
    notebook = nbformat.read(path, as_version=4)
    assert answers_shown_early(notebook) == []


def test_an_answer_printed_early_is_found():
    """The check above is not vacuous: printing exercise 1's reference before it is caught."""
    path = next(p for p in NOTEBOOKS if p.name.startswith("06_"))
    notebook = nbformat.read(path, as_version=4)
    namespace = _imports_namespace(notebook)
    first_checker = next(
        c for c in _exercise_cells(notebook) if c.cell_type == "code" and _nbgrader(c).get("grade")
    )
    (check,) = _checks(first_checker, namespace)
    module = importlib.import_module(check.__module__)
    reference = next(
        name
        for name in _module_level_names(notebook, namespace)
        if id(_lookup(namespace, name)) in _library_objects_used_by(check)
    )
    before = answers_shown_early(notebook)
    planted = nbformat.v4.new_code_cell(f"import inspect\nprint(inspect.getsource({reference}))")
    notebook.cells.insert(1, planted)
    found = [line for line in answers_shown_early(notebook) if line.startswith("cell 1 ")]
    assert len(found) == 1 and reference in found[0], (module.__name__, found)
    assert len(answers_shown_early(notebook)) == len(before) + 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_shows_private_code(path):
    """What a chapter prints the source of is public API, not a module's private helper
    (issue 36: 8 of the chapters' 33 ``getsource`` calls showed ``_`` names)."""
    notebook = nbformat.read(path, as_version=4)
    namespace = _imports_namespace(notebook)
    private = [
        f"cell {index} shows {expression} ({obj.__module__}.{obj.__qualname__})"
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for expression, obj in _shown_sources(cell, namespace)
        if any(p.startswith("_") and not p.endswith("__") for p in _public_path(obj))
    ]
    assert private == []


def _public_path(obj) -> list[str]:
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    module = getattr(obj, "__module__", "") or ""
    return module.split(".") + (getattr(obj, "__qualname__", "") or "").split(".")


def test_a_call_whose_output_is_the_answer_is_found():
    """A cell that calls what an exercise asks the learner to write (its output is the answer,
    as chapter 11 once drew ``rank_batch``'s split) is found, in a plain or a ``%%ranks`` cell."""
    new = nbformat.v4
    answer = new.new_code_cell("def order(stage, stages, microbatches):\n    return []")
    answer.metadata["nbgrader"] = {"solution": True, "grade": False}
    check = new.new_code_cell("ch06.check_one_f_one_b_order(order)")
    check.metadata["nbgrader"] = {"grade": True, "solution": False}
    imports = (
        "from dmlbook.exercises import ch06\nfrom dmlbook.model_parallel import pipeline as pp"
    )
    for body in ("pp.one_f_one_b_schedule(2, 4)", "%%ranks\nx = pp.one_f_one_b_schedule(2, 4)"):
        notebook = new.new_notebook(
            cells=[new.new_code_cell(imports), new.new_code_cell(body), answer, check]
        )
        (found,) = answers_shown_early(notebook)
        assert found.startswith("cell 1 calls pp.one_f_one_b_schedule"), found
    quiet = new.new_notebook(cells=[new.new_code_cell(imports), answer, check])
    assert answers_shown_early(quiet) == []


def _module_level_names(notebook, namespace) -> list[str]:
    """``alias.attr`` for every public function or class of each dmlbook module the notebook
    imports under an alias: candidates for a planted ``getsource``."""
    import types

    names = []
    for alias, value in namespace.items():
        if isinstance(value, types.ModuleType) and value.__name__.startswith("dmlbook"):
            if value.__name__.startswith("dmlbook.exercises"):
                continue
            for attr, member in vars(value).items():
                public = not attr.startswith("_")
                if public and (inspect.isfunction(member) or inspect.isclass(member)):
                    names.append(f"{alias}.{attr}")
    return names


def _lookup(namespace, dotted: str):
    alias, attr = dotted.split(".", 1)
    return getattr(namespace[alias], attr)


# ----------------------------------------------------------------- what an exercise copy holds

INSTRUCTOR_TEXT = re.compile(
    r"instructor|(student|learner|exercise) (copy|copies|version)"
    r"|BEGIN (SOLUTION|HIDDEN TESTS)|END SOLUTION",
    re.IGNORECASE,
)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_an_exercise_copy_holds_no_solution_and_no_instructor_text(path):
    """What a learner receives: no hidden test is left, no text cell quotes a line of a solution
    (stubbing removes the solutions from the code cells), and no cell speaks to the instructor
    about the copy itself."""
    notebook = nbformat.read(path, as_version=4)
    exercises = exercise_copies.exercise_notebook(notebook)
    solution_lines = {
        line.strip()
        for cell in notebook.cells
        if cell.cell_type == "code"
        for line in _solution_lines(cell.source)
        if len(line.strip()) > 12  # `return x`, `pass`, `)` may well stay in a stub's context
    }
    for index, cell in enumerate(exercises.cells):
        text = cell.source
        assert not INSTRUCTOR_TEXT.search(text), (
            f"{path.name} cell {index} of the exercise copy speaks to the instructor: "
            f"{INSTRUCTOR_TEXT.search(text).group(0)!r}"
        )
        if cell.cell_type != "markdown":
            continue  # the body's code may share a line such as `with torch.no_grad():`
        leaked = [line for line in text.splitlines() if line.strip() in solution_lines]
        assert leaked == [], f"{path.name} cell {index} of the exercise copy holds {leaked}"


def _solution_lines(source: str) -> list[str]:
    lines, inside = [], False
    for line in source.splitlines():
        marker = line.strip()
        if marker in (exercise_copies.BEGIN_SOLUTION, exercise_copies.BEGIN_HIDDEN):
            inside = True
        elif marker in (exercise_copies.END_SOLUTION, exercise_copies.END_HIDDEN):
            inside = False
        elif inside:
            lines.append(line)
    return lines


def test_instructor_text_and_a_leaked_solution_line_are_found(tmp_path):
    """Both checks above catch what they look for."""
    cell = nbformat.v4.new_code_cell(
        "def f(x):\n    ### BEGIN SOLUTION\n"
        "    return sorted(x, key=abs)[::-1]\n"
        "    ### END SOLUTION\n"
    )
    leak = nbformat.v4.new_markdown_cell("Hint: `return sorted(x, key=abs)[::-1]`")
    notes = [
        nbformat.v4.new_markdown_cell(text)
        for text in ("An instructor's note.", "The student copy replaces it.", "Learner copies")
    ]
    notebook = nbformat.v4.new_notebook(cells=[cell, leak, *notes])
    exercises = exercise_copies.exercise_notebook(notebook)
    assert "sorted" not in exercises.cells[0].source
    assert _solution_lines(cell.source)[0].strip() in exercises.cells[1].source
    assert all(INSTRUCTOR_TEXT.search(note.source) for note in exercises.cells[2:])
