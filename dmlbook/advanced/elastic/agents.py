"""torchrun's elastic agents, started and watched from Python, and what their workers did."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmlbook.datasets import EXAMPLES_DIR

# --------------------------------------------------------------------------- launching agents

SCRIPT = str(EXAMPLES_DIR / "elastic_train.py")
# torchrun's environment: a fresh store per restarted group (see training._join_torchrun_group)
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
# quick rendezvous on one machine: a dead node is noticed after 1 s x 2 missed heartbeats, and
# once min_nodes are there the rendezvous waits 3 s more for latecomers (defaults: 5 s x 3, 30 s)
QUICK_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=3"


def torchrun_command(
    run_dir: str | os.PathLike,
    *script_args: str,
    nproc_per_node: int = 1,
    nnodes: str = "1:2",
    max_restarts: int = 1,
    endpoint: str | None = None,
    is_host: bool | None = None,
    rdzv_conf: str = QUICK_RDZV,
    job: str = "elastic",
    local_addr: str | None = None,
) -> list[str]:
    """The torchrun command line of one node (agent) running examples/elastic_train.py.

    ``endpoint=None`` is ``--standalone`` (one node); otherwise ``HOST:PORT`` of the c10d
    rendezvous, which the node with ``is_host`` serves (on real machines torchrun tells that from
    the host name; on one machine we must say which agent it is). ``rdzv_conf=""`` and no
    ``is_host`` leave out ``--rdzv-conf``: torchrun's defaults, what real machines need.
    """
    cmd = ["torchrun", "--nproc-per-node", str(nproc_per_node),
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]  # fmt: skip
    if endpoint is None:
        cmd += ["--standalone"]
    else:
        host = [] if is_host is None else [f"is_host={int(is_host)}"]
        conf = ",".join([c for c in rdzv_conf.split(",") if c] + host)
        cmd += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", job]  # fmt: skip
        cmd += ["--rdzv-conf", conf] if conf else []  # none given: torchrun's defaults
        cmd += [] if local_addr is None else ["--local-addr", local_addr]
    cmd += ["--log-dir", str(Path(run_dir) / "torchrun-logs")]  # else a torchelastic_* in /tmp
    return [*cmd, SCRIPT, str(run_dir), *script_args]


@dataclass
class AgentRun:
    """What :func:`run_agents` saw: each agent's exit code and output, and every pid involved."""

    returncodes: list[int | None]
    logs: list[str]
    seconds: float
    agent_pids: list[int]
    worker_pids: list[int]
    timed_out: bool = False  # still running at the timeout: everything was killed

    @property
    def ok(self) -> bool:
        return any(rc == 0 for rc in self.returncodes)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not): the notebook's no-orphan check."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def run_agents(
    commands: Sequence[Sequence[str]],
    run_dir: str | os.PathLike,
    *,
    timeout: float = 120.0,
    popen: Callable[..., Any] | None = None,
    during: Callable[[], None] | None = None,
) -> AgentRun:
    """Start one torchrun agent per command (``torchrun`` runs as ``python -m
    torch.distributed.run``), wait for all, and leave no process behind, even on error.

    ``popen(i, cmd, **kwargs)`` starts agent ``i`` elsewhere (the network lab's hosts);
    ``during()`` runs while the agents do (to kill a host, say).
    """
    import subprocess
    import sys

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **AGENT_ENV)
    procs = []
    began = time.perf_counter()
    try:
        for i, cmd in enumerate(commands):
            argv = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
            kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)  # fmt: skip
            procs.append(popen(i, argv, **kwargs) if popen else subprocess.Popen(argv, **kwargs))
        logs = [""] * len(procs)

        def drain(i: int) -> None:
            logs[i] = procs[i].stdout.read()

        readers = [
            threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))
        ]
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout
        if during is not None:
            during()
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        for p in procs:  # SIGTERM first: an agent then stops its own workers
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in _worker_pids(run_dir):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    for r in readers:
        r.join(timeout=5)
    return AgentRun([p.returncode for p in procs], logs, time.perf_counter() - began,
                    [p.pid for p in procs], _worker_pids(run_dir), timed_out)  # fmt: skip


def _worker_pids(run_dir: Path) -> list[int]:
    path = run_dir / "pids.txt"
    return [int(v) for v in path.read_text().split()] if path.exists() else []


def samples_by_generation(run_dir: str | os.PathLike) -> dict[int, dict[int, dict]]:
    """Every step each generation ran, lost ones included, with the samples each rank took:
    ``{generation: {step: {"epoch", "ranks": {rank: [indices]}}}}``."""
    found: dict[int, dict[int, dict]] = {}
    for path in sorted(Path(run_dir).glob("samples-g*-r*.jsonl")):
        generation, rank = (int(v) for v in path.stem[len("samples-g") :].split("-r"))
        for line in path.read_text().splitlines():
            step, epoch, idx = json.loads(line)
            entry = found.setdefault(generation, {}).setdefault(step, {"epoch": epoch, "ranks": {}})
            entry["ranks"][rank] = idx
    return {g: dict(sorted(steps.items())) for g, steps in sorted(found.items())}


def samples_trained(run_dir: str | os.PathLike) -> dict[int, dict]:
    """For every global step, the samples that *count*: those of the last generation that ran it
    (a step re-run after a failure replaces the lost one). ``{step: {"epoch", "generation",
    "ranks": {rank: [indices]}}}``."""
    steps: dict[int, dict] = {}
    for generation, ran in samples_by_generation(run_dir).items():  # later generations win
        for step, entry in ran.items():
            steps[step] = {"epoch": entry["epoch"], "generation": generation,
                           "ranks": dict(entry["ranks"])}  # fmt: skip
    return dict(sorted(steps.items()))
