"""A real JupyterHub on 127.0.0.1 with the shipped configuration (jupyterhub/), for the `hub` test
and for sizing a class (``python tests/support/hub.py sizing``).

The hub runs from jupyterhub/jupyterhub_config.py with only what a test must change: learners sign
in with a password (JupyterHub's DummyAuthenticator) through the REST API, their servers are
SimpleLocalProcessSpawner processes with homes under the run's own folder, and the ports, database,
cookie secret and TMPDIR are the run's own. Every process the run starts carries a marker in its
environment or descends from the hub, and a sampler records them all, so that `leftovers` can say
whether anything outlived the run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import requests
import websocket

REPO = Path(__file__).resolve().parents[2]
HUB_FILES = REPO / "jupyterhub"  # the hub's configuration, as a class server runs it
PROXY = HUB_FILES / "node_modules" / ".bin" / "configurable-http-proxy"
BIN = Path(sys.executable).parent
MARKER = "DMLBOOK_HUB_RUN"  # environment variable every process of a run carries


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# ------------------------------------------------------------------ processes of the run


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of a process, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


class ProcessSampler(threading.Thread):
    """Every 0.2 s: every process that descends from ``root`` or carries the run's marker.

    A process is recorded by (pid, start time), so a pid reused later is not mistaken for it."""

    CHECKS = 5  # samples (a second) that look for the marker in a process's environment

    def __init__(self, root: int, marker: str) -> None:
        super().__init__(daemon=True)
        self.root, self.marker = root, f"{MARKER}={marker}".encode()
        self.seen: dict[tuple[int, int], str] = {}
        # every port a process of the run listened on: (port, pid) -> (address in hex, command)
        self.listened: dict[tuple[int, int], tuple[str, str]] = {}
        self._stop_event = threading.Event()
        # What a sample need not read again (a sample reads /proc for every process on the
        # machine; on a busy one, 10-20 ms each, five a second). A process's environment changes
        # only when it execs, just after its fork (a child of pytest that the run starts with
        # the marker is caught there now and then): (pid, start time) -> True once it carried
        # the marker, else how many samples have found it without (read again up to CHECKS).
        self._marked: dict[tuple[int, int], bool | int] = {}
        self._sockets: set[int] = set()  # our processes' socket inodes at the last table read
        self._table_read = 0.0  # when the machine's table of listening sockets was last read

    def sample(self) -> None:
        table = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (st := _stat(int(entry.name))):
                table[int(entry.name)] = st
        ours = {self.root} if self.root in table else set()
        for pid in table:
            chain, p = [], pid
            while p in table and p not in ours and p > 1 and len(chain) < 64:
                chain.append(p)
                p = table[p][0]
            if p in ours:
                ours.update(chain)
        for pid, (_, start, _) in table.items():
            if pid not in ours:
                marked = self._marked.get((pid, start), 0)
                if marked is not True and marked < self.CHECKS:
                    marked = True if _has_marker(pid, self.marker) else marked + 1
                    self._marked[(pid, start)] = marked
                if marked is True:
                    ours.add(pid)
        for pid in ours:
            # Read again at every sample, and keep every command line a process has shown: a
            # child caught between fork and exec still shows its parent's (the hub's, for the
            # proxy it starts; on a loaded machine that window is wide), and a process that
            # execs another program (learner_server.py becomes the single-user server) keeps
            # its pid and start time. A zombie's command line is empty.
            key = (pid, table[pid][1])
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
            except OSError:
                cmd = b""
            line = cmd.decode(errors="replace")[:160]
            known = self.seen.get(key)
            if known is None:
                self.seen[key] = line or "?"
            elif line and line not in known.split(" | "):
                self.seen[key] = line if known == "?" else f"{known} | {line}"
        inodes = {pid: _socket_inodes(pid) for pid in ours}
        now = set().union(*inodes.values())
        # The machine's table of listening sockets costs milliseconds to read: read it when a
        # process of ours has a socket it had not at the last read, and at least once a second
        # (a socket seen before it listened is found listening by then).
        if now - self._sockets or time.monotonic() - self._table_read > 1.0:
            self._sockets, self._table_read = now, time.monotonic()
            sockets = listening_sockets()
            for pid, held in inodes.items():
                for inode in held & sockets.keys():
                    address, port = sockets[inode]
                    self.listened[(port, pid)] = (address, self.seen[(pid, table[pid][1])])

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(0.2)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def started_by_run(self, pid: int) -> bool:
        """Is this running pid a process the run started (the same pid and start time)?"""
        st = _stat(pid)
        return bool(st) and (pid, st[1]) in self.seen

    def alive(self) -> dict[int, str]:
        """The recorded processes still running (zombies count as gone)."""
        left = {}
        for (pid, start), cmd in self.seen.items():
            st = _stat(pid)
            if st and st[1] == start and st[2] != "Z":
                left[pid] = cmd
        return left


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket on the machine: inode -> (local address in hex, port)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].rsplit(":", 1)
                found[int(fields[9])] = (address, int(port, 16))
    return found


def port_holders(ports: set[int], marker: str) -> dict[int, list[tuple[int, str, bool]]]:
    """Who listens on these ports now: port -> [(pid, command line, carries the run's marker)]."""
    wanted = {inode: port for inode, (_, port) in listening_sockets().items() if port in ports}
    holders: dict[int, list[tuple[int, str, bool]]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        for inode in _socket_inodes(pid) & wanted.keys():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                cmd = "?"
            marked = _has_marker(pid, f"{MARKER}={marker}".encode())
            holders.setdefault(wanted[inode], []).append((pid, cmd[:160], marked))
    return holders


def listening_ports() -> set[int]:
    return {port for _, port in listening_sockets().values()}


def is_loopback(address_hex: str) -> bool:
    """127.0.0.0/8 or ::1 (or ::ffff:127.x), from /proc/net/tcp's hex form."""
    if len(address_hex) == 8:  # IPv4, little-endian
        return address_hex.endswith("7F")
    return address_hex == "00000000000000000000000001000000" or (
        address_hex.startswith("0000000000000000FFFF0000") and address_hex.endswith("7F")
    )


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


# ------------------------------------------------------------------ the hub


@dataclass
class Hub:
    """A running hub; ``url`` is the proxy's (what learners reach), ``admin`` an admin token."""

    folder: Path
    url: str
    ports: list[int]
    admin: str
    marker: str
    process: subprocess.Popen
    sampler: ProcessSampler
    log: Path
    tokens: dict[str, str] = field(default_factory=dict)

    # -- REST
    def api(self, method: str, path: str, token: str | None = None, **kw) -> requests.Response:
        headers = {"Authorization": f"token {token or self.admin}"}
        return requests.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kw)

    def sign_in(self, name: str, password: str) -> str:
        """A learner signs in through the REST API: a token from their name and password."""
        r = requests.post(
            f"{self.url}/hub/api/users/{name}/tokens",
            json={"auth": {"username": name, "password": password}, "note": "hub test"},
            timeout=60,
        )
        r.raise_for_status()
        self.tokens[name] = r.json()["token"]
        return self.tokens[name]

    def start_servers(self, names: list[str], timeout: float = 180) -> None:
        for name in names:
            r = self.api("POST", f"/hub/api/users/{name}/server", self.tokens[name])
            assert r.status_code in (201, 202), f"{name}'s server: {r.status_code} {r.text}"
        deadline = time.monotonic() + timeout
        waiting = set(names)
        while waiting and time.monotonic() < deadline:
            for name in sorted(waiting):
                model = self.api("GET", f"/hub/api/users/{name}", self.tokens[name]).json()
                server = model.get("servers", {}).get("")
                if server and server.get("ready"):
                    waiting.discard(name)
            time.sleep(0.5)
            assert self.process.poll() is None, f"the hub exited:\n{self.log_tail()}"
        assert not waiting, f"servers not ready in {timeout} s: {waiting}\n{self.log_tail()}"

    def server(self, name: str, method: str, path: str, **kw) -> requests.Response:
        """The learner's own Jupyter server, reached through the hub's proxy with their token."""
        return self.api(method, f"/user/{name}/api/{path}", self.tokens[name], **kw)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    # -- teardown
    def shutdown(self, timeout: float = 60) -> None:
        """The hub's own shutdown (servers, then proxy, then hub); a kill only if that fails."""
        if self.process.poll() is None:
            try:
                self.api("POST", "/hub/api/shutdown", json={"servers": True, "proxy": True})
            except requests.RequestException:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.sampler.sample()
        self.sampler.stop()

    def kill_leftovers(self) -> dict[int, str]:
        """Kill whatever of the run still runs (after a failure); return what was found."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        left = self.sampler.alive()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


TEST_CONFIG = """\
import json
load_subconfig({shipped!r})
s = json.loads({settings!r})
c.JupyterHub.bind_url = s["bind_url"]
c.JupyterHub.hub_bind_url = s["hub_bind_url"]
c.ConfigurableHTTPProxy.api_url = s["proxy_api_url"]
c.ConfigurableHTTPProxy.pid_file = s["proxy_pid_file"]
c.JupyterHub.db_url = s["db_url"]
c.JupyterHub.cookie_secret_file = s["cookie_secret_file"]
# test-only sign-in: a shared password, and the class roster
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = s["password"]
c.Authenticator.allowed_users = set(s["learners"])
# servers as the hub's own user, each learner a home under the run's folder
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = s["homes"] + "/{{username}}"
c.Spawner.environment = dict(c.Spawner.environment, **s["environment"])
c.Spawner.args = s["server_args"]
c.JupyterHub.services.append({{"name": "test-admin", "api_token": s["admin_token"]}})
c.JupyterHub.load_roles.append({{"name": "admin", "services": ["test-admin"]}})
"""


def start_hub(folder: Path, learners: list[str], password: str, timeout: float = 90) -> Hub:
    """Start the hub in ``folder`` (its database, secrets, log, homes and TMPDIR all go there)."""
    for sub in ("hub", "homes", "tmp"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    admin = secrets.token_hex(16)
    ports = free_ports(3)
    env_for_all = {
        MARKER: marker,
        "TMPDIR": str(folder / "tmp"),
        "DMLBOOK_EXCHANGE": str(folder / "exchange"),
    }
    settings = {
        "bind_url": f"http://127.0.0.1:{ports[0]}",
        "hub_bind_url": f"http://127.0.0.1:{ports[1]}",
        "proxy_api_url": f"http://127.0.0.1:{ports[2]}",
        "proxy_pid_file": str(folder / "hub" / "proxy.pid"),
        "db_url": f"sqlite:///{folder / 'hub' / 'jupyterhub.sqlite'}",
        "cookie_secret_file": str(folder / "hub" / "cookie_secret"),
        "password": password,
        "learners": learners,
        "homes": str(folder / "homes"),
        "environment": env_for_all,
        # Jupyter Server refuses to run as root without this (CI runs as root)
        "server_args": ["--allow-root"] if os.geteuid() == 0 else [],
        "admin_token": admin,
    }
    config = folder / "hub" / "test_config.py"
    config.write_text(
        TEST_CONFIG.format(
            shipped=str(HUB_FILES / "jupyterhub_config.py"), settings=json.dumps(settings)
        )
    )
    env = dict(os.environ, **env_for_all)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    log = folder / "hub" / "hub.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(BIN / "jupyterhub"), "-f", str(config)],
            cwd=folder / "hub",
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sampler = ProcessSampler(process.pid, marker)
    sampler.start()
    hub = Hub(folder, settings["bind_url"], ports, admin, marker, process, sampler, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sampler.stop()
            raise RuntimeError(f"the hub exited with {process.returncode}:\n{hub.log_tail()}")
        try:
            if requests.get(f"{hub.url}/hub/api/", timeout=5).status_code == 200:
                return hub
        except requests.RequestException:
            pass
        time.sleep(0.3)
    hub.shutdown(5)
    hub.kill_leftovers()
    raise RuntimeError(f"the hub did not answer in {timeout} s:\n{hub.log_tail()}")


# ------------------------------------------------------------------ a chapter in a learner's kernel


@dataclass
class ChapterRun:
    learner: str
    seconds: float = 0.0
    cells: list[tuple[int, float]] = field(default_factory=list)  # (cell index, seconds) run
    code_cells: int = 0  # the notebook's code cells that have code
    errors: list[str] = field(default_factory=list)
    notebook: nbformat.NotebookNode | None = None  # the notebook with every cell's outputs
    # kernels that never answered: why, for each (the run then started another, once)
    kernel_retries: list[str] = field(default_factory=list)


def _message(session: str, msg_type: str, content: dict) -> dict:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": session,
            "username": "hub-test",
            "version": "5.3",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "parent_header": {},
        "metadata": {},
        "content": content,
        "channel": "shell",
        "buffers": [],
    }


def start_kernel(hub: Hub, name: str, path: str, timeout: float):
    """A kernel for the notebook at ``path`` through the learner's Sessions API, and its
    websocket, once the kernel has answered a ``kernel_info_request``: (websocket, session)."""
    r = hub.server(
        name,
        "POST",
        "sessions",
        json={"path": path, "name": Path(path).name, "type": "notebook",
              "kernel": {"name": "python3"}},
    )  # fmt: skip
    r.raise_for_status()
    model, session = r.json(), uuid.uuid4().hex
    ws_url = hub.url.replace("http", "ws", 1)
    try:
        ws = websocket.create_connection(
            f"{ws_url}/user/{name}/api/kernels/{model['kernel']['id']}/channels"
            f"?session_id={session}",
            header=[f"Authorization: token {hub.tokens[name]}"],
            timeout=timeout,
        )
        request = _message(session, "kernel_info_request", {})
        ws.send(json.dumps(request))
        while True:
            frame = ws.recv()
            if isinstance(frame, bytes):
                continue
            msg = json.loads(frame)
            if msg.get("parent_header", {}).get("msg_id") == request["header"]["msg_id"]:
                if msg["msg_type"] == "kernel_info_reply":
                    return ws, session
    except (websocket.WebSocketException, OSError):
        hub.server(name, "DELETE", f"sessions/{model['id']}")  # its kernel, if any is left
        raise


def run_notebook(hub: Hub, name: str, path: str, cell_timeout: float = 300) -> ChapterRun:
    """Run every code cell of the notebook at ``path`` (in the learner's home) in a kernel of the
    learner's own server, through the hub: the Contents API reads it, the Sessions API starts the
    kernel in the notebook's folder, the kernel's websocket runs the cells, as JupyterLab does."""
    result = ChapterRun(name)
    r = hub.server(name, "GET", f"contents/{path}")
    r.raise_for_status()
    notebook = nbformat.from_dict(r.json()["content"])
    result.code_cells = sum(
        c.cell_type == "code" and bool(c.source.strip()) for c in notebook.cells
    )
    try:
        ws, session = start_kernel(hub, name, path, cell_timeout)
    except (websocket.WebSocketException, OSError) as e:
        # A kernel that never answers: Jupyter hands a new kernel free TCP ports and the kernel
        # binds them later, so on a busy machine another process can take one first ("Address
        # already in use", and the server's restarts can meet the same port). A learner opens
        # the notebook again: so does the run, once.
        result.kernel_retries.append(f"{type(e).__name__}: {e}")
        ws, session = start_kernel(hub, name, path, cell_timeout)
    started = time.monotonic()
    try:
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            request = _message(
                session,
                "execute_request",
                {"code": cell.source, "silent": False, "store_history": True,
                 "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
            )  # fmt: skip
            t0 = time.monotonic()
            ws.send(json.dumps(request))
            cell.outputs, reply, idle = [], None, False
            while reply is None or not idle:  # the reply, and every output (until "idle")
                frame = ws.recv()
                if isinstance(frame, bytes):  # a message with binary buffers: a widget's
                    continue
                msg = json.loads(frame)
                if msg.get("parent_header", {}).get("msg_id") != request["header"]["msg_id"]:
                    continue
                kind = msg["msg_type"]
                if kind == "execute_reply":
                    reply = msg
                elif kind == "status":
                    idle = msg["content"]["execution_state"] == "idle"
                elif kind in ("stream", "display_data", "execute_result", "error"):
                    cell.outputs.append(nbformat.v4.output_from_msg(msg))
            result.cells.append((index, time.monotonic() - t0))
            content = reply["content"]
            if content["status"] != "ok":
                # the traceback's last lines, as nbval would show them (the kernel colours them)
                trace = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(content.get("traceback", [])))
                result.errors.append(
                    f"cell {index}: {content.get('ename')}: {content.get('evalue')}\n"
                    + "\n".join(trace.splitlines()[-12:])
                )
                break
    finally:
        result.seconds = time.monotonic() - started
        ws.close()
    result.notebook = notebook
    return result


def run_at_once(hub: Hub, names: list[str], path: str) -> list[ChapterRun]:
    """Every learner runs the same notebook at the same moment, each in their own kernel."""
    runs: dict[str, ChapterRun] = {}

    def one(name: str) -> None:
        try:
            runs[name] = run_notebook(hub, name, path)
        except Exception as e:  # reported as the learner's error, not lost in a thread
            runs[name] = ChapterRun(name, errors=[f"{type(e).__name__}: {e}"])

    threads = [threading.Thread(target=one, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [runs[n] for n in names]


def put_notebook(hub: Hub, name: str, folder: str, source: Path) -> str:
    """Write a notebook into the learner's home through their server's Contents API."""
    hub.server(name, "PUT", f"contents/{folder}", json={"type": "directory"})
    path = f"{folder}/{source.name}"
    body = {"type": "notebook", "format": "json", "content": json.loads(source.read_text())}
    hub.server(name, "PUT", f"contents/{path}", json=body).raise_for_status()
    return path


# -------------------------------------------------------------- sizing: python tests/support/hub.py


def sizing(chapters: list[str], counts: list[int], repeats: int) -> None:
    """Chapter wall times with 1, 2, 4 ... learners running the same chapter at once."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="dmlbook-hub-sizing-"))
    names = [f"learner{i}" for i in range(1, max(counts) + 1)]
    password = secrets.token_hex(8)
    hub = start_hub(folder, names, password)
    try:
        for n in names:
            hub.sign_in(n, password)
        hub.start_servers(names)
        for chapter in chapters:
            source = REPO / "chapters" / f"{chapter}.ipynb"
            path = {n: put_notebook(hub, n, "sizing", source) for n in names}[names[0]]
            for repeat in range(repeats):
                for count in counts:
                    runs = run_at_once(hub, names[:count], path)
                    bad = [e for r in runs for e in r.errors]
                    times = sorted(r.seconds for r in runs)
                    longest = max(s for r in runs for _, s in r.cells)
                    print(
                        f"{chapter} round {repeat + 1}: {count} learner(s) at once: "
                        f"{' '.join(f'{t:.1f}' for t in times)} s (longest cell {longest:.1f} s)"
                        + (f" ERRORS {bad}" if bad else ""),
                        flush=True,
                    )
                    for n in names[:count]:  # a fresh kernel for the next round
                        for s in hub.server(n, "GET", "sessions").json():
                            hub.server(n, "DELETE", f"sessions/{s['id']}")
    finally:
        hub.shutdown()
        left = hub.kill_leftovers()
        print(f"left behind: {left or 'nothing'}")
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=sizing.__doc__)
    parser.add_argument("command", choices=["sizing"])
    parser.add_argument("--chapters", nargs="+", default=["09_hybrid_parallelism"])
    parser.add_argument("--learners", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sizing(args.chapters, args.learners, args.repeats)
