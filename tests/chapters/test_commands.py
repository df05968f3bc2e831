"""Every shell command a chapter prints runs as printed (issue 36: chapter 11 printed a
multi-machine ``torchrun`` line with an empty ``--rdzv-conf``, which fails in a shell).

A chapter shows commands in its prose, in backticks or in a code block: ``torchrun ...``,
``python -m dmlbook.bench ...`` and the like. Each is split as a shell splits it and read by the
program's own argument parser: ``torchrun``'s (``torch.distributed.run.get_args_parser``), the
benchmark's (:func:`dmlbook.bench.build_parser`), the network lab's and the book's; a ``python -m``
module must exist. A placeholder in capitals (``--nnodes MIN:MAX``, ``HOST0:29400``) is read as
a value. Commands a chapter builds in code (``el.torchrun_command``) are checked where
they are built (``tests/unit/advanced/elastic/test_elastic.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import nbformat
import pytest

CHAPTERS = Path(__file__).resolve().parents[2] / "chapters"
NOTEBOOKS = sorted(p for p in CHAPTERS.glob("*.ipynb") if p.name[0].isdigit())  # not the glossary

_PROGRAMS = ("torchrun", "python -m", "python3 -m")
_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```[^\n]*\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


def commands(source: str) -> list[str]:
    """The shell commands a markdown cell prints: backtick spans and code-block lines (joined at
    a trailing backslash) that start with one of the programs above."""
    found = [span for span in _SPAN.findall(source)]
    blocks = [m["body"] for m in _FENCE.finditer(source)]
    indented = re.findall(r"(?:^(?: {4}|\t).*\n?)+", _FENCE.sub("", source), re.MULTILINE)
    for block in blocks + indented:
        found += re.sub(r"\\\n\s*", " ", block).splitlines()
    return [
        c.strip().lstrip("$ ").strip()
        for c in found
        if c.strip().lstrip("$ ").startswith(_PROGRAMS)
    ]


def _parser_for_module(module: str) -> argparse.ArgumentParser | None:
    if module == "dmlbook.bench":
        from dmlbook.bench import build_parser

        return build_parser()
    return None


def problem(command: str) -> str | None:
    """Why ``command`` would fail in a shell, or None."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        return f"a shell cannot split it: {e}"
    if any(placeholder in command for placeholder in ("...", "…")) or len(words) < 2:
        return None  # an elided command, or the program named in a sentence: nothing to run
    # A placeholder in capitals (HOST0, MIN:MAX, K) stands for a value: parse it with one there.
    words = [re.sub(r"\b[A-Z][A-Z0-9_]*\b", "1", w) for w in words]
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        return _parse(get_args_parser(), words[1:])
    module = words[2]
    if importlib.util.find_spec(module) is None:
        return f"there is no module {module}"
    parser = _parser_for_module(module)
    return _parse(parser, words[3:]) if parser else None


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = parser.parse_args(args)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    for name, value in vars(parsed).items():
        if isinstance(value, str) and name.startswith("rdzv") and value.strip() in ("", ","):
            if f"--{name.replace('_', '-')}" in args:  # given, but empty: a shell's quoting lost it
                return f"--{name.replace('_', '-')} is given an empty value"
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_command_a_chapter_prints_parses(path):
    notebook = nbformat.read(path, as_version=4)
    bad = [
        f"cell {i}: `{command}`: {why}"
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "markdown"
        for command in commands(cell.source)
        if (why := problem(command))
    ]
    assert bad == []


def test_commands_are_found_and_bad_ones_named():
    source = (
        "Run `python -m dmlbook.bench allreduce --world-size 2`, or\n\n"
        "```\ntorchrun --nnodes 2 --nproc-per-node 2 \\\n    --rdzv-conf '' train.py\n```\n"
        "and `python -m dmlbook.bench allredux`."
    )
    found = sorted(commands(source))
    assert len(found) == 3, found
    assert problem(found[0]) is None
    assert "invalid choice" in problem(found[1])
    assert "empty" in problem(found[2])
    assert "no module" in problem("python -m dmlbook.nothing_here")
