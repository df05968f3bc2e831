"""The book as a static site: ``make site`` (``python -m dmlbook.book site build/site``).

Every chapter with its outputs and plots, the glossary, the guides (``docs/guides/``), the API
reference (from the package's docstrings) and a search that works offline, built by Sphinx with
myst-nb and sphinx-book-theme (``docs/conf.py`` says why that stack). The folder it writes needs
no server and no network: open its ``index.html``, or serve it with ``python -m http.server``.

The chapters come from ``dmlbook.book.executed``'s cache, filled by the test suite as it runs
them; a chapter the cache lacks runs here. The build happens in a temporary folder of its own
(the pages, the executed chapters, the API pages written from the package, the benchmark
plots), and Sphinx treats every warning as an error.
"""

from __future__ import annotations

import json
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from dmlbook import book
from dmlbook.book import executed

# The API reference's sections: each package, the modules under it (public ones: no part of the
# dotted name starts with "_"), in this order, under the package's three groups (the part of a
# title before ":"; tests/unit/test_layers.py checks that they name every top-level module once).
API_SECTIONS = {
    "Teaching: communication (chapters 2, 4, 13)": ["dmlbook.comm"],
    "Teaching: data parallelism (chapters 1-4)": ["dmlbook.data_parallel"],
    "Teaching: model parallelism (chapters 5-8)": ["dmlbook.model_parallel"],
    "Teaching: advanced paradigms (chapters 9-13)": ["dmlbook.advanced"],
    "Shared pieces: data, models, optimizers, plots, helpers, exercises": [
        "dmlbook.datasets",
        "dmlbook.models",
        "dmlbook.optim",
        "dmlbook.viz",
        "dmlbook.notebook",
        "dmlbook.cpu_wait",
        "dmlbook.exercises",
    ],
    "Machinery: launching ranks": ["dmlbook.launch", "dmlbook.runtime"],
    "Machinery: network lab, book, classroom, benchmarks": [
        "dmlbook.netlab",
        "dmlbook.book",
        "dmlbook.classroom",
        "dmlbook.bench",
    ],
}


class SiteError(RuntimeError):
    """The site did not build: Sphinx's warnings (each one an error here) or a chapter's."""


@dataclass
class Built:
    """What a build did: where the site is, which chapters ran now, and how long it took."""

    folder: Path
    chapters: list[str]
    ran_now: list[str] = field(default_factory=list)
    seconds: float = 0.0


def heading_id(text: str) -> str:
    """A heading's anchor as JupyterLab makes it: its text, each space made ``-``
    (``docs/conf.py`` gives the site the same, so one link works in both)."""
    return text.replace(" ", "-")


def repository() -> Path:
    """The checkout the site is built from (its ``docs/`` and ``chapters/``)."""
    root = book.chapters_dir().parent
    if not (root / "docs" / "conf.py").exists():
        raise SiteError(
            f"the site is built from a checkout of dmlbook (docs/ beside chapters/); {root} "
            "has no docs/conf.py"
        )
    return root


def chapter_paths() -> list[Path]:
    """The chapters, in the book's order (the glossary is a page of its own)."""
    return [p for p in book.chapters() if p.name[0].isdigit()]


def modules() -> dict[str, list[str]]:
    """Each API section's public modules, found by walking the packages it names."""
    found: dict[str, list[str]] = {}
    for section, roots in API_SECTIONS.items():
        names: list[str] = []
        for root in roots:
            names.append(root)
            module = __import__(root, fromlist=["_"])
            if hasattr(module, "__path__"):
                for info in pkgutil.walk_packages(module.__path__, prefix=root + "."):
                    if not any(part.startswith("_") for part in info.name.split(".")):
                        names.append(info.name)
        found[section] = names
    return found


def _slug(section: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in section.lower()).strip("-").replace("--", "-")


