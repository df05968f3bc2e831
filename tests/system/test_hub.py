"""A class on one server, with the real tools: JupyterHub from jupyterhub/jupyterhub_config.py, four
learners at once, and an nbgrader round over the exchange with jupyterhub/nbgrader_config.py.

One test (marker ``hub``), in this order, because each step needs the one before:
1. the hub starts on 127.0.0.1 (its proxy from ``make jupyterhub-proxy``); four learners sign in
   through the REST API (a wrong password is refused); their servers start, and the book is in
   each learner's home (``learner_server.py`` ran ``python -m dmlbook.classroom copy-book``);
2. the four learners run chapter 9 at the same moment, each in a kernel of their own server,
   through the hub's proxy, and every cell runs without error (a kernel that never answers, the
   free-port race of Jupyter's kernels on a busy machine, is started again once, and shown);
   these four runs are the session's nbval runs of chapter 9 (marker ``runs_chapters``);
3. the instructor makes chapter 9 an assignment with nbgrader's own commands and releases it; the
   learners fetch it and submit from their own servers, as JupyterLab's Assignments tab does
   (nbgrader's extension in each server, through the hub's proxy): two blank, one solved, one
   with a planted wrong answer; the instructor collects and autogrades with nbgrader's commands,
   and the gradebook holds 0, 0, full and partial marks;
4. the hub shuts down, and no process of the run (hub, proxy, servers, kernels, rank helpers,
   ranks), no port it listened on and nothing in its TMPDIR is left.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import nbformat
import pytest
import requests

from dmlbook.book import executed

pytest.importorskip("websocket", reason="the hub test needs websocket-client (the dev extra)")
from hub import (  # noqa: E402
    BIN,
    HUB_FILES,
    PROXY,
    REPO,
    is_loopback,
    port_holders,
    run_at_once,
    start_hub,
)
from processes import left_in_temp  # noqa: E402

CHAPTER = "09_hybrid_parallelism"

# Skipped at collection, not inside the test: where it runs, the four learners' runs are the
# session's nbval runs of chapter 9 (every cell, none may raise), and conftest.py leaves the
# chapter's own cells out only for a test that is not skipped.
pytestmark = [
    pytest.mark.hub,
    pytest.mark.slow(seconds=77),
    pytest.mark.skipif(
        shutil.which("node") is None,
        reason="needs node for JupyterHub's proxy (configurable-http-proxy); install nodejs",
    ),
    pytest.mark.runs_chapters(f"{CHAPTER}.ipynb"),
]
ASSIGNMENT = "ch09"
LEARNERS = ["blank1", "blank2", "solved", "wrong"]


# A kernel that could not start: Jupyter's launcher picks free TCP ports, frees them and hands them
# to the kernel, and another process on a busy machine can bind one in between (jupyter_client#276);
# or the kernel took longer than nbclient's 60 s to answer.
KERNEL_START_FAILED = re.compile(
    r"Kernel died before replying to kernel_info|Kernel didn't respond in \d+ seconds"
    r"|Address already in use"
)


def nbgrader_failed(args, done: subprocess.CompletedProcess) -> str:
    """nbgrader's errors first (its log's ERROR lines and the tracebacks after them), then its
    output's tail: a long log must not hide why it failed."""
    log = done.stdout + done.stderr
    errors = [line for line in log.splitlines() if "ERROR" in line or line.startswith("    ")]
    head = f"nbgrader {' '.join(args)} failed:\n"
    return head + "\n".join(errors)[:8000] + f"\n...\n{log[-3000:]}"


