"""A learner's own copy of the book, which a later copy updates without losing their work.

`python -m dmlbook.classroom copy-book DIR` writes the installed chapter notebooks into DIR, and a
class's JupyterHub runs it each time a learner's server starts (jupyterhub/learner_server.py). The
copy is only the notebooks: the chapters read their data and start their scripts through the
installed package (`dmlbook.datasets.DATA_DIR`, `EXAMPLES_DIR`), so a notebook runs from any
folder, and a copied script would be a decoy that no chapter runs. (The learners' exercise copies,
with the solutions stubbed, are :mod:`dmlbook.classroom.exercise_copies`.)

Copying again (a new version of the book installed) must never destroy a learner's work. The copy
records, in DIR/.dmlbook-copy.json, a fingerprint of each file it wrote. A notebook's fingerprint
is its cells' types and sources, so running it and saving its outputs is not an edit, while
changing a cell or answering an exercise is. Then, for each file:

* absent: written;
* the same cells as the installed version (outputs may differ): left, with its outputs;
* as the copy wrote it, but the installed version has changed: updated;
* anything else (edited by the learner, or a file the copy never wrote): kept as it is, and
  reported, unless `force` replaces it.

Each file is written whole or not at all (a temporary file, then a rename), and the record last.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import dmlbook
from dmlbook import book

__all__ = ["MANIFEST", "copy_book", "copy_report", "fingerprint"]

MANIFEST = ".dmlbook-copy.json"
_TMP_SUFFIX = ".tmp"


@dataclass
class CopyResult:
    """What one copy did, file by file (names relative to the folder)."""

    folder: Path
    written: list[str] = field(default_factory=list)  # new in the folder
    updated: list[str] = field(
        default_factory=list
    )  # untouched by the learner, now the new version
    current: list[str] = field(default_factory=list)  # already the installed version
    kept: list[str] = field(default_factory=list)  # the learner's (edited): left as they are
    replaced: list[str] = field(default_factory=list)  # the learner's, overwritten by force=True


def fingerprint(name: str, content: bytes) -> str:
    """What a learner's edit changes: a notebook's cells (types, sources), other files' bytes."""
    if name.endswith(".ipynb"):
        try:
            cells = json.loads(content)["cells"]
            # A cell's source is a string or a list of lines: the same text either way.
            text = [[c["cell_type"], "".join(c["source"])] for c in cells]
            return "cells:" + hashlib.sha256(json.dumps(text).encode()).hexdigest()
        except (ValueError, KeyError, TypeError):
            pass  # not a notebook we can read: its bytes are what counts
    return "bytes:" + hashlib.sha256(content).hexdigest()


def book_files(source: Path | None = None) -> dict[str, Path]:
    """The files a learner's copy holds: name in the copy -> installed file (the chapters)."""
    chapters = sorted(source.glob("*.ipynb")) if source is not None else book.chapters()
    if not chapters:
        raise FileNotFoundError(f"no chapter notebooks in {source or book.chapters_dir()}")
    return {path.name: path for path in chapters}


def copy_book(folder: str | Path, *, source: Path | None = None, force: bool = False) -> CopyResult:
    """Write or update the learner's copy of the book in `folder` (see the module docstring)."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} exists and is not a folder: choose another place")
    files = book_files(source)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(folder)
    recorded = _read_manifest(folder)
    result = CopyResult(folder)
    for name, path in files.items():
        new = path.read_bytes()
        new_print = fingerprint(name, new)
        target = folder / name
        if not target.exists():
            _write_whole(target, new)
            result.written.append(name)
        else:
            old = target.read_bytes()
            old_print = fingerprint(name, old)
            if old == new or old_print == new_print:
                result.current.append(name)  # maybe run and saved: its outputs stay
            elif old_print == recorded.get(name):
                _write_whole(target, new)
                result.updated.append(name)
            elif force:
                _write_whole(target, new)
                result.replaced.append(name)
            else:
                result.kept.append(name)
                continue  # its record stays what the copy last wrote
        recorded[name] = new_print
    manifest = {"dmlbook": dmlbook.__version__, "files": recorded}
    _write_whole(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return result


def copy_report(result: CopyResult, command: str = "python -m dmlbook.classroom copy-book") -> str:
    """The learner's report: what was written, and what was kept and how to proceed."""
    counts = [
        (len(result.written), "written"),
        (len(result.updated), "updated"),
        (len(result.replaced), "replaced (--force)"),
        (len(result.current), "already current"),
        (len(result.kept), "kept as you changed them"),
    ]
    said = ", ".join(f"{n} {what}" for n, what in counts if n) or "nothing to copy"
    lines = [f"dmlbook {dmlbook.__version__}: the book in {result.folder}: {said}."]
    if result.kept:
        lines += [
            "Kept these files as you changed them (the installed version differs):",
            *(f"  {name}" for name in result.kept),
            "To get the installed version, copy the book into a fresh folder:",
            f"  {command} NEW_FOLDER",
            "or replace these files here, losing your changes to them:",
            f"  {command} {result.folder} --force",
        ]
    return "\n".join(lines)


def _read_manifest(folder: Path) -> dict[str, str]:
    """The fingerprints the last copy wrote; none if there was none (or it is unreadable)."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        return {str(k): str(v) for k, v in files.items()}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        # Without a record every changed file counts as the learner's: nothing is lost.
        return {}


def _write_whole(target: Path, content: bytes) -> None:
    """Write `target` whole or not at all: a temporary file beside it, then a rename."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
    try:
        # os.open honours the umask, as a file the learner saved would
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_dead_temporaries(folder: Path) -> None:
    """Remove the temporary files of copies that were killed: their owner's process is gone."""
    for tmp in folder.glob(f".*{_TMP_SUFFIX}"):
        pid = _owner(tmp.name)
        if pid is not None and not _alive(pid):
            tmp.unlink(missing_ok=True)


def _owner(name: str) -> int | None:
    """The process id in a temporary file's name `.NAME.PID.HEX.tmp`, or None if not ours."""
    parts = name.split(".")
    if len(parts) < 5 or not parts[-3].isdigit() or len(parts[-2]) != 8:
        return None
    return int(parts[-3])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
