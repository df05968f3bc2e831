"""Installs that never break: the lock, the files that must agree with it, and a newcomer's path.

The static checks read pyproject.toml, requirements.lock, lock-constraints.txt, environment.yml
and the Makefile. The newcomer test (marker ``install``) clones the repository's committed
state into a temporary folder, runs the README's set-up command there from nothing, and executes
a chapter in the environment it built: a missing install step cannot hide behind a warm machine.
The wheel test (marker ``install`` too) does what a class server does: it builds the wheel,
installs it non-editable over the lock into a fresh venv, copies the book with
``python -m dmlbook.classroom copy-book`` into an empty folder and runs a chapter there, nothing of
the checkout in reach.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dmlbook.book import executed

REPO = Path(__file__).resolve().parents[2]
# The chapter a fresh environment runs: chapter 10 starts ranks and reads the shipped digits, as
# most chapters do, in about 10 s here. It was chapter 2 (30 s, in each of the two tests below),
# for its assert that a rank's traceback shows the cell's source line, which broke on a fresh
# install once (cloudpickle 3.1.3); test_shipping now checks that against each cloudpickle the
# lock's range allows, and the suite runs chapter 2 itself under nbval.
CHAPTER = "chapters/10_federated_learning.ipynb"


def lock_pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"requirements.lock: not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def project_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and its extras (tomllib is 3.11+; we allow 3.10)."""
    text = (REPO / "pyproject.toml").read_text()
    found = []
    for table in ("dependencies", "dev", "jupyterhub"):
        block = re.search(rf"^{table} = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
        assert block, f"pyproject.toml has no {table} list"
        found += [Requirement(r) for r in re.findall(r'"([^"]+)"', block.group(1))]
    return found


def readme_setup_command() -> str:
    """The set-up command that the README's first shell block gives."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    assert block, "README.md has no bash block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    setup = [c for c in commands if c.startswith("make install")]
    assert setup, "the README's first bash block gives no `make install` set-up command"
    return setup[0]


def test_lock_pins_every_requirement_within_its_range():
    pins = lock_pins()
    assert len(pins) > 50, "the lock should hold the full dependency tree, not just our own"
    for requirement in project_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is a requirement but not in requirements.lock"
        # a local build such as 2.13.0+cpu satisfies ==2.13.0 and >=2.4
        public = Version(pins[name].public)
        assert requirement.specifier.contains(public, prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject's {requirement}"
        )


def test_lock_has_the_torch_it_was_made_for():
    constraint = Requirement(
        next(
            line
            for line in (REPO / "lock-constraints.txt").read_text().splitlines()
            if line.strip().startswith("torch")
        )
    )
    assert constraint.specifier.contains(Version(lock_pins()["torch"].public))


def test_the_lock_leaves_out_what_lock_overrides_txt_removes():
    """A requirement overridden with a marker that never holds is kept out of the lock: a lock
    made without the overrides would bring it back (rfc3987-syntax: 1-2 CPU-seconds in every
    process that imports nbformat, see lock-overrides.txt)."""
    lines = (REPO / "lock-overrides.txt").read_text().splitlines()
    overrides = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    removed = {
        canonicalize_name(r.name)
        for r in overrides
        if r.marker is not None and not r.marker.evaluate({"sys_platform": sys.platform})
    }
    assert "rfc3987-syntax" in removed
    assert removed.isdisjoint(lock_pins()), sorted(removed & lock_pins().keys())
    assert "--overrides lock-overrides.txt" in (REPO / "Makefile").read_text()


def test_environment_yml_and_makefile_agree_with_the_lock():
    env = (REPO / "environment.yml").read_text()
    makefile = (REPO / "Makefile").read_text()
    lock_python = re.search(r"^LOCK_PYTHON\s*:?=\s*(\S+)", makefile, re.MULTILINE).group(1)
    assert re.search(rf"^\s*- python={re.escape(lock_python)}\s*$", env, re.MULTILINE), (
        f"environment.yml should ask for the Python the lock is made for ({lock_python})"
    )
    assert re.search(r"^\s*- -r requirements\.lock\s*$", env, re.MULTILINE)
    uv = Version(re.search(r"^UV_VERSION\s*:?=\s*(\S+)", makefile, re.MULTILINE).group(1))
    assert uv.release, "the installer's version is pinned in the Makefile"
    # CI runs the README's test command through make, so it installs from the lock too
    assert "make test" in (REPO / ".ci" / "run").read_text()


@pytest.mark.install
@pytest.mark.slow(seconds=45)
@pytest.mark.timeout(900)
def test_a_newcomer_sets_up_from_nothing_and_runs_a_chapter(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    assert not (clone / ".venv").exists()
    env = newcomer_env(tmp_path)  # no virtual environment active, nothing of ours on the path
    # The README's command as it stands, but with BYTECODE= (empty): no .pyc compiled at install
    # for every module of the venv (23 CPU-seconds of a 2-core machine), written on first import
    # instead. The suite's own set-up (`make test` -> `make install`) compiles them every run.
    env["BYTECODE"] = ""
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    setup = subprocess.run(
        readme_setup_command(),
        shell=True,
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert setup.returncode == 0, f"set-up failed:\n{setup.stdout[-3000:]}\n{setup.stderr[-3000:]}"
    python = clone / ".venv" / "bin" / "python"
    chapter = subprocess.run(
        [str(python), "-m", "pytest", CHAPTER, "--nbval-lax", "--nbval-current-env", "-q",
         "-p", "no:cacheprovider"],
        cwd=clone,
        env=dict(env, MPLBACKEND="Agg"),
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert chapter.returncode == 0, (
        f"{CHAPTER} failed in the fresh environment:\n{chapter.stdout[-5000:]}"
    )
    assert re.search(r"\d+ passed", chapter.stdout)
    # and the environment holds the package from the clone, not from this checkout
    where = subprocess.run(
        [str(python), "-c", "import dmlbook; print(dmlbook.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert where.stdout.strip().startswith(str(clone))


def newcomer_env(tmp_path: Path) -> dict[str, str]:
    """A shell with no virtual environment active and nothing of this checkout's on the path.
    Its temporary files (uv's locks, torchrun's and the kernels' folders) go to the test's own
    folder, which pytest removes."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS", "MAKEFLAGS", "MAKELEVEL")
    }
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != bin_dir)
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env


