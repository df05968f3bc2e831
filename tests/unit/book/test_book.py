"""The book as package resources (dmlbook.book), and a learner's copy of it that keeps their work
(dmlbook.classroom.book_copy, ``python -m dmlbook.classroom copy-book``).

The wheel itself (built, installed non-editable, copied and run) is tested in test_install.py
(marker ``install``); these tests are fast and run in the checkout's editable install.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from dmlbook import book, datasets
from dmlbook.book.__main__ import main as book_main
from dmlbook.classroom import book_copy
from dmlbook.classroom.__main__ import main

REPO = Path(__file__).resolve().parents[3]


def test_the_package_finds_the_checkouts_chapters_data_and_scripts():
    # In a checkout the package's links lead to the top-level folders that README links,
    # `make lab` and nbval use: one set of files, reached two ways.
    assert book.chapters_dir() == REPO / "chapters"
    assert book.data_dir() == REPO / "data" == datasets.DATA_DIR
    assert book.examples_dir() == REPO / "examples" == datasets.EXAMPLES_DIR
    assert [p.name for p in book.chapters()] == sorted(
        p.name for p in (REPO / "chapters").glob("*.ipynb")
    )
    assert len(book.chapters()) >= 14
    assert (book.data_dir() / "digits.npz").is_file()
    assert (book.examples_dir() / "elastic_train.py").is_file()


def test_no_module_of_the_book_shadows_another_when_torchrun_starts_in_its_folder():
    # Chapters 3 and 4 run `python -m torch.distributed.run` with the working folder
    # EXAMPLES_DIR.parent, which an installed wheel makes dmlbook/book/: it comes first on
    # sys.path there, so a `copy.py` in it would replace the standard library's copy.
    modules = {p.stem for p in book.root().glob("*.py")} - {"__init__", "__main__"}
    assert modules == {"executed", "static_site"}  # a new module: check its name
    assert not modules & set(sys.stdlib_module_names)


def small_notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def write_nb(path: Path, nb: nbformat.NotebookNode) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def edit_cell(path: Path, text: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source += text
    nbformat.write(nb, path)


def run_and_save(path: Path) -> None:
    """What Jupyter saves after a run: outputs and execution counts, cells unchanged."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells, 1):
        cell.execution_count = i
        cell.outputs = [nbformat.v4.new_output("stream", text=f"ran cell {i}\n")]
    nbformat.write(nb, path)


def test_a_fresh_copy_holds_every_chapter_and_says_so(tmp_path, capsys):
    folder = tmp_path / "home" / "dmlbook"  # created, parents included
    assert main(["copy-book", str(folder)]) == 0
    out = capsys.readouterr().out
    names = [p.name for p in book.chapters()]
    assert sorted(p.name for p in folder.glob("*.ipynb")) == names
    for path in book.chapters():
        assert (folder / path.name).read_bytes() == path.read_bytes()
    assert f"{len(names)} written" in out and str(folder) in out
    record = json.loads((folder / book_copy.MANIFEST).read_text())
    assert sorted(record["files"]) == names
    # nothing half-written is left beside them
    assert sorted(p.name for p in folder.iterdir()) == sorted(names + [book_copy.MANIFEST])


def test_a_second_copy_keeps_an_edited_chapter_and_says_how_to_proceed(tmp_path, capsys):
    folder = tmp_path / "learner"
    main(["copy-book", str(folder)])
    edited = folder / book.chapters()[1].name
    edit_cell(edited, "\n# my own note")
    mine = edited.read_bytes()
    capsys.readouterr()
    assert main(["copy-book", str(folder)]) == 0
    out = capsys.readouterr().out
    assert edited.read_bytes() == mine  # the learner's work is untouched
    assert f"  {edited.name}" in out and "1 kept" in out
    assert f"{len(book.chapters()) - 1} already current" in out
    # ... and the two ways on: a fresh folder, or --force, which says what it costs
    assert "python -m dmlbook.classroom copy-book NEW_FOLDER" in out
    assert f"python -m dmlbook.classroom copy-book {folder} --force" in out and "losing" in out
    assert main(["copy-book", str(folder), "--force"]) == 0
    assert "1 replaced" in capsys.readouterr().out
    assert edited.read_bytes() == book.chapters()[1].read_bytes()