def _api_pages(stage: Path) -> None:
    """One page per section, each module under its own heading (a page per module would make
    every page's sidebar 160 lines long, and Sphinx's build several times slower)."""
    folder = stage / "api"
    folder.mkdir()
    index = [
        "# API reference",
        "",
        "Every public module of the package, from its docstring; each names the chapter that "
        "teaches it. A package's face (`dmlbook.comm`, `dmlbook.data_parallel`, ...) gathers "
        "names defined in its modules, and each name is described once, in the module that "
        "defines it.",
        "",
    ]
    pages = []
    for section, names in modules().items():
        slug = _slug(section)
        body = [f"# {section}", ""]
        for name in names:
            body += [f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}",
                     "   :ignore-module-all:", "```", ""]  # fmt: skip
        (folder / f"{slug}.md").write_text("\n".join(body))
        index.append(f"* [{section}]({slug}.md): " + ", ".join(f"`{n}`" for n in names))
        pages.append(slug)
    index += ["", "```{toctree}", ":hidden:", ":titlesonly:", ":maxdepth: 1", "", *pages, "```", ""]
    (folder / "index.md").write_text("\n".join(index))


def _bench_figures(stage: Path) -> None:
    results = stage / "guides" / "bench-results.json"
    if not results.exists():
        return
    import matplotlib

    matplotlib.use("Agg")
    from dmlbook import viz

    for name, figure in viz.bench_figures(json.loads(results.read_text())).items():
        figure.savefig(stage / "guides" / f"bench-{name}.png", dpi=110, bbox_inches="tight")
        matplotlib.pyplot.close(figure)


# The guides in the sidebar, in the order a reader meets their questions (any other guide follows).
GUIDES = ["instructors", "launching", "ranks-magic", "gpus", "torchrun", "elastic", "netlab",
          "data", "benchmarks", "architecture", "testing"]  # fmt: skip


def _toctree(caption: str, pages: list[str]) -> list[str]:
    """A sidebar section: its pages by title only (the sidebar would list every heading)."""
    return ["", "```{toctree}", ":hidden:", ":titlesonly:", ":maxdepth: 1",
            f":caption: {caption}", "", *pages, "```", ""]  # fmt: skip


def _navigation(stage: Path, chapters: list[str]) -> None:
    found = {p.stem for p in (stage / "guides").glob("*.md")}
    guides = [g for g in GUIDES if g in found] + sorted(found - set(GUIDES))
    toc = [
        *_toctree("Chapters", [f"chapters/{c}" for c in chapters]),
        *_toctree("Guides", [f"guides/{g}" for g in guides]),
        *_toctree("Reference", ["chapters/glossary", "api/index", "performance-log"]),
    ]
    index = stage / "index.md"
    index.write_text(index.read_text() + "\n".join(toc))


def build(
    out: Path,
    *,
    run_missing: bool = True,
    chapters: list[Path] | None = None,
    log=print,
) -> Built:
    """Build the site into ``out`` (replaced). Chapters come from the cache of executed runs;
    those it lacks run now, unless ``run_missing`` is false (then a :class:`SiteError`).
    ``chapters`` builds a site of some chapters only (all by default)."""
    started = time.monotonic()
    root = repository()
    out = Path(out).resolve()
    chapters = chapter_paths() if chapters is None else [Path(p) for p in chapters]
    built = Built(out, [p.stem for p in chapters])
    with tempfile.TemporaryDirectory(prefix="dmlbook-site-") as tmp:
        stage = Path(tmp) / "source"
        shutil.copytree(root / "docs", stage)
        (stage / "chapters").mkdir()
        for path in chapters:
            kept = executed.lookup(path)
            if kept is None:
                if not run_missing:
                    raise SiteError(f"{path.name} has no executed run in {executed.cache_dir()}")
                log(f"running {path.name} (not in the cache)")
                kept = executed.execute(path)
                built.ran_now.append(path.stem)
            nbformat.write(kept, stage / "chapters" / path.name)
        shutil.copy(book.chapters_dir() / "glossary.ipynb", stage / "chapters")
        _api_pages(stage)
        _bench_figures(stage)
        _navigation(stage, built.chapters)
        if out.exists():
            shutil.rmtree(out)
        done = subprocess.run(
            [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-E",
             "-d", str(Path(tmp) / "doctrees"), str(stage), str(out)],
            capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
        if done.returncode != 0:
            raise SiteError(
                f"sphinx-build failed ({done.returncode}):\n"
                + (done.stderr.replace(str(stage) + "/", "") or done.stdout)[-20000:]
            )
    built.seconds = time.monotonic() - started
    return built


__all__ = ["SiteError", "build", "chapter_paths", "heading_id", "modules", "repository"]
