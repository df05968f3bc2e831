"""No import circle anywhere in dmlbook, counting the imports inside functions and methods.

An import inside a function still ties two modules together: it only moves the failure from import
time to the first call. So the graph here is built from every ``import`` statement in every module
under ``dmlbook/``, read with ``ast`` (module level and nested), and each strongly connected
component of more than one module (Tarjan's algorithm) is a circle. The edge goes to the deepest
module a statement names (``from a.b import c`` -> ``a.b.c`` if that is a module, else ``a.b``);
importing a submodule runs its parent packages' ``__init__`` too, but that adds no edge here: a
package that re-exports its modules is not in a circle with them.

And one home per public name: no public name is *defined* (by ``def``, ``class`` or assignment at
a module's top level) in two modules of the package; a package face re-exporting it by
``import`` is fine.

And private means private: no module takes another module's underscore name, whether by
``from m import _x`` (absolute or relative) or as ``m._x`` of a module ``m`` it imported. What
another module needs is public, with a name and a docstring, in the module where it belongs.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import dmlbook

PACKAGE_ROOT = Path(dmlbook.__file__).resolve().parent


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module under the package folder ``root``, by dotted name (a package: its __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ``modules`` (None: outside)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]  # its package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1 more
                base_parts = here[: len(here) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from a.b import c`` names the module a.b.c if there is one, else something in a.b
            names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] or [base]
        else:
            continue
        for name in names:
            target = _deepest(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative depth-first search: a deep chain of imports must not hit the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def describe(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in found:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        lines.append(f"circle of {len(component)}: " + ", ".join(component))
        lines += [f"    {edge}" for edge in edges]
    return "\n".join(lines)


def test_dmlbook_has_no_import_circle():
    graph = import_graph(PACKAGE_ROOT, "dmlbook")
    assert len(graph) > 100  # the walk found the package's modules
    found = circles(graph)
    print(describe(found, graph) or "no circle")
    assert not found, "import circles in dmlbook:\n" + describe(found, graph)


def test_the_machinery_reaches_comm_but_comm_not_the_launcher():
    """The edges the circles test relies on are really read: the all-reduce bench imports
    comm.groups (device) and the launcher's face, and nothing in comm imports the runtime."""
    graph = import_graph(PACKAGE_ROOT, "dmlbook")
    assert {"dmlbook.comm.groups", "dmlbook.launch"} <= graph["dmlbook.bench.allreduce"]
    for module, targets in graph.items():
        if module.startswith("dmlbook.comm"):
            assert not {t for t in targets if t.startswith(("dmlbook.launch", "dmlbook.runtime"))}


