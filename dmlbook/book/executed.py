"""Executed chapters, kept once: the outputs and plots the site shows (issue 37).

The notebooks are stored without outputs. The test suite runs every chapter anyway, so each run
keeps what it produced (``tests/support/nbrecord.py`` for nbval's runs and the other places a
chapter runs) in a cache, and the site (``dmlbook.book.static_site``) takes the chapters from there,
running only those the cache lacks. An entry is keyed by the notebook's cells, by the package's
code and data (the chapters call it; the scripts they start and the digits live in it) and by
the installed torch: an edit to any of them makes a new key, and an entry never goes stale.

A chapter runs with matplotlib's inline backend (``MPLBACKEND`` removed from the kernel's
environment, as in a learner's JupyterLab), so that its figures are outputs; an Agg kernel draws
nothing anyone sees. Entries are written whole or not at all (a temporary file, then a rename):
two runs that finish the same chapter at once leave one good entry.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import tempfile
from importlib import metadata
from pathlib import Path

import nbformat

from dmlbook import book

# Where the cache lives unless $DMLBOOK_EXECUTED says otherwise: in a checkout, build/executed/.
CACHE_ENV = "DMLBOOK_EXECUTED"
WIDGET = "application/vnd.jupyter.widget-view+json"


def cache_dir() -> Path:
    """The cache's folder: ``$DMLBOOK_EXECUTED``, else ``build/executed`` beside the chapters."""
    where = os.environ.get(CACHE_ENV)
    return Path(where) if where else book.chapters_dir().parent / "build" / "executed"


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    package = Path(book.__file__).resolve().parent.parent  # dmlbook/
    digest = hashlib.sha256()
    try:
        digest.update(metadata.version("torch").encode())
    except metadata.PackageNotFoundError:
        pass
    for folder, dirs, files in sorted(os.walk(package, followlinks=True)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = Path(folder, name)
            if path.suffix not in (
                ".py",
                ".npz",
            ):  # the code and the shipped data, as a wheel has them
                continue
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def key(notebook: nbformat.NotebookNode) -> str:
    """The cache key of a notebook's run: its cells' types and sources, and the package."""
    digest = hashlib.sha256(_package_digest().encode())
    for cell in notebook.cells:
        digest.update(cell.cell_type.encode() + b"\0" + cell.source.encode() + b"\0")
    return digest.hexdigest()[:20]


def entry(path: Path, notebook: nbformat.NotebookNode | None = None) -> Path:
    """Where the run of the notebook at ``path`` is (or would be) kept."""
    notebook = notebook if notebook is not None else nbformat.read(path, as_version=4)
    return cache_dir() / f"{Path(path).stem}-{key(notebook)}.ipynb"


def failed(notebook: nbformat.NotebookNode) -> bool:
    """Whether any cell of an executed notebook ended in an error."""
    return any(
        out.get("output_type") == "error"
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


def clean(outputs: list) -> list:
    """A cell's outputs as a page shows them: widgets (a progress bar, a slider) need a live
    kernel, so they are dropped; consecutive stream messages of one stream become one output."""
    kept: list = []
    for out in outputs:
        out = nbformat.from_dict(copy.deepcopy(dict(out)))
        if out.output_type in ("display_data", "execute_result") and WIDGET in out.get("data", {}):
            continue
        if out.output_type == "stream" and kept and kept[-1].output_type == "stream":
            if kept[-1].name == out.name:
                kept[-1].text += out.text
                continue
        kept.append(out)
    return kept


def store(path: Path, notebook: nbformat.NotebookNode) -> Path | None:
    """Keep an executed notebook (the run of the notebook at ``path``); a run with an error is
    not kept (the site runs that chapter again, and shows its error if it fails there too)."""
    if failed(notebook):
        return None
    notebook.metadata.pop("widgets", None)  # their state: a page would fetch a widget manager
    source = nbformat.read(path, as_version=4)
    target = entry(path, source)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(notebook, f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def lookup(path: Path) -> nbformat.NotebookNode | None:
    """The kept run of the notebook at ``path``, or None."""
    found = entry(path)
    return nbformat.read(found, as_version=4) if found.exists() else None


def execute(path: Path, timeout: int = 900) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` top to bottom in a kernel of this Python, in its own folder,
    with the inline backend; raise ``nbclient``'s CellExecutionError naming the cell that failed.
    The result is kept in the cache."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(path).parent)}},
    )  # (the widgets' state it keeps is dropped by store: a page would fetch a widget manager)
    client.execute(env=env)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = clean(cell.outputs)
    store(path, notebook)
    return notebook


def executed(path: Path, timeout: int = 900) -> tuple[nbformat.NotebookNode, bool]:
    """The notebook at ``path`` with its outputs: the kept run, or a new one. The flag says
    whether it was run now."""
    kept = lookup(path)
    return (kept, False) if kept is not None else (execute(path, timeout), True)
