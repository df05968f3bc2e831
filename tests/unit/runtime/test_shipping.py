"""Rank functions keep their source lines whatever cloudpickle does with code objects.

cloudpickle 3.1.3 renames every shipped code object's file to ``<dynamic-code>``; the launcher's
own pickler (:mod:`dmlbook.runtime.shipping`) must not care. The scenarios script runs the real
launcher under the installed cloudpickle, the oldest that pyproject.toml allows and 3.1.3,
installed with pip into a folder of their own (marker ``install``: needs the package registry, or
pip's cache).
"""

import json
import linecache
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
from packaging.version import Version

from dmlbook.runtime import shipping

REPO = Path(__file__).resolve().parents[3]
TARGETS = REPO / "build" / "pip-target"


def oldest_allowed(package: str) -> str:
    """The floor that pyproject.toml's dependencies give ``package`` (``>=X`` -> ``X``)."""
    text = (REPO / "pyproject.toml").read_text()  # tomllib is Python 3.11+; we allow 3.10
    if m := re.search(rf'^\s*"{package}>=([\w.]+)[,"]', text, re.MULTILINE):
        return m.group(1)
    raise AssertionError(f"pyproject.toml gives {package} no >= floor")


def test_code_objects_keep_file_name_and_cell_source():
    name = "/nonexistent/ipykernel_1/cell.py"
    source = "def outer(k):\n    def inner():\n        return k\n    return inner\n"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)
    payload, sources = shipping.dumps(namespace["outer"](3))
    fn = pickle.loads(payload)
    assert fn() == 3 and fn.__code__.co_filename == name
    assert fn.__code__.co_firstlineno == 2 and fn.__code__.co_qualname == "outer.<locals>.inner"
    assert sources == {name: source.splitlines(True)}
    # a function from a file on disk needs no copy of its source
    assert shipping.dumps(test_code_objects_keep_file_name_and_cell_source)[1] == {}


def test_install_sources_survives_checkcache():
    name = "/nonexistent/ipykernel_2/cell.py"
    linecache.cache.pop(name, None)
    shipping.install_sources({name: ["x = 1\n", "y = 2\n"]})
    linecache.checkcache()  # what traceback does for each frame
    assert linecache.getline(name, 2) == "y = 2\n"


def _cloudpickle_on_path(version: str) -> str | None:
    """A folder holding cloudpickle ``version`` for PYTHONPATH (None: it is the installed one)."""
    if Version(version) == Version(cloudpickle.__version__):
        return None
    target = TARGETS / f"cloudpickle-{version}"
    if not (target / "cloudpickle").is_dir():
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(target), f"cloudpickle=={version}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if result.returncode != 0:
            pytest.skip(f"could not install cloudpickle=={version}: {result.stderr[-300:]}")
    return str(target)


# The installed one, the oldest allowed, and the first release that renames code objects' files.
VERSIONS = {
    str(Version(v)): v for v in (cloudpickle.__version__, oldest_allowed("cloudpickle"), "3.1.3")
}


@pytest.mark.install
@pytest.mark.parametrize("version", sorted(VERSIONS.values(), key=Version))
def test_tracebacks_and_stacks_show_the_users_lines(version):
    extra = _cloudpickle_on_path(version)
    path = [p for p in (extra, str(REPO), os.environ.get("PYTHONPATH")) if p]
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "shipping_scenarios.py")],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"the scenarios did not finish:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert Version(report["cloudpickle"]) == Version(version)
    assert "<dynamic-code>" not in json.dumps(report)
    expected = {
        "cell": "return scale / (dist.get_rank() - 1)  # cell line: rank 1 divides by zero",
        "closure": "return [0][dist.get_rank() + offset]  # closure line: index out of range",
        "module": "raise LookupError('from a module')  # module line",
        "script": 'return {"x": 1}[("key", dist.get_rank())]  # script line that fails',
        "hang": "time.sleep(600)  # cell line where rank 0 hangs",
    }
    for scenario, line in expected.items():
        assert line in report[scenario], f"{scenario}: no source line in\n{report[scenario]}"
    assert re.search(r"ipykernel_7/0+7\.py\", line 5, in cell_fn", report["cell"])
