"""A pytest plugin that keeps each notebook nbval runs, with its outputs and plots, for the site.

The suite runs every chapter under nbval once (conftest.py); the site shows those runs instead of
running each chapter again (issue 37: "each chapter executed once"). This plugin, loaded by the
root conftest.py and passed as ``-p nbrecord`` to the nbval runs a test starts in a process of its
own (the concurrency test, the wheel test), does two things for a notebook's cells:

* its kernel starts without ``MPLBACKEND``, so matplotlib draws inline as in a learner's
  JupyterLab and each figure is an output (the suite sets ``Agg`` for everything else);
* when its last cell is done, the notebook with every cell's outputs goes into
  ``dmlbook.book.executed``'s cache, unless a cell failed.

And it says when a session's run of a chapter has ended, passed or not (:func:`finished`): a
file named for the chapter in a folder of the session's own (``$DMLBOOK_FINISHED``, made by the
first process of the session and removed at its end), written when nbval's last cell of the
notebook is done and when a ``runs_chapters`` test ends. The site test waits for those, not for
a clock.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dmlbook.book import executed

FINISHED_ENV = "DMLBOOK_FINISHED"


def pytest_configure(config):
    """The session's folder of finished runs, made once (workers and child runs inherit it)."""
    if FINISHED_ENV not in os.environ:
        os.environ[FINISHED_ENV] = tempfile.mkdtemp(prefix="dmlbook-finished-")
        config.nbrecord_owns_finished = True


def pytest_unconfigure(config):
    if getattr(config, "nbrecord_owns_finished", False):
        shutil.rmtree(os.environ.pop(FINISHED_ENV), ignore_errors=True)


def finished(name: str) -> bool:
    """Whether this session's run of the notebook ``name`` has ended (passed or failed)."""
    return (Path(os.environ[FINISHED_ENV]) / name).exists()


def _finish(name: str) -> None:
    folder = os.environ.get(FINISHED_ENV)
    if folder and os.path.isdir(folder):
        Path(folder, name).touch()


def _is_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell"  # nbval's item: one code cell


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The kernel starts in the first cell's setup (nbval's IPyNbFile.setup): without
    MPLBACKEND in the environment it inherits, ipykernel picks the inline backend."""
    saved = os.environ.pop("MPLBACKEND", None) if _is_cell(item) else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if not _is_cell(item):
        mark = item.get_closest_marker("runs_chapters")
        for name in mark.args if mark is not None else ():
            _finish(name)  # the test ran these chapters itself, and has ended
        return
    if item.test_outputs is not None:  # the cell ran (a skipped one keeps no outputs)
        item.cell.outputs = executed.clean(item.test_outputs)
    file = item.parent
    file.nbrecord_done = getattr(file, "nbrecord_done", 0) + 1
    if nextitem is not None and nextitem.parent is file:
        return
    notebook = file.nb  # the cells nbval read, now with their outputs
    whole = file.nbrecord_done == sum(c.cell_type == "code" for c in notebook.cells)
    if whole and not getattr(file, "timed_out", False):  # not a selection of cells, nor cut short
        executed.store(item.path, notebook)
    _finish(item.path.name)


def kept_runs(items) -> set[str]:
    """The notebooks a session's items run and keep: those whose cells nbval runs, and those a
    ``runs_chapters`` test runs itself (unless it is skipped)."""
    names = {item.path.name for item in items if item.path.suffix == ".ipynb"}
    for item in items:
        mark = item.get_closest_marker("runs_chapters")
        skipped = any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        if mark is not None and not skipped:
            names.update(mark.args)
    return names
