"""Teaching apart from machinery (issue 38, item 6): the layers of ``dmlbook/``, checked.

Three groups, each a set of top-level modules and packages of ``dmlbook/``:

* teaching: the book's algorithms (``comm``, ``data_parallel``, ``model_parallel``,
  ``advanced``); a learner reads them beside the chapters;
* shared pieces: what chapters and teaching code both read (data, models, optimizer steps, plots,
  notebook helpers, exercise checkers, the core-wait instrument);
* machinery: what runs, serves and measures the book (the launcher and its runtime, the network
  lab, the book's files and site, the classroom, the benchmarks).

No teaching module imports a machinery module, even inside a function (the graph is
``test_imports.py``'s, read with ``ast``), apart from the leaves listed in
:data:`ALLOWED_LEAVES`, each with its reason, and each checked to be a leaf. ``dmlbook/`` holds
only what the three groups name, and the package's map (``docs/guides/architecture.md``), the
root docstring and the API reference's sections (``dmlbook.book.static_site.API_SECTIONS``)
name the same groups.
"""

from __future__ import annotations

import re

import pytest

from tests.unit.test_imports import PACKAGE_ROOT, import_graph

TEACHING = {"comm", "data_parallel", "model_parallel", "advanced"}
SHARED = {"datasets", "models", "optim", "notebook", "viz", "exercises", "cpu_wait"}
MACHINERY = {"launch", "runtime", "netlab", "book", "classroom", "bench"}

# Machinery modules a teaching module may import, each a leaf (it imports no other module of
# dmlbook, checked below), so that teaching reaches no launcher code through it.
ALLOWED_LEAVES = {
    # memory_cap (chapter 5's small device) refuses to cap the notebook's own process: the one
    # honest sign of a rank that run() started is the variable the launcher sets, INSIDE_RUN,
    # which lives with the launcher's errors and limits.
    "dmlbook.runtime.errors": {"dmlbook.model_parallel.memory.device_cap"},
    # A checkpoint's temporary file carries its writer (pid, start time, host), so that what a
    # dead writer left is told by its owner, never by its name: the same owner record the
    # runtime's folders and the network lab's claims use, a leaf of the standard library.
    "dmlbook.runtime.owners": {"dmlbook.data_parallel.checkpoint.files"},
}


def _group(module: str, package: str = "dmlbook") -> str | None:
    """The top-level name (``comm``, ``launch``, ...) of a dotted module under ``package``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package else None


def machinery_imports(graph: dict[str, set[str]], package: str = "dmlbook", allowed=None):
    """Each (teaching module, machinery module) edge of ``graph`` not in ``allowed``."""
    allowed = ALLOWED_LEAVES if allowed is None else allowed
    return sorted(
        (module, target)
        for module, targets in graph.items()
        if _group(module, package) in TEACHING
        for target in targets
        if _group(target, package) in MACHINERY and module not in allowed.get(target, ())
    )


def not_leaves(graph: dict[str, set[str]], package: str = "dmlbook", allowed=None) -> dict:
    """The allowed leaves that import a module of the package, with what they import."""
    allowed = ALLOWED_LEAVES if allowed is None else allowed
    return {leaf: graph[leaf] for leaf in allowed if graph.get(leaf)}


def top_level(root) -> set[str]:
    """The modules and packages directly under the package folder ``root``."""
    names = set()
    for path in root.iterdir():
        if path.name.startswith(("_", ".")):
            continue
        if path.suffix == ".py":
            names.add(path.stem)
        elif path.is_dir() and (path / "__init__.py").exists():
            names.add(path.name)
    return names


def test_no_teaching_module_imports_machinery():
    graph = import_graph(PACKAGE_ROOT, "dmlbook")
    found = machinery_imports(graph)
    assert not found, "teaching imports machinery:\n" + "\n".join(f"{a} -> {b}" for a, b in found)
    assert not not_leaves(graph), "an allowed machinery module is no longer a leaf"
    for leaf, users in ALLOWED_LEAVES.items():  # every allowance is still needed
        assert all(leaf in graph[user] for user in users), (leaf, users)


def test_a_planted_machinery_import_is_found(tmp_path):
    """One inside a function, one relative, one through ``from package import module``; an
    allowed leaf is not reported until it imports something of the package."""
    package = tmp_path / "book"
    for folder in ("comm", "runtime", "datasets"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "launch.py").write_text("from book.runtime import errors\n")
    (package / "runtime" / "errors.py").write_text("import os\n")
    (package / "comm" / "a.py").write_text("def late():\n    from book.launch import run\n")
    (package / "comm" / "b.py").write_text("from ..runtime import errors\n")
    (package / "comm" / "c.py").write_text("from book import launch, datasets\n")
    graph = import_graph(package, "book")
    allowed = {"book.runtime.errors": {"book.comm.b"}}
    assert machinery_imports(graph, "book", allowed) == [
        ("book.comm.a", "book.launch"),
        ("book.comm.c", "book.launch"),
    ]
    assert machinery_imports(graph, "book", {})[1] == ("book.comm.b", "book.runtime.errors")
    assert not not_leaves(graph, "book", allowed)
    (package / "runtime" / "errors.py").write_text("def f():\n    import book.launch\n")
    assert not_leaves(import_graph(package, "book"), "book", allowed) == {
        "book.runtime.errors": {"book.launch"}
    }


def test_the_package_holds_only_what_the_layout_names():
    assert not (TEACHING & SHARED or TEACHING & MACHINERY or SHARED & MACHINERY)
    assert top_level(PACKAGE_ROOT) == TEACHING | SHARED | MACHINERY, (
        "a top-level module the layout does not name (or one gone): put it in one group here, "
        "in the root docstring, the architecture map and API_SECTIONS"
    )


def _architecture_map() -> dict[str, set[str]]:
    """The package map of docs/guides/architecture.md: each group heading's top-level names."""
    text = (PACKAGE_ROOT.parent / "docs" / "guides" / "architecture.md").read_text()
    block = text.split("```text\ndmlbook/\n", 1)[1].split("```", 1)[0]
    found: dict[str, set[str]] = {}
    group = None
    for line in block.splitlines():
        if m := re.match(r"  # (\w[\w ]*):", line):
            group = m[1]
            found[group] = set()
        elif re.match(r"  \w", line):
            names = re.split(r"\s{2,}", line.strip())[0]
            found[group] |= set(re.findall(r"(\w+)(?:\.py|/)", names))
    return found


def test_the_map_the_docstring_and_the_api_reference_name_the_same_groups():
    assert _architecture_map() == {
        "teaching": TEACHING,
        "shared pieces": SHARED,
        "machinery": MACHINERY,
    }
    import dmlbook

    doc = dmlbook.__doc__
    everything = TEACHING | SHARED | MACHINERY
    parts = re.split(r"^(Teaching|Shared pieces|Machinery) \(", doc, flags=re.M)
    named = {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}
    for group, names in [("Teaching", TEACHING), ("Shared pieces", SHARED),
                         ("Machinery", MACHINERY)]:  # fmt: skip
        assert {n for n in everything if f"``{n}``" in named[group]} == names, group

    static_site = pytest.importorskip("dmlbook.book.static_site")  # sphinx's side: nbformat
    sections: dict[str, set[str]] = {}
    for title, roots in static_site.API_SECTIONS.items():
        group = title.split(":", 1)[0]
        sections.setdefault(group, set()).update(_group(r) for r in roots)
        assert all(_group(r) is not None and r.count(".") == 1 for r in roots), roots
    assert sections == {"Teaching": TEACHING, "Shared pieces": SHARED, "Machinery": MACHINERY}
