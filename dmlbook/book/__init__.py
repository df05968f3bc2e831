"""The book as package resources: the chapters, their data and the scripts they start.

A class installs dmlbook from a wheel (`pip install dmlbook-*.whl` into a JupyterHub image), so
nothing may be found by walking up from a source file to a checkout. The wheel carries the
chapter notebooks, `data/` (digits.npz and its README) and `examples/` (the scripts that torchrun
starts in chapters 3, 4, 11 and 13) inside this package, and the code finds them here, through
`importlib.resources`. In a checkout (`make install`, editable) `dmlbook/book/chapters`, `data`
and `examples` are symbolic links to the repository's top-level folders, so both installs read
the same files through the same functions.

`python -m dmlbook.book path` prints where the installed chapters are; a learner's own copy of
them is `python -m dmlbook.classroom copy-book DIR` (`dmlbook.classroom.book_copy`).

No module here may take the name of another module: chapters 3 and 4 start torchrun in this
folder (the parent of `examples/`), and `python -m` puts its working folder first on sys.path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def root() -> Path:
    """The installed book's folder on disk (it holds chapters/, data/ and examples/)."""
    found = resources.files(__name__)
    if not isinstance(found, Path):
        # e.g. a package imported from a zip file: torchrun needs the scripts as real files
        raise RuntimeError(
            f"dmlbook is installed where its book is not a folder on disk ({found!r}); "
            "install it unpacked (pip or uv install a wheel that way)"
        )
    return found


def _folder(name: str) -> Path:
    # resolve(): in a checkout the link leads to the repository's own folder, so a path shown to
    # the learner (and the folder torchrun starts in, its parent) is the checkout's.
    return (root() / name).resolve()


def chapters_dir() -> Path:
    """The chapter notebooks, as installed (read them, or copy them: never edit them here)."""
    return _folder("chapters")


def data_dir() -> Path:
    """The shipped data: digits.npz and the README on its provenance."""
    return _folder("data")


def examples_dir() -> Path:
    """The runnable scripts that the chapters start under torchrun."""
    return _folder("examples")


def chapters() -> list[Path]:
    """Every chapter notebook, in the book's order, and the glossary they link to (last)."""
    return sorted(chapters_dir().glob("*.ipynb"))
