"""Every term a chapter relies on is defined or linked where the chapter first uses it.

The glossary is its own notebook, ``chapters/glossary.ipynb``: one ``## term`` heading per term
and its definition below it (a term with two spellings reads ``## ZeRO / FSDP``). In every
chapter, the first use of a glossary term in the prose is the text of a link to that term's
heading (``[all-reduce](glossary.ipynb#all-reduce)``, or ``[**all-reduce**](...)`` where the
chapter also defines it in place). The heading's anchor is the one JupyterLab gives it (its text,
spaces made ``-``), and the site gives the same (``docs/conf.py``), so one link works in both.
Headings, code (fenced or in backticks) and link targets are not prose. A learner reads each
chapter as if it were the first (issue 36: "every term defined at first use, or linked"; issue 37:
"each term's first use in a chapter links to it").
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

CHAPTERS = Path(__file__).resolve().parents[2] / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb"))
GLOSSARY = CHAPTERS / "glossary.ipynb"

_ENTRY = re.compile(r"^## (?P<term>.+?)\s*$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]*)\)")


def glossary() -> dict[str, list[str]]:
    """Each glossary term and its spellings (``"ZeRO / FSDP"`` -> ``["ZeRO", "FSDP"]``)."""
    cells = nbformat.read(GLOSSARY, as_version=4).cells
    text = "\n\n".join(c.source for c in cells if c.cell_type == "markdown")
    return {m["term"]: [s.strip() for s in m["term"].split(" / ")] for m in _ENTRY.finditer(text)}


def anchor(term: str) -> str:
    """The id JupyterLab gives a heading (its text, each space made ``-``); the site's too."""
    return term.replace(" ", "-")


def _pattern(spelling: str) -> re.Pattern:
    """A spelling as a word, in the singular or plural, in any case where it is lower case (an
    acronym such as ZeRO or GEMM is matched as written)."""
    flags = re.IGNORECASE if spelling == spelling.lower() else 0
    word = re.escape(spelling).replace(r"\ ", r"[\s-]+")
    return re.compile(rf"(?<![\w-]){word}(?:s|es)?(?![\w-])", flags)


def _prose(source: str) -> str:
    """A markdown cell without headings, code and link targets, each replaced by spaces of the
    same length so that positions still line up with the source."""

    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    text = _FENCE.sub(blank, source)
    text = re.sub(r"^#.*$", blank, text, flags=re.MULTILINE)
    text = _CODE.sub(blank, text)
    return re.sub(r"\]\([^)\s]*\)", blank, text)


def _linked(source: str, start: int, end: int, term: str) -> bool:
    """Whether the use at ``source[start:end]`` is the text of a link to ``term``'s entry."""
    for match in _LINK.finditer(source):
        if match.start("text") <= start and end <= match.end("text"):
            return match["target"] == f"glossary.ipynb#{anchor(term)}"
    return False


def undefined_terms(notebook) -> list[str]:
    """Each glossary term whose first use in the notebook's prose is not a link to its entry in
    the glossary: ``"cell 3, line 2: 'all-reduce' ..."``."""
    terms = glossary()
    firsts: dict[str, tuple[int, int, int, str]] = {}
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "markdown":
            continue
        prose = _prose(cell.source)
        for term, spellings in terms.items():
            if term in firsts:
                continue
            uses = [m for s in spellings for m in _pattern(s).finditer(prose)]
            if uses:
                first = min(uses, key=lambda m: m.start())
                firsts[term] = (index, first.start(), first.end(), cell.source)
    found = []
    for term, (index, start, end, source) in sorted(firsts.items(), key=lambda kv: kv[1][:2]):
        if not _linked(source, start, end, term):
            line = source[:start].count("\n") + 1
            found.append(
                f"cell {index}, line {line}: {source[start:end]!r} (glossary: {term}) is used "
                f"without a link to its entry, glossary.ipynb#{anchor(term)}"
            )
    return found


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p != GLOSSARY], ids=lambda p: p.stem)
def test_every_glossary_term_is_defined_or_linked_at_its_first_use(path):
    notebook = nbformat.read(path, as_version=4)
    assert undefined_terms(notebook) == []


def test_the_glossary_is_read():
    terms = glossary()
    assert len(terms) >= 30 and terms["ZeRO / FSDP"] == ["ZeRO", "FSDP"]


def test_a_term_used_before_it_is_defined_is_found():
    new = nbformat.v4
    used = "Each step ends with an all-reduce. Later: an **all-reduce** adds every rank's tensor."
    linked = "Each step ends with an [all-reduce](glossary.ipynb#all-reduce)."
    bold = "Each step ends with an [**all-reduce**](glossary.ipynb#all-reduce): a sum."
    elsewhere = "Each step ends with an [all-reduce](glossary.ipynb#broadcast)."
    code = "The call `all_reduce` and\n```\nall-reduce\n```\n## All-reduce\nno term here."
    for source, expected in ((used, 1), (linked, 0), (bold, 0), (elsewhere, 1), (code, 0)):
        notebook = new.new_notebook(cells=[new.new_markdown_cell(source)])
        found = [f for f in undefined_terms(notebook) if "all-reduce" in f.lower()]
        assert len(found) == expected, (source, found)


def test_every_link_to_the_glossary_names_an_entry():
    """A link into the glossary lands on a term's heading, in every notebook."""
    entries = {anchor(term) for term in glossary()}
    wrong = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "markdown":
                continue
            for match in _LINK.finditer(cell.source):
                file, _, fragment = match["target"].partition("#")
                if file == "glossary.ipynb" and fragment and fragment not in entries:
                    wrong.append(f"{path.name} cell {i}: {match.group(0)}")
    assert wrong == []