def test_a_planted_circle_is_found(tmp_path):
    """Two modules that import each other (one inside a function, one relatively, one through
    ``from package import module``) are reported; a package re-exporting its module is not."""
    package = tmp_path / "planted"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("from planted.inner import b\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "a.py").write_text("def late():\n    from planted.inner import b\n    return b\n")
    (package / "inner" / "b.py").write_text("from .. import a\nimport os\n")
    (package / "c.py").write_text("import planted.a\n")
    graph = import_graph(package, "planted")
    assert graph["planted.inner.b"] == {"planted.a"}
    assert graph["planted.a"] == {"planted.inner.b"}
    assert graph["planted.c"] == {"planted.a"}
    found = circles(graph)
    assert found == [["planted.a", "planted.inner.b"]], describe(found, graph)
    assert "planted.a -> planted.inner.b" in describe(found, graph)


def test_a_longer_circle_and_two_separate_ones_are_found(tmp_path):
    package = tmp_path / "loops"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, target in {"x": "y", "y": "z", "z": "x", "p": "q", "q": "p", "leaf": "x"}.items():
        (package / f"{name}.py").write_text(
            f"class K:\n    def m(self):\n        import loops.{target}\n"
        )
    found = circles(import_graph(package, "loops"))
    assert found == [["loops.p", "loops.q"], ["loops.x", "loops.y", "loops.z"]]


# ---- one home per public name ------------------------------------------------------------------

# Defined twice today, each with its fix: the list only shrinks (issue 38, item 5).
NOT_YET_ONE_HOME: dict = {}


def _bound_at_top(statements: list[ast.stmt]) -> set[str]:
    """Names a module's top level binds by ``def``, ``class`` or assignment, looking inside
    top-level ``if``, ``try`` and ``with`` blocks too; imports bind nothing here."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [getattr(node, f, []) for f in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                names |= _bound_at_top(block)
    return names


def public_definitions(root: Path, package: str) -> dict[str, list[str]]:
    """Each public name (no leading underscore) defined at the top level of a module under
    ``root``, with the modules that define it. A ``__main__`` module is a program
    (``python -m``), never imported, so its ``main`` is no name of the package."""
    homes: dict[str, list[str]] = {}
    for module, path in module_files(root, package).items():
        if module.endswith(".__main__"):
            continue
        for name in _bound_at_top(ast.parse(path.read_text(), str(path)).body):
            if not name.startswith("_"):
                homes.setdefault(name, []).append(module)
    return homes


def test_no_public_name_is_defined_in_two_modules():
    homes = public_definitions(PACKAGE_ROOT, "dmlbook")
    assert len(homes) > 500  # the walk read the package's definitions
    allowed = set(NOT_YET_ONE_HOME)
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    found = sorted(f"{name}: {', '.join(sorted(where))}" for name, where in twice.items()
                   if name not in allowed)  # fmt: skip
    assert not found, "public names defined in more than one module:\n" + "\n".join(found)


def test_a_name_defined_twice_is_found_and_a_re_export_is_not(tmp_path):
    package = tmp_path / "twice"
    package.mkdir()
    sources = {
        "__init__": "from twice.a import shared, only_a\n__all__ = ['shared']\n",
        "a": "def shared():\n    pass\n\nonly_a = 1\n_private = 2\n",
        "b": "from twice.a import only_a\n_private = 3\n"
        "try:\n    class shared:\n        pass\nexcept ImportError:\n    pass\n",
        "__main__": "def main():\n    pass\n",
        "c": "def main():\n    pass\n",
    }
    for name, source in sources.items():
        (package / f"{name}.py").write_text(source)
    homes = public_definitions(package, "twice")
    assert sorted(homes["shared"]) == ["twice.a", "twice.b"]  # a def, and a class inside a try
    assert homes["only_a"] == ["twice.a"]  # imported by the package and by b: defined in a only
    assert homes["main"] == ["twice.c"]  # the program's main (__main__) is not counted
    assert "_private" not in homes


# ---- private means private ----------------------------------------------------------------------

# Files whose underscore imports are still to be fixed (issue 38, item 5): an import of an
# underscore name is let through when the importing file or the file that defines the name is one
# of these. The list only shrinks.
PRIVATE_IMPORTS_NOT_YET_FIXED: set[str] = set()


def _import_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The dotted module a ``from ... import`` statement of ``module`` (at ``path``) reads from."""
    if not node.level:
        return node.module or ""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base_parts = here[: len(here) - (node.level - 1)]
    return ".".join(base_parts + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path, package: str) -> list[tuple[str, str, str, int]]:
    """Each underscore name a module of the package takes from another of its modules, as
    (importing module, module it comes from, name, line): ``from m import _x`` (absolute or
    relative), or the attribute ``m._x`` of a module ``m`` it imported (``from p import m``,
    ``import p.m as m``)."""
    modules = module_files(root, package)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # a local name -> the package's module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _import_base(module, path, node)
                if _deepest(base, modules) is None:
                    continue  # outside the package
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:  # a module, taken as a name
                        bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif _private(alias.name) and base != module:
                        found.append((module, base, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and bound.get(node.value.id, module) != module
                and _private(node.attr)
            ):
                found.append((module, bound[node.value.id], node.attr, node.lineno))
    return sorted(found)


def _not_yet_fixed(module: str, modules: dict[str, Path], root: Path) -> bool:
    relative = modules[module].relative_to(root).as_posix() if module in modules else ""
    return any(
        relative == entry or (entry.endswith("/") and relative.startswith(entry))
        for entry in PRIVATE_IMPORTS_NOT_YET_FIXED
    )


def test_no_module_imports_another_modules_private_name():
    modules = module_files(PACKAGE_ROOT, "dmlbook")
    every = private_imports(PACKAGE_ROOT, "dmlbook")
    found = [
        f"{importer} line {line}: {source}.{name}"
        for importer, source, name, line in every
        if not (_not_yet_fixed(importer, modules, PACKAGE_ROOT)
                or _not_yet_fixed(_deepest(source, modules), modules, PACKAGE_ROOT))
    ]  # fmt: skip
    assert not found, "underscore names imported across modules:\n" + "\n".join(found)


def test_a_planted_private_import_is_found(tmp_path):
    """Absolute, relative and attribute imports of another module's ``_x`` are found; a public
    name, a dunder, a module's own ``_x`` and names from outside the package are not."""
    package = tmp_path / "leaky"
    (package / "inner").mkdir(parents=True)
    sources = {
        "__init__": "from leaky.a import public, __version__\n",
        "a": "__version__ = '1'\n_x = 1\npublic = 2\nprint(_x)\n",
        "b": "from leaky.a import _x, public\nfrom os import _exit\n",
        "inner/__init__": "",
        "inner/c": "def late():\n    from ..a import _x as y\n    return y\n",
        "inner/d": "from leaky import a\nimport leaky.a as aa\nprint(a._x, aa.public, aa._x)\n",
    }
    for name, source in sources.items():
        (package / f"{name}.py").write_text(source)
    found = private_imports(package, "leaky")
    assert found == [
        ("leaky.b", "leaky.a", "_x", 1),
        ("leaky.inner.c", "leaky.a", "_x", 2),
        ("leaky.inner.d", "leaky.a", "_x", 3),
        ("leaky.inner.d", "leaky.a", "_x", 3),
    ], found


# ---- the public surface: what something reads, each from its own package ----------------------

REPOSITORY = PACKAGE_ROOT.parent
# Where the package's names are read from outside their module: the package, the chapters, the
# tests, the examples, the guides and the repository's own top-level files.
READERS = ("dmlbook", "chapters", "tests", "examples", "docs", "jupyterhub")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Exported but read nowhere outside their module, in files of the other helpers of session 15
# (issue 38, item 5): each leaves its module's __all__. The list only shrinks.
NOT_YET_READ: dict = {}

# A module face that is the public door of another package, by design.
FACES_OF_ANOTHER_PACKAGE = {
    # "from dmlbook.launch import run, Ranks" is every chapter's first line: the runtime's face.
    "dmlbook.launch": "dmlbook.runtime",
}
# A name listed by a face whose home is in another top-level package, still to be fixed (issue
# 38, item 5): users import it from its home, and the face drops it. The list only shrinks.
NOT_YET_OWN_FACE: dict = {}


def exported(root: Path, package: str) -> dict[str, list[str]]:
    """Each module's ``__all__`` (as written, read with ``ast``), for the modules that have one."""
    lists = {}
    for module, path in module_files(root, package).items():
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                lists[module] = [ast.literal_eval(element) for element in node.value.elts]
    return lists


def _words_read(path: Path) -> tuple[set[str], set[str]]:
    """(names a file reads, names it imports by ``from m import name``). A Python file reads the
    names and attributes it uses and the words of its strings (docstrings name what they
    explain), not the strings of its own ``__all__``; a notebook or a page, every word."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return set(WORD.findall("\n".join("".join(cell["source"]) for cell in cells))), set()
    if path.suffix != ".py":
        return set(WORD.findall(path.read_text(errors="replace"))), set()
    tree = ast.parse(path.read_text(), str(path))
    skip = {
        id(inner)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "__all__" for t in node.targets)
        for inner in ast.walk(node)
    }
    read, imported = set(), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Name):
            read.add(node.id)
        elif isinstance(node, ast.Attribute):
            read.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            read |= set(WORD.findall(node.value))
    return read, imported


def reader_files(repository: Path, readers: tuple[str, ...]) -> list[Path]:
    """The repository's files that may read the package: Python, notebooks and pages under
    ``readers``, and the top-level files beside them."""
    found = [p for p in repository.iterdir() if p.is_file()]
    for folder in readers:
        for path in sorted((repository / folder).rglob("*")):
            if path.suffix in (".py", ".ipynb", ".md") and ".ipynb_checkpoints" not in path.parts:
                found.append(path)
    return found


def unread_exports(repository: Path, root: Path, package: str, readers=READERS) -> list[tuple]:
    """Each (module, name) of an ``__all__`` that no file outside the name's home reads: the
    home (the module defining it) does not count, nor a face that lists it (its import is the
    re-export itself; any other use there counts)."""
    modules = module_files(root, package)
    lists = exported(root, package)
    homes = public_definitions(root, package)
    listing: dict[str, set[Path]] = {}
    for module, names in lists.items():
        for name in names:
            listing.setdefault(name, set()).add(modules[module].resolve())
    this_test = Path(__file__).resolve()  # its allow-lists name what they let through
    words = {
        path.resolve(): _words_read(path)
        for path in reader_files(repository, readers)
        if path.resolve() != this_test
    }
    unread = []
    for module, names in sorted(lists.items()):
        for name in names:
            home = {modules[m].resolve() for m in homes.get(name, [])}
            if f"{module}.{name}" in modules:
                home.add(modules[f"{module}.{name}"].resolve())  # a subpackage, named by its face
            readers_of = [
                path
                for path, (read, imported) in words.items()
                if path not in home
                and (name in read or (name in imported and path not in listing[name]))
            ]
            if not readers_of:
                unread.append((module, name))
    return unread


def test_every_exported_name_is_read_outside_its_module():
    lists = exported(PACKAGE_ROOT, "dmlbook")
    assert len(lists) > 80 and sum(map(len, lists.values())) > 500  # the walk read the lists
    every = unread_exports(REPOSITORY, PACKAGE_ROOT, "dmlbook")
    assert not set(NOT_YET_READ) - set(every), "read now: drop from NOT_YET_READ"
    unread = [entry for entry in every if entry not in NOT_YET_READ]
    assert not unread, "in __all__ but read nowhere outside their module:\n" + "\n".join(
        f"{module}: {name}" for module, name in unread
    )


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def foreign_exports(root: Path, package: str, faces=None) -> list[tuple[str, str, str]]:
    """Each (module, name, home) where a module's ``__all__`` lists a name defined only in
    another top-level package (``dmlbook.comm`` vs ``dmlbook.runtime``; a top-level module is a
    package of its own), unless ``faces`` names the module as that package's public face."""
    faces = FACES_OF_ANOTHER_PACKAGE if faces is None else faces
    modules = module_files(root, package)
    homes = public_definitions(root, package)
    found = []
    for module, names in sorted(exported(root, package).items()):
        for name in names:
            where = homes.get(name, [])
            if f"{module}.{name}" in modules or module in where or not where:
                continue  # a subpackage, its own name, or a name from outside the package
            if any(_top(home) in (_top(module), faces.get(module)) for home in where):
                continue
            found.append((module, name, sorted(where)[0]))
    return found


def test_no_face_exports_another_packages_name():
    every = foreign_exports(PACKAGE_ROOT, "dmlbook")
    assert not set(NOT_YET_OWN_FACE) - {(m, n) for m, n, _ in every}, "fixed: drop the entry"
    found = [
        f"{m}: {name} (home {home})" for m, name, home in every if (m, name) not in NOT_YET_OWN_FACE
    ]
    assert not found, "names exported away from their package:\n" + "\n".join(found)


def test_an_unread_export_and_a_foreign_one_are_found(tmp_path):
    """A name in ``__all__`` that only its module uses is found, as is one only a face's import
    and a module's own ``__all__`` name; one read by a chapter, a test, a page or another
    module's docstring is not. A face listing a name of another top-level package is found,
    unless it is that package's declared face."""
    repository = tmp_path / "repo"
    package = repository / "pk"
    for folder in ("pk/alpha", "pk/beta", "chapters", "tests", "docs"):
        (repository / folder).mkdir(parents=True)
    sources = {
        "pk/__init__.py": "",
        "pk/alpha/__init__.py": "from pk.alpha.a import face_only, used\n"
        "from pk.beta.b import Beta\n__all__ = ['face_only', 'used', 'Beta']\n",
        "pk/alpha/a.py": "__all__ = ['alone', 'face_only', 'used', 'in_test', 'in_nb', 'in_doc',"
        " 'in_docstring']\n"
        "def alone(): pass\ndef face_only(): pass\ndef used(): pass\ndef in_test(): pass\n"
        "def in_nb(): pass\ndef in_doc(): pass\ndef in_docstring(): pass\nalone(); in_nb()\n",
        "pk/beta/__init__.py": "",
        "pk/beta/b.py": '"""Like :func:`in_docstring`."""\nfrom pk.alpha import used\n'
        "__all__ = ['Beta', 'in_test']\nclass Beta: pass\nused()\n",
        "pk/door.py": "from pk.beta.b import Beta\n__all__ = ['Beta']\n",
        "tests/test_a.py": "from pk.alpha.a import in_test\nfrom pk.door import Beta\n",
        "chapters/01.ipynb": json.dumps({"cells": [{"source": ["a.in_nb()\n"]}]}),
        "docs/page.md": "Call `in_doc`.\n",
    }
    for name, source in sources.items():
        (repository / name).write_text(source)
    readers = ("pk", "chapters", "tests", "docs")
    assert unread_exports(repository, package, "pk", readers) == [
        ("pk.alpha", "face_only"),  # read by no one: the face's import is the re-export itself
        ("pk.alpha.a", "alone"),  # used in its own module only
        ("pk.alpha.a", "face_only"),
    ]
    assert foreign_exports(package, "pk", faces={}) == [
        ("pk.alpha", "Beta", "pk.beta.b"),
        ("pk.beta.b", "in_test", "pk.alpha.a"),  # a module, not only a package face, is held to it
        ("pk.door", "Beta", "pk.beta.b"),
    ]
    assert ("pk.door", "Beta", "pk.beta.b") not in foreign_exports(
        package, "pk", faces={"pk.door": "pk.beta"}
    )