def makefile_torch_source(env: dict[str, str]) -> list[str]:
    """Where the Makefile gets torch's CPU build (its TORCH_SOURCE): asked of make itself."""
    printed = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval",
         "print-torch-source: ; @echo $(TORCH_SOURCE)", "print-torch-source"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return printed.stdout.split()


UV = Path(sys.executable).parent / "uv"  # make install puts the pinned uv into .venv


@pytest.mark.install
@pytest.mark.slow(seconds=40)
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not UV.exists() or shutil.which("make") is None,
    reason="needs the checkout's .venv/bin/uv (make install) and make",
)
# Its run of chapter 10 in the learner's copy is the session's nbval run of chapter 10: the same
# notebook (the wheel is built from this working tree), every cell. Skipped at collection, so
# that conftest.py leaves the chapter's own cells out only when this test runs.
@pytest.mark.runs_chapters(Path(CHAPTER).name)
def test_the_wheel_carries_the_book_and_a_learners_copy_runs_outside_the_checkout(tmp_path):
    """What a class server does: build the wheel, install it (not editable) over the lock into a
    fresh venv, copy the book into an empty folder, and run chapter 10 there under nbval."""
    # No --compile-bytecode, unlike `make install`: compiling every module of the venv (torch's
    # thousands) cost 23 CPU-seconds of a 2-core machine, where this venv's few processes import
    # a fraction of them. Python writes those .pyc files on first import instead, so the variable
    # that forbids it (set on CI) is left out of this venv's processes.
    env = newcomer_env(tmp_path)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    times = {}

    def step(name: str, command: list, **how) -> subprocess.CompletedProcess:
        start = time.monotonic()
        done = subprocess.run(
            [str(c) for c in command], env=how.pop("env", env), capture_output=True, text=True,
            timeout=how.pop("timeout", 600), **how,
        )  # fmt: skip
        times[name] = time.monotonic() - start
        assert done.returncode == 0, f"{name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return done

    # 1. The wheel, built as a release is (the sdist, then the wheel from it), with the build
    #    backend pinned by the lock; it carries the chapters, data and scripts as package files.
    dist = tmp_path / "dist"
    step("build", [UV, "build", "--quiet", "--out-dir", dist,
                   "--build-constraints", REPO / "requirements.lock", REPO])  # fmt: skip
    (wheel,) = dist.glob("dmlbook-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n.removeprefix("dmlbook/book/") for n in z.namelist()}
    expected = {
        *(f"chapters/{p.name}" for p in (REPO / "chapters").glob("*.ipynb")),
        *(f"examples/{p.name}" for p in (REPO / "examples").glob("*.py")),
        "data/digits.npz",
        "data/README.md",
    }
    assert expected <= shipped, f"the wheel lacks {sorted(expected - shipped)}"
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size / 1e3:.0f} kB")

    # 2. A fresh venv: the lock, as `make install` installs it, then the wheel, not editable.
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    torch_source = makefile_torch_source(env)
    step("venv", [UV, "venv", "--quiet", "--python", sys.executable, venv])
    step("sync", [UV, "pip", "sync", "--python", python, "--quiet",
                  *torch_source, REPO / "requirements.lock"])  # fmt: skip
    step("wheel", [UV, "pip", "install", "--python", python, "--quiet",
                   *torch_source, wheel])  # fmt: skip

    # 3. The learner's copy, in an empty folder outside the repository.
    learner = tmp_path / "learner"
    assert not learner.is_relative_to(REPO)
    copied = step("copy", [python, "-m", "dmlbook.classroom", "copy-book", learner], cwd=tmp_path)
    chapters = sorted(p.name for p in (REPO / "chapters").glob("*.ipynb"))
    assert sorted(p.name for p in learner.glob("*.ipynb")) == chapters, copied.stdout
    assert f"{len(chapters)} written" in copied.stdout

    # Everything the learner's kernel imports and reads comes from the new venv, none of it
    # from this checkout.
    probe = (
        "import json, sys, dmlbook, dmlbook.book as b, dmlbook.datasets as d; print(json.dumps(["
        "dmlbook.__file__, str(b.chapters_dir()), str(d.DATA_DIR), str(d.EXAMPLES_DIR), sys.path]))"
    )
    where = step("probe", [python, "-c", probe], cwd=learner)
    package, chapters_dir, data_dir, examples_dir, path = json.loads(where.stdout)
    for found in (package, chapters_dir, data_dir, examples_dir):
        assert Path(found).is_relative_to(venv), f"{found} is not in the new venv"
    assert (Path(data_dir) / "digits.npz").is_file()
    assert (Path(examples_dir) / "elastic_train.py").is_file()
    assert not [p for p in path if p and Path(p).resolve().is_relative_to(REPO)], path

    # The installed scripts run under torchrun started where chapters 3 and 4 start it (the
    # parent of EXAMPLES_DIR, first on the agent's sys.path).
    hello = step("torchrun", [python, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", Path(examples_dir) / "hello_ranks.py"],
                 cwd=Path(examples_dir).parent, env=dict(env, OMP_NUM_THREADS="1"),
                 timeout=120)  # fmt: skip
    assert "rank 0 local rank 0" in hello.stdout and "rank 1 local rank 1" in hello.stdout

    # 4. Chapter 10, run by nbval in the learner's folder with the new venv's Python.
    #    It is kept for the site in this checkout's cache, as the suite's other runs are
    #    (tests/support/nbrecord.py, copied out: nothing of the checkout on the learner's path).
    name = Path(CHAPTER).name
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    shutil.copy(REPO / "tests" / "support" / "nbrecord.py", plugins)
    ran = step("chapter", [python, "-m", "pytest", name, "--nbval-lax", "--nbval-current-env",
                           "-q", "-p", "no:cacheprovider", "-p", "nbrecord"],
               cwd=learner, env=dict(env, MPLBACKEND="Agg", PYTHONPATH=str(plugins),
                                     DMLBOOK_EXECUTED=str(executed.cache_dir())))  # fmt: skip
    assert re.search(r"\d+ passed", ran.stdout) and " failed" not in ran.stdout
    print(", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