def test_a_new_version_updates_untouched_files_and_keeps_edited_ones(tmp_path):
    v1, folder = tmp_path / "v1", tmp_path / "learner"
    for name in ("a", "b", "c", "d"):
        write_nb(v1 / f"{name}.ipynb", small_notebook(f"x = '{name}'", "print(x)"))
    first = book_copy.copy_book(folder, source=v1)
    assert first.written == ["a.ipynb", "b.ipynb", "c.ipynb", "d.ipynb"]
    edit_cell(folder / "a.ipynb", "  # answered")  # the learner edits a ...
    run_and_save(folder / "b.ipynb")  # ... runs b and c and saves them, and leaves d alone
    run_and_save(folder / "c.ipynb")
    ran_c = (folder / "c.ipynb").read_bytes()

    v2 = tmp_path / "v2"  # the next version of the book changes a, b and d, not c
    for name in ("a", "b", "c", "d"):
        new = f"x = '{name} v2'" if name != "c" else f"x = '{name}'"
        write_nb(v2 / f"{name}.ipynb", small_notebook(new, "print(x)"))
    second = book_copy.copy_book(folder, source=v2)
    assert second.kept == ["a.ipynb"]
    assert second.updated == ["b.ipynb", "d.ipynb"]  # run, not edited, counts as untouched
    assert second.current == ["c.ipynb"]
    assert "# answered" in (folder / "a.ipynb").read_text()
    for name in ("b", "d"):
        assert (folder / f"{name}.ipynb").read_bytes() == (v2 / f"{name}.ipynb").read_bytes()
    assert (folder / "c.ipynb").read_bytes() == ran_c  # its outputs stay

    # The record still holds what the copy wrote for a: it stays the learner's until forced.
    third = book_copy.copy_book(folder, source=v2)
    assert third.kept == ["a.ipynb"] and third.updated == []
    forced = book_copy.copy_book(folder, source=v2, force=True)
    assert forced.replaced == ["a.ipynb"]
    assert (folder / "a.ipynb").read_bytes() == (v2 / "a.ipynb").read_bytes()


def test_files_the_copy_never_wrote_count_as_the_learners(tmp_path):
    source, folder = tmp_path / "book", tmp_path / "learner"
    write_nb(source / "a.ipynb", small_notebook("x = 1"))
    write_nb(folder / "a.ipynb", small_notebook("x = 'mine'"))  # there before any copy
    assert book_copy.copy_book(folder, source=source).kept == ["a.ipynb"]
    # An unreadable record loses nothing either: a changed file is kept.
    (folder / book_copy.MANIFEST).write_text("{ not json")
    assert book_copy.copy_book(folder, source=source).kept == ["a.ipynb"]
    assert "'mine'" in (folder / "a.ipynb").read_text()


def test_a_killed_copys_temporary_file_is_removed_by_the_next(tmp_path):
    source, folder = tmp_path / "book", tmp_path / "learner"
    write_nb(source / "a.ipynb", small_notebook("x = 1"))
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that has exited (and was reaped)
    left = folder / f".a.ipynb.{dead.pid}.0123abcd.tmp"
    alive = folder / f".a.ipynb.{os.getpid()}.4567cdef.tmp"  # a copy running right now
    left.write_text("half")
    alive.write_text("half")
    book_copy.copy_book(folder, source=source)
    assert not left.exists() and alive.exists()


def test_bad_places_and_empty_books_give_clear_errors(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main(["copy-book", str(not_a_folder)]) == 1
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no chapter notebooks"):
        book_copy.copy_book(tmp_path / "x", source=tmp_path / "empty")


def test_path_prints_where_the_installed_book_is(capsys):
    for what, expected in [
        ([], book.chapters_dir()),
        (["--what", "data"], book.data_dir()),
        (["--what", "examples"], book.examples_dir()),
    ]:
        assert book_main(["path", *what]) == 0
        assert capsys.readouterr().out.strip() == str(expected)