def nbgrader(*args: str, cwd, env: dict) -> str:
    done = subprocess.run(
        [str(BIN / "nbgrader"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, nbgrader_failed(args, done)
    return done.stdout + done.stderr


def autograde(assignment: str, cwd, env: dict) -> str:
    """``nbgrader autograde``, run again once if a notebook's kernel could not start, as an
    instructor would: nbgrader removes a failed submission's output, so the second run grades
    only what the first could not. Any other failure fails the test."""
    try:
        return nbgrader("autograde", assignment, cwd=cwd, env=env)
    except AssertionError as first:
        if not KERNEL_START_FAILED.search(str(first)):
            raise
        print(f"\nautograde ran again after a kernel failed to start:\n{str(first)[:2000]}")
        return nbgrader("autograde", assignment, cwd=cwd, env=env)


def exercises_of(chapter):
    """The chapter as an assignment of its exercises: its first code cell (the imports) and its
    exercise section, nbgrader metadata and hidden tests as they are. The exercises need nothing
    else (tests/unit/classroom/test_classroom.py checks it), and autograding four copies of this
    takes seconds where four whole chapters take minutes; step 2 has run the whole chapter."""
    notebook = nbformat.read(chapter, 4)
    first_code = next(c for c in notebook.cells if c.cell_type == "code")
    first_answer = next(
        i for i, c in enumerate(notebook.cells) if c.metadata.get("nbgrader", {}).get("solution")
    )
    start = first_answer
    while start > 0 and notebook.cells[start - 1].cell_type == "markdown":
        start -= 1  # the exercise's statement
    notebook.cells = [first_code, *notebook.cells[start:]]
    return notebook


def answer(notebook, solution, plant_wrong: bool):
    """The learner's answers: each stub replaced by the solution's cell; with ``plant_wrong`` the
    first exercise's function returns None instead."""
    solutions = {
        c.metadata["nbgrader"]["grade_id"]: c.source
        for c in solution.cells
        if c.metadata.get("nbgrader", {}).get("solution")
    }
    first = True
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id not in solutions:
            continue
        assert "raise NotImplementedError" in cell.source, "the released copy has no stub"
        if plant_wrong and first:
            cell.source = re.sub(
                r"^( *)# YOUR CODE HERE\n *raise NotImplementedError\(.*\)$",
                r"\1return None  # planted: a wrong answer",
                cell.source,
                flags=re.MULTILINE,
            )
            assert "planted" in cell.source
        else:
            cell.source = solutions[grade_id]
        first = False


@pytest.mark.timeout(1500)  # 98 s here at load average 4-8, 4-9 minutes at 15-25
def test_a_class_of_four_on_one_hub_then_an_nbgrader_round(tmp_path):
    assert PROXY.exists(), "JupyterHub's proxy is not installed: run `make jupyterhub-proxy`"
    started = time.monotonic()
    password = secrets.token_hex(8)
    hub = start_hub(tmp_path, LEARNERS, password)
    timings = {"hub up": time.monotonic() - started}
    try:
        # -- 1. sign in through the REST API; a wrong password gets no token
        wrong = {"auth": {"username": LEARNERS[0], "password": password + "x"}}
        r = requests.post(f"{hub.url}/hub/api/users/{LEARNERS[0]}/tokens", json=wrong, timeout=60)
        assert r.status_code == 403
        for name in LEARNERS:
            hub.sign_in(name, password)
        hub.start_servers(LEARNERS)
        routes = hub.api("GET", "/hub/api/proxy").json()
        server_ports = {
            int(r["target"].rsplit(":", 1)[1]) for k, r in routes.items() if "/user/" in k
        }
        assert len(server_ports) == len(LEARNERS), routes
        timings["servers up"] = time.monotonic() - started
        # one learner's token opens no other learner's server
        r = hub.api("GET", f"/user/{LEARNERS[1]}/api/contents", hub.tokens[LEARNERS[0]])
        assert r.status_code == 403, f"learner 0 read learner 1's files: {r.status_code}"
        path = f"book/{CHAPTER}.ipynb"
        for name in LEARNERS:  # learner_server.py copied the book at the server's start
            assert hub.server(name, "GET", f"contents/{path}").ok, (
                f"the book was not copied into {name}'s home:\n{hub.log_tail()}"
            )

        # -- 2. four learners run the same chapter at the same moment
        runs = run_at_once(hub, LEARNERS, path)
        timings["chapter at once"] = time.monotonic() - started - timings["servers up"]
        for run in runs:
            assert not run.errors, f"{run.learner}: {run.errors}"
            assert run.code_cells > 10 and len(run.cells) == run.code_cells, run
        # the first learner's run, outputs and plots, is the session's run kept for the site
        for cell in runs[0].notebook.cells:
            if cell.cell_type == "code":
                cell.outputs = executed.clean(cell.get("outputs", []))
        executed.store(REPO / "chapters" / f"{CHAPTER}.ipynb", runs[0].notebook)

        phases = {"after the chapter ran": sorted(os.listdir(tmp_path / "tmp"))}

        # -- 3. an nbgrader round over the exchange
        t0 = time.monotonic()
        course = tmp_path / "course"
        (course / "source" / ASSIGNMENT).mkdir(parents=True)
        nbformat.write(
            exercises_of(REPO / "chapters" / f"{CHAPTER}.ipynb"),
            course / "source" / ASSIGNMENT / f"{CHAPTER}.ipynb",
        )
        env = dict(
            os.environ,
            JUPYTER_CONFIG_PATH=str(HUB_FILES),
            DMLBOOK_EXCHANGE=str(tmp_path / "exchange"),
            TMPDIR=str(tmp_path / "tmp"),
            MPLBACKEND="Agg",
            DMLBOOK_HUB_RUN=hub.marker,
            PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        )
        instructor = dict(env, HOME=str(tmp_path / "homes" / "instructor"))
        (tmp_path / "homes" / "instructor").mkdir()  # else IPython makes its folder in TMPDIR
        nbgrader("generate_assignment", ASSIGNMENT, cwd=course, env=instructor)
        nbgrader("release_assignment", ASSIGNMENT, cwd=course, env=instructor)
        solution = nbformat.read(course / "source" / ASSIGNMENT / f"{CHAPTER}.ipynb", 4)

        def learner_round(name: str) -> None:
            """Fetch and submit as JupyterLab's Assignments tab does: a POST to nbgrader's
            extension in the learner's own server, through the hub's proxy."""
            home = tmp_path / "homes" / name
            # nbgrader names the learner by the Unix account; here all share one, so each
            # learner's folder says who they are (what `nbgrader submit --student` would)
            (home / "nbgrader_config.py").write_text(f"c.CourseDirectory.student_id = {name!r}\n")
            form = {"course_id": "dmlbook", "assignment_id": ASSIGNMENT}
            fetched = home / ASSIGNMENT / f"{CHAPTER}.ipynb"
            r = hub.api("POST", f"/user/{name}/assignments/fetch", hub.tokens[name], data=form)
            assert r.ok and fetched.exists(), f"{name}'s fetch: {r.status_code} {r.text[:2000]}"
            if name in ("solved", "wrong"):
                notebook = nbformat.read(fetched, 4)
                answer(notebook, solution, plant_wrong=name == "wrong")
                nbformat.write(notebook, fetched)
            r = hub.api("POST", f"/user/{name}/assignments/submit", hub.tokens[name], data=form)
            listed = r.json() if r.ok else {}  # the tab's list: released, then submitted
            assert listed.get("success") and any(
                a["assignment_id"] == ASSIGNMENT and a["status"] == "submitted"
                for a in listed["value"]
            ), f"{name}'s submit: {r.status_code} {r.text[:4000]}"

        # the four learners fetch and submit at the same time, as a class does before a deadline
        with ThreadPoolExecutor(len(LEARNERS)) as pool:
            list(pool.map(learner_round, LEARNERS))
        nbgrader("collect", ASSIGNMENT, cwd=course, env=instructor)
        assert sorted(p.name for p in (course / "submitted").iterdir()) == sorted(LEARNERS)
        autograde(ASSIGNMENT, cwd=course, env=instructor)
        from nbgrader.api import Gradebook

        with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="dmlbook") as gradebook:
            scores = {n: gradebook.find_submission(ASSIGNMENT, n).score for n in LEARNERS}
            full = gradebook.find_assignment(ASSIGNMENT).max_score
        timings["nbgrader round"] = time.monotonic() - t0
        phases["after the nbgrader round"] = sorted(os.listdir(tmp_path / "tmp"))
        exercises = sum(bool(c.metadata.get("nbgrader", {}).get("grade")) for c in solution.cells)
        assert full == exercises >= 2
        assert scores == {"blank1": 0, "blank2": 0, "solved": full, "wrong": full - 1}, scores
        print(f"\nnbgrader scores {scores} of {full}; timings (s): "
              + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
              + "; chapter per learner: "
              + ", ".join(f"{r.learner} {r.seconds:.0f}" for r in runs))  # fmt: skip
        retried = {r.learner: r.kernel_retries for r in runs if r.kernel_retries}
        if retried:  # shown: a kernel that never answered was started again (tests/support/hub.py)
            print(f"kernels started again: {retried}")

        # -- 4. shut down: nothing of the run is left
        hub.shutdown()
        assert hub.process.returncode == 0, hub.log_tail()
        left = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (left := hub.sampler.alive()):
            time.sleep(0.2)
        assert not left, f"processes left after the hub's shutdown: {left}"
        kinds = " ".join(hub.sampler.seen.values())
        # (learner_server.py is not among them: it copies the book, which step 1 checks, and
        # becomes jupyterhub.singleuser in the same process, often before a 0.2 s sample sees it)
        for kind in (
            "configurable-http-proxy",
            "jupyterhub.singleuser",
            "ipykernel",
            "dmlbook.runtime.zygote",
        ):
            assert kind in kinds, f"the sampler never saw a {kind} process: {kinds[:2000]}"
        # The hub's, the proxy's and the servers' ports were on 127.0.0.1 only, and every port a
        # process of the run listened on is closed (the ranks' own are on a loopback of their own)
        listened = hub.sampler.listened
        known = set(hub.ports) | server_ports  # the proxy's two, the hub's, each server's
        seen_on = {port: address for (port, _), (address, _) in listened.items() if port in known}
        assert seen_on.keys() == known, f"ports never seen listening: {known - seen_on.keys()}"
        wide = {port: address for port, address in seen_on.items() if not is_loopback(address)}
        assert not wide, f"listening beyond 127.0.0.1: {wide}"
        beyond = {port: cmd for (port, _), (a, cmd) in listened.items() if not is_loopback(a)}
        print(f"listened beyond 127.0.0.1: {beyond}")
        # A port the run let go may be taken at once by another job on a busy machine: only a
        # holder of this run (its marker, or a process the run started) counts as left behind.
        holders = port_holders({port for port, _ in listened} | set(hub.ports), hub.marker)
        ours = {
            port: who
            for port, who in holders.items()
            if any(marked or hub.sampler.started_by_run(pid) for pid, _, marked in who)
        }
        assert not ours, f"ports still held by the run's processes: {ours}"
        if holders:
            print(f"ports of the run now held by other jobs: {holders}")
        leftovers = left_in_temp(tmp_path / "tmp")  # torch's compile cache may stay
        assert not leftovers, (
            f"the run's TMPDIR still holds "
            f"{[(name, os.listdir(tmp_path / 'tmp' / name)) for name in leftovers]}; "
            f"it held {phases}"
        )
    finally:
        hub.shutdown(30)
        hub.kill_leftovers()
