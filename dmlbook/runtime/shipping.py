"""Ship a rank function to the ranks by value, keeping the file name and source of its code.

:func:`dmlbook.launch.run` sends the function (and its arguments) with cloudpickle, so that
functions and classes defined in a notebook cell, a script or a closure reach the ranks. How
cloudpickle rebuilds a code object is its own affair: from version 3.1.3 it renames every code
object's file to ``"<dynamic-code>"`` (to make payloads deterministic), and a rank's traceback or
a stuck rank's stack dump can then no longer point at the user's line. So the launcher does not
rely on it:

* :func:`dumps` uses cloudpickle's public ``Pickler`` with one override: a code object travels as
  ``marshal`` bytes, the exact code object Python compiled, file name and line table included.
  The ranks run the same interpreter as the caller (forked from it, or ``sys.executable``), which
  is what ``marshal`` needs.
* The pickler notes every file name it ships. :func:`dumps` returns, beside the payload, the
  source lines of those that exist only in the caller's ``linecache`` (IPython keeps a cell's
  source there and nowhere else; so does code compiled from a string), and the rank puts them in
  its own ``linecache`` before it runs anything.

Used by :mod:`dmlbook.launch` for every chapter; tested under the oldest and newest cloudpickle
the package allows (``tests/unit/runtime/test_shipping.py``).
"""

from __future__ import annotations

import io
import linecache
import marshal
import os
import types
from typing import Any

import cloudpickle

__all__ = ["dumps", "install_sources"]


class _CodeKeepingPickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects go as ``marshal`` bytes with their file names."""

    def __init__(self, file):
        super().__init__(file)
        self.filenames: set[str] = set()

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            self._note_filenames(obj)
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)

    def _note_filenames(self, code: types.CodeType) -> None:
        self.filenames.add(code.co_filename)
        for const in code.co_consts:  # nested functions, comprehensions, class bodies
            if isinstance(const, types.CodeType):
                self._note_filenames(const)


def dumps(obj: Any) -> tuple[bytes, dict[str, list[str]]]:
    """``obj`` pickled for a rank, and the source lines a rank needs that only live in memory.

    The second value maps each shipped file name that is not a file on disk (a notebook cell,
    code compiled from a string) to its lines, as the caller's ``linecache`` holds them.
    """
    buffer = io.BytesIO()
    pickler = _CodeKeepingPickler(buffer)
    pickler.dump(obj)
    sources = {
        name: lines
        for name in sorted(pickler.filenames)
        if not os.path.isfile(name) and (lines := linecache.getlines(name))
    }
    return buffer.getvalue(), sources


def install_sources(sources: dict[str, list[str]]) -> None:
    """Make the caller's in-memory source lines visible to this process's tracebacks."""
    for name, lines in sources.items():
        # The entry form linecache uses for source it cannot reload: (size, None, lines, name).
        linecache.cache[name] = (sum(map(len, lines)), None, list(lines), name)
