"""The README is a newcomer's page, and nothing it used to hold is lost (issue 37).

The README was 764 lines: the test suite's CPU-seconds, 132 lines for instructors and 158 of
benchmarks came before or around the chapter map. Its guides now live in the site's pages under
docs/ (`make site`); the README keeps what the book is, the two commands, `make site`, the
chapter map and where each guide lives. MOVED lists every section the README had (`git show
5ae5fcb:README.md`), the page that holds it now, its heading there, and one sentence or table row
of the old section that the page still carries.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README_MAX_LINES = 150

# every `##` / `###` heading of the README before the move, in order
OLD_SECTIONS = [
    "Two commands",
    "For instructors: student copies and grading",
    "A class on one server: JupyterHub and nbgrader",
    "Chapter map",
    "One rank function, three ways to launch it",
    "On GPUs",
    "On several machines, with torchrun",
    "Elastic training under torchrun",
    "Ranks that live across cells: `%%ranks`",
    "Several hosts on one machine: the network lab",
    "Data",
    "Benchmarks",
    "Layout",
]

# (old section, page under docs/, its heading there, a sentence or row of the old section).
# "Two commands" is split: the commands went to the landing page, the suite's time to testing.
MOVED = [
    (
        "Two commands",
        "index.md",
        "Two commands",
        "make install   # the set-up alone: .venv from requirements.lock, then the package",
    ),
    (
        "Two commands",
        "guides/testing.md",
        "How long it takes, and where the time goes",
        "The suite is bound by CPU: counted over the whole machine (`/proc/stat`), it needs about "
        "900 CPU-seconds",
    ),
    (
        "Two commands",
        "guides/testing.md",
        "Timing claims",
        "medians become the least disturbed of several steps where other work can only add time",
    ),
    (
        "For instructors: student copies and grading",
        "guides/instructors.md",
        "For instructors: exercise copies and grading",
        "A checker reports that exception as *not attempted*, so an exercise copy runs top to "
        "bottom.",
    ),
    (
        "A class on one server: JupyterHub and nbgrader",
        "guides/instructors.md",
        "A class on one server: JupyterHub and nbgrader",
        "| 9, hybrid parallelism | 1 | 11.5 s | 14.4, 16.0 s (1.3-1.4x) | 22.1-25.7 s (1.9-2.2x) |",
    ),
    (
        "Chapter map",
        "index.md",
        "Chapter map",
        "Every chapter opens with what it needs from earlier chapters and its learning goals",
    ),
    (
        "One rank function, three ways to launch it",
        "guides/launching.md",
        "One rank function, three ways to launch it",
        "The caller is never forked: a process that has run torch ops can deadlock its forked "
        "children.",
    ),
    (
        "On GPUs",
        "guides/gpus.md",
        "On GPUs",
        "`make gpu-check` is the one command for a machine with a GPU",
    ),
    (
        "On several machines, with torchrun",
        "guides/torchrun.md",
        "On several machines, with torchrun",
        "Run such jobs on a private network only",
    ),
    (
        "Elastic training under torchrun",
        "guides/elastic.md",
        "Elastic training under torchrun",
        "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is needed on recent torch",
    ),
    (
        "Ranks that live across cells: `%%ranks`",
        "guides/ranks-magic.md",
        "Ranks that live across cells: `%%ranks`",
        "| 4, median | 0.90 ms, 0.67 ms | 2.73 ms, 1.43 ms | 199 ms, 129 ms | 255 ms, 195 ms |",
    ),
    (
        "Several hosts on one machine: the network lab",
        "guides/netlab.md",
        "Several hosts on one machine: the network lab",
        "an instructor's `down --force` removes them all.",
    ),
    (
        "Data",
        "guides/data.md",
        "Data",
        "Nothing downloads at run time.",
    ),
    (
        "Benchmarks",
        "guides/benchmarks.md",
        "Benchmarks",
        "| shm (chapter 4: shared memory, no TCP) | 0.81x | 0.55x | **0.46x (4.7 GB/s)** | "
        "0.36x (5.9 GB/s) |",
    ),
    (
        "Layout",
        "guides/architecture.md",
        "Architecture: the package's layout",
        "Each module's docstring names the chapter that teaches it.",
    ),
]


def squeeze(text: str) -> str:
    return " ".join(text.split())


def headings(markdown: str) -> list[str]:
    """The Markdown headings of a page, without the #s, outside fenced code blocks."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.+)", line)):
            found.append(m.group(2).strip())
    return found


def test_the_readme_is_at_most_150_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_every_old_readme_section_has_a_page():
    assert sorted({section for section, *_ in MOVED}) == sorted(OLD_SECTIONS)


@pytest.mark.parametrize(
    "section, page, heading, text", MOVED, ids=[f"{m[0]} -> {m[1]}" for m in MOVED]
)
def test_a_moved_section_is_on_its_page_under_its_heading(section, page, heading, text):
    path = DOCS / page
    assert path.is_file(), f"README section {section!r} should be in docs/{page}"
    markdown = path.read_text()
    assert heading in headings(markdown), f"docs/{page} has no heading {heading!r}"
    assert squeeze(text) in squeeze(markdown), f"docs/{page} lost {text!r} from {section!r}"


def test_every_page_has_one_title_and_skips_no_heading_level():
    # Sphinx warns on a skipped level (`#` then `###`), and the site treats warnings as errors
    for path in [DOCS / "index.md", *sorted((DOCS / "guides").glob("*.md"))]:
        levels, fenced = [], False
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and (m := re.match(r"(#{1,6}) ", line)):
                levels.append(len(m.group(1)))
        assert levels[:1] == [1] and levels.count(1) == 1, f"{path.name}: one `# Title` first"
        for before, after in zip(levels, levels[1:], strict=False):
            assert after <= before + 1, f"{path.name}: a heading skips from level {before}"


def test_the_readme_names_the_commands_the_site_and_every_guide():
    readme = (REPO / "README.md").read_text()
    for command in ("make lab", "make test", "make site", "build/site/index.html"):
        assert command in readme
    guides = sorted(p.relative_to(REPO).as_posix() for p in (DOCS / "guides").glob("*.md"))
    assert len(guides) >= 11
    for guide in guides:
        assert guide in readme, f"the README does not say where {guide} lives"


def test_the_pages_link_only_pages_and_chapters_that_exist():
    # Sphinx cannot resolve a Markdown link to a repository file that is not a page: those are
    # `code` paths. A page's chapters are at chapters/ beside index.md on the site.
    for path in [DOCS / "index.md", DOCS / "performance-log.md", *(DOCS / "guides").glob("*.md")]:
        for target in re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"https?://", target):
                continue
            file = target.split("#")[0]
            assert file.endswith((".md", ".ipynb")), f"{path.name} links {target}: not a page"
            where = (path.parent / file).resolve().relative_to(DOCS.resolve()).as_posix()
            if where.startswith("api/"):
                continue  # the API reference is generated by `make site`
            base = REPO if where.startswith("chapters/") else DOCS
            assert (base / where).is_file(), f"{path.name} links {target}, which does not exist"


def test_the_benchmarks_page_shows_every_figure_of_its_run():
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook.viz import bench_figures

    results = json.loads((DOCS / "guides" / "bench-results.json").read_text())
    keys = set(bench_figures(results))
    plt.close("all")
    page = (DOCS / "guides" / "benchmarks.md").read_text()
    shown = set(re.findall(r"!\[[^\]]+\]\(bench-([a-z0-9-]+)\.png\)", page))
    assert keys and shown == keys
