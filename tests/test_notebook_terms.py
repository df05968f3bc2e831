"""Every term a chapter relies on is defined or linked where the chapter first uses it.

The glossary is chapter 1's last section: one ``* **term**: definition`` line per term (a term
with two spellings reads ``**ZeRO / FSDP**``). In every chapter, the first use of a glossary term
in the prose must either define it in place, in bold (``**all-reduce**``, its definition beside
it), or be the text of a link to the glossary
(``[all-reduce](01_splitting_input_data.ipynb#Glossary)``).
Headings, code (fenced or in backticks) and link targets are not prose. A learner reads each
chapter as if it were the first (issue 36: "every term defined at first use, or linked").
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb"))
GLOSSARY_CHAPTER = CHAPTERS / "01_splitting_input_data.ipynb"

_ENTRY = re.compile(r"^\* \*\*(?P<term>[^*]+)\*\*:", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]*)\)")
_BOLD = re.compile(r"\*\*(?P<text>[^*]+)\*\*")


def glossary() -> dict[str, list[str]]:
    """Each glossary term and its spellings (``"ZeRO / FSDP"`` -> ``["ZeRO", "FSDP"]``)."""
    cell = next(
        c
        for c in nbformat.read(GLOSSARY_CHAPTER, as_version=4).cells
        if c.cell_type == "markdown" and c.source.startswith("## Glossary")
    )
    return {
        m["term"]: [s.strip() for s in m["term"].split(" / ")] for m in _ENTRY.finditer(cell.source)
    }


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


def _defined_or_linked(source: str, start: int, end: int) -> bool:
    """Whether the use at ``source[start:end]`` sits in bold or in a link to the glossary."""
    no_code = _CODE.sub(lambda m: " " * len(m.group(0)), source)  # `**kwargs` is not bold
    for match in _BOLD.finditer(no_code):
        if match.start("text") <= start and end <= match.end("text"):
            return True
    for match in _LINK.finditer(source):
        if match.start("text") <= start and end <= match.end("text"):
            return "glossary" in match["target"].lower()
    return False


def undefined_terms(notebook) -> list[str]:
    """Each glossary term whose first use in the notebook's prose is neither bold nor a link to
    the glossary: ``"cell 3: 'all-reduce' ..."``."""
    terms = glossary()
    firsts: dict[str, tuple[int, int, int, str]] = {}
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "markdown" or cell.source.startswith("## Glossary"):
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
        if not _defined_or_linked(source, start, end):
            line = source[:start].count("\n") + 1
            found.append(
                f"cell {index}, line {line}: {source[start:end]!r} (glossary: {term}) is used "
                "before it is defined in bold or linked to the glossary"
            )
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_glossary_term_is_defined_or_linked_at_its_first_use(path):
    notebook = nbformat.read(path, as_version=4)
    assert undefined_terms(notebook) == []


def test_the_glossary_is_read():
    terms = glossary()
    assert len(terms) >= 30 and terms["ZeRO / FSDP"] == ["ZeRO", "FSDP"]


def test_a_term_used_before_it_is_defined_is_found():
    new = nbformat.v4
    used = "Each step ends with an all-reduce. Later: an **all-reduce** adds every rank's tensor."
    linked = "Each step ends with an [all-reduce](01_splitting_input_data.ipynb#Glossary)."
    code = "The call `all_reduce` and\n```\nall-reduce\n```\n## All-reduce\nno term here."
    for source, expected in ((used, 1), (linked, 0), (code, 0)):
        notebook = new.new_notebook(cells=[new.new_markdown_cell(source)])
        found = [f for f in undefined_terms(notebook) if "all-reduce" in f.lower()]
        assert len(found) == expected, (source, found)
