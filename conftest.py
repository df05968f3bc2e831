"""The suite's order, and ``--busy N``.

Order: under pytest-xdist (``make test`` runs three workers, a file or a notebook per worker at
a time) the longest runs must start first, or one of them ends the run alone on one worker. So
``slow``-marked tests go first, the longest first (``slow(seconds=N)``: its time alone on a quiet
machine), then the notebooks, then the other test files, each group in its collection order, and
last the ``after_chapters`` tests (the site, built from the chapters' runs: it is handed out when
everything else has been, and waits for the runs still going); the Makefile then turns off
xdist's own reordering (``--no-loadscope-reorder``).

``--busy N``: run any session on a loaded machine, as a learner's laptop with a browser open or
a shared classroom server is. N processes spin on the CPU from the session's start to its end;
the timing claims of the chapters and tests must still hold (or be shown, not asserted).

Each chapter runs once: chapters 4 and 13 run under nbval inside the concurrency test (two runs
at the same moment, both of chapter 13, one then of chapter 4), so while that test is in the
session their own cells are not run again.

A notebook's cell may run for :data:`CELL_TIMEOUT_S` (a test for 120 s, pyproject.toml).

``both_cores``: a test that keeps both cores busy for minutes (the concurrency test, the
browser) takes this fixture, and under pytest-xdist such tests run one at a time: a second one
waits for the first, so neither's limits meet the other's load.

This file sits at the repository root so that it reaches both tests/ and the chapters' nbval
items. The spinners run in a session of their own (a Ctrl-C in the terminal does not reach
them), are killed and reaped when the session ends, and each one exits by itself when pytest's
process goes away (it polls its parent), so that even a killed pytest leaves none behind.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

# The tests' helpers (tests/support/) are imported by bare name; one of them keeps each
# notebook nbval runs with its outputs and plots for the site (tests/support/nbrecord.py).
_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "support")
sys.path.insert(0, _SUPPORT)
pytest_plugins = ["nbrecord"]

# Spins, and every ~10 ms checks that the process that started it is still its parent: when
# pytest dies the spinner is re-parented (to init or a subreaper) and stops.
SPINNER = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


class BusyLoad:
    """N CPU-bound processes, and what they consumed once stopped."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.processes: list[subprocess.Popen] = []
        self.started = self.wall_s = 0.0
        self.cpu_s: float | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def start(self) -> None:
        self.started = time.monotonic()
        for _ in range(self.n):
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPINNER],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

    def stop(self) -> None:
        if not self.processes or self.cpu_s is not None:
            return
        self.wall_s = time.monotonic() - self.started
        cpu = 0.0
        for p in self.processes:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if hasattr(os, "wait4"):
                _, _, usage = os.wait4(p.pid, 0)  # reaps it and says what it used
                p.returncode = -signal.SIGKILL
                cpu += usage.ru_utime + usage.ru_stime
            else:
                p.wait()
        self.cpu_s = cpu if hasattr(os, "wait4") else None

    def summary(self) -> str:
        line = f"loaded run: {self.n} busy process(es) spun for the session ({self.wall_s:.0f} s)"
        if self.cpu_s is not None:
            line += f", using {self.cpu_s:.0f} CPU-seconds ({self.cpu_s / self.wall_s:.2f} cores)"
        return line


# A chapter's cell that measures takes longer than a test: chapter 1's loader cell took 61 s on a
# machine half as fast as the reference one beside the rest of the suite, and over 120 s (the
# suite's limit per test, pyproject.toml) with two busy processes beside it too. Cells get this
# much; a hung cell still ends in minutes.
CELL_TIMEOUT_S = 300


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect have had their say
def pytest_collection_modifyitems(config, items):
    _run_each_chapter_once(config, items)
    for item in items:
        if item.path.suffix == ".ipynb" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CELL_TIMEOUT_S))

    def group(item) -> tuple[int, float]:
        if item.get_closest_marker("after_chapters") is not None:
            return 3, 0  # the site: built from the runs of every chapter, so last of all
        slow = item.get_closest_marker("slow")
        if slow is not None:  # the longest first: slow(seconds=...) is its time alone, quiet
            return 0, -slow.kwargs.get("seconds", 60)
        return (1 if item.path.suffix == ".ipynb" else 2), 0

    items.sort(key=group)  # stable: a notebook's cells keep their order


def _run_each_chapter_once(config, items) -> None:
    """A test marked ``runs_chapters(name, ...)`` runs every cell of those notebooks itself and
    fails on any error, as nbval does: the concurrency test runs chapter 13 (twice, at the same
    moment) and chapter 4, the browser test chapter 2, the hub test chapter 9 (four learners)
    and the wheel test chapter 10. When it is selected and not skipped (a skip must be decided at
    collection, by a ``skipif`` mark, to count here), the notebooks' own cells are deselected:
    each chapter still runs, every cell checked, but not once more on its own. Run alone, a
    notebook runs as always."""
    covered = set()
    for item in items:
        mark = item.get_closest_marker("runs_chapters")
        skipped = any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        if mark is not None and not skipped and item.get_closest_marker("skip") is None:
            covered.update(mark.args)
    if not covered:
        return
    dropped = [i for i in items if i.path.suffix == ".ipynb" and i.path.name in covered]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(dropped)
        items[:] = [i for i in items if i not in gone]


def pytest_addoption(parser):
    parser.addoption(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="load the machine with N CPU-bound processes for the whole session (default 0)",
    )


def pytest_configure(config):
    # Under pytest-xdist the load is the controller's alone: its workers (which have a
    # ``workerinput``) spin none of their own, so ``--busy 2`` means two spinners in all.
    worker = hasattr(config, "workerinput")
    config._busy = BusyLoad(0 if worker else max(0, config.getoption("busy")))


def pytest_sessionstart(session):
    busy: BusyLoad = session.config._busy
    if busy.n:
        busy.start()


def pytest_sessionfinish(session):
    session.config._busy.stop()  # before the terminal summary, which reports what they used


def pytest_unconfigure(config):
    busy = getattr(config, "_busy", None)
    if busy is not None:
        busy.stop()  # in case the session ended without sessionfinish


def pytest_report_header(config):
    if config._busy.n:
        return f"busy: {config._busy.n} CPU-bound process(es) load the machine for this session"


def pytest_terminal_summary(terminalreporter, config):
    busy: BusyLoad = config._busy
    if busy.n:
        terminalreporter.section("load")
        terminalreporter.write_line(busy.summary())


@pytest.fixture(scope="session")
def busy_load(request) -> BusyLoad:
    """The session's :class:`BusyLoad` (``n == 0`` without ``--busy``)."""
    return request.config._busy


@pytest.fixture
def both_cores(tmp_path_factory):
    """Hold the session's both-cores lock for the test (see the module's docstring).

    In one process tests run one at a time anyway, and no lock is taken. Under pytest-xdist the
    lock is a file in the session's own temporary folder, which every worker of this session
    shares and no other run does; the kernel drops a flock when its holder dies."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    path = tmp_path_factory.getbasetemp().parent / "both-cores.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while the other worker runs one
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
