"""Two runs of chapter 13 at the same moment, as on a class's server (a learner's run and a
grader's), both pass and leave nothing behind: no namespace, veth, lab record, process or
temporary file.

Before each lab had a name of its own, the second run's ``netlab.down("ch13")`` deleted the first
run's hosts ("Cannot open network namespace ch13-sw"). Two learners' runs start together, each an
nbval process: both run chapter 13 (its network lab: two hosts, eight torchrun ranks), keeping
pace on the 2-core machine, so that their chapter-13 labs are up at the same time; then one of
them goes on to chapter 4, whose lab (four hosts, two links each) comes up beside the other
run's leftovers, if it left any.

These runs are also the session's nbval runs of chapters 4 and 13 (marker ``runs_chapters``;
conftest.py then leaves the chapters' own cells out): every cell of both chapters is checked, on
a machine busier than a lone run's. Chapter 4 runs once: a second run of it cost 53 of the
suite's ~1,000 CPU-seconds and met nothing that two runs of chapter 13 do not (two labs of one
prefix at once: ``test_netlab.py`` checks that one directly too).
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from processes import left_in_temp

from dmlbook import netlab

REPO = Path(__file__).resolve().parents[2]
CHAPTERS = ["04_bottlenecks_and_solutions.ipynb", "13_putting_it_together.ipynb"]
# What each run runs, in order: both begin with chapter 13, at the same moment.
RUNS = {
    "a": ["13_putting_it_together.ipynb", "04_bottlenecks_and_solutions.ipynb"],
    "b": ["13_putting_it_together.ipynb"],
}


def _root_veths() -> set[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True
    )
    return {line.split(":")[1].strip() for line in out.stdout.splitlines()}


def _processes_with(marker: str) -> list[int]:
    """The pids whose environment holds ``marker``: every process these runs started inherits it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:  # gone meanwhile, or a kernel thread
                pass
    return found


def _watch(runs, records: Path):
    """Wait for the runs; return the labs they recorded and how many of a prefix were up at once."""
    start, seen, most_at_once = time.monotonic(), {}, {}
    while any(proc.poll() is None for _, _, proc in runs):
        now = {}
        for path in records.glob("*.json"):
            try:
                lab = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            seen[lab["name"]] = lab["namespaces"]
            now.setdefault(lab["prefix"], []).append(lab["name"])
        for prefix, names in now.items():
            most_at_once[prefix] = max(most_at_once.get(prefix, 0), len(names))
        assert time.monotonic() - start < 850, "the runs took too long"
        time.sleep(0.2)
    print(f"two runs at once (chapters 13 and 4; 13): {time.monotonic() - start:.0f} s")
    return seen, most_at_once


@pytest.mark.netns
@pytest.mark.slow(seconds=100)
@pytest.mark.runs_chapters(*CHAPTERS)  # these runs are the session's nbval runs of both chapters
@pytest.mark.skipif(netlab.available() is not None, reason=str(netlab.available()))
@pytest.mark.timeout(900)
def test_two_runs_at_once_pass_and_leave_nothing_behind(tmp_path, monkeypatch, both_cores):
    marker = f"DMLBOOK_CONCURRENT_RUN={uuid.uuid4().hex}"
    records = tmp_path / "labs"  # these runs' own records, so we know which labs were theirs
    veths = _root_veths()
    temp = tmp_path / "tmp"  # the runs' temporary folder: what they leave there is checked
    temp.mkdir()
    env = dict(os.environ, MPLBACKEND="Agg", DMLBOOK_NETLAB_RECORDS=str(records), TMPDIR=str(temp))
    env.pop("PYTEST_ADDOPTS", None)
    env[marker.split("=")[0]] = marker.split("=")[1]
    runs = []
    for run, chapters in RUNS.items():
        log = tmp_path / f"{run}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *(str(REPO / "chapters" / c) for c in chapters),
                 "--nbval-lax", "--nbval-current-env", "-q", "-p", "no:cacheprovider",
                 "-o", "timeout=400"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        runs.append((f"run {run}", log, proc))
    try:
        seen, most_at_once = _watch(runs, records)
        deadline = time.monotonic() + 10
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left_running = _processes_with(marker)
    finally:  # whatever happened, nothing may stay: kill what the runs left, remove their labs
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)
        monkeypatch.setenv("DMLBOOK_NETLAB_RECORDS", str(records))
        swept = netlab.sweep()
    print(f"labs up at once: {most_at_once}")

    # each run had its own labs, two chapter-13 labs and one chapter-4 lab ...
    assert sorted(name.split("-")[0] for name in seen) == ["ch13", "ch13", "ch4"], seen
    # ... and nothing of theirs is left: processes, labs, namespaces, veths, records
    assert left_running == [] and swept == []
    left = {ns for namespaces in seen.values() for ns in namespaces} & set(netlab.lab._namespaces())
    assert not left, left
    assert _root_veths() <= veths
    assert list(records.iterdir()) == []
    assert left_in_temp(temp) == []  # no temporary folder or file (but torch's compile cache)
    # ... and both runs passed, every cell
    for name, log, proc in runs:
        text = log.read_text()
        assert proc.returncode == 0 and " passed" in text, f"{name}:\n{text[-5000:]}"
