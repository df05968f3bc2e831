"""A learner's ranks are that learner's own (the class-server case: many users on one machine).

While a ``Ranks(2)`` session and a ``run`` are live, a second local user (uid 65534) can neither
read the runs' private folders nor open their rendezvous store (a ``FileStore`` in that folder),
nor reach any socket of theirs from a network address: every listener of the caller, the helper
and the ranks is bound to loopback, none is an AF_UNIX listener (the control channels are socket
pairs, which nobody can address). A control listener on every interface, opened by the test, shows
that the probe does see a socket that is open to it.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dmlbook.launch import run
from dmlbook.ranks import Ranks
from dmlbook.runtime import zygote

NOBODY = 65534
pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root, to act as a second local user (uid 65534)",
)

# Run as uid 65534 with the system's Python (it cannot read the venv under root's home).
PROBE = r"""
import json, os, socket, sys
args, out = json.loads(sys.argv[1]), {}
for folder in args["folders"]:
    try:
        os.listdir(folder)
        out["list " + folder] = "OPEN"
    except PermissionError:
        out["list " + folder] = "denied"
for path in args["files"]:
    for mode in ("rb", "ab"):  # read it; write into it (a FileStore client opens it read-write)
        try:
            open(path, mode).close()
            out[mode + " " + path] = "OPEN"
        except PermissionError:
            out[mode + " " + path] = "denied"
for host, port in args["targets"]:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(3)
        try:
            s.connect((host, port))
            out["connect %s %d" % (host, port)] = "OPEN"
        except OSError:
            out["connect %s %d" % (host, port)] = "denied"
print(json.dumps(out))
"""


def _system_python() -> str:
    found = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if found is None:
        pytest.skip("no system python3 for the second user")
    return found


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
        except OSError:  # gone meanwhile
            pass
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return socket.inet_ntop(socket.AF_INET6, words)


def _tcp_listeners(pids: list[int]) -> list[tuple[str, int]]:
    """(bound address, port) of each listening TCP socket the processes hold."""
    inodes, found = _socket_inodes(pids), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.append((_address(address), int(port, 16)))
    return found


def _unix_listeners(pids: list[int]) -> list[str]:
    inodes = _socket_inodes(pids)
    listening = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[6] in inodes and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON
            listening.append(line)
    return listening


def _network_addresses() -> list[str]:
    """This machine's addresses other than loopback and link-local ones."""
    try:
        text = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    except OSError:
        return []
    addresses = []
    for line in text.splitlines():
        words = line.split()
        if words[1] != "lo" and words[2] in ("inet", "inet6"):
            address = words[3].split("/")[0]
            if not address.startswith("fe80"):
                addresses.append(address)
    return addresses


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


def wait_for_flag(probe_dir: str) -> int:
    """A `run` rank that stays live until the test is done: its pid and private folder first."""
    rank = dist.get_rank()
    Path(probe_dir, f"rank{rank}.json").write_text(
        json.dumps(dict(pid=os.getpid(), folder=sys.argv[1]))  # the rank's argv: folder, rank
    )
    deadline = time.monotonic() + 90
    while not Path(probe_dir, "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return rank


def test_a_second_user_cannot_reach_a_learners_ranks(tmp_path):
    python = _system_python()
    outcome: dict = {}
    launch = threading.Thread(
        target=lambda: outcome.update(result=run(wait_for_flag, 2, str(tmp_path), timeout=120))
    )
    control = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    try:
        with Ranks(2, timeout=60) as session:
            launch.start()
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
            assert len(ranks) == 2, "the run's ranks did not start"
            folders = [session._group.workdir, *{Path(r["folder"]) for r in ranks}]
            pids = [os.getpid(), *[s.pid for s in session.status()], *[r["pid"] for r in ranks]]
            if zygote.enabled():
                pids.append(zygote.helper().process.pid)

            control_port = control.getsockname()[1]
            listeners = [(a, p) for a, p in _tcp_listeners(pids) if p != control_port]
            assert listeners, "gloo's pair listeners should be seen (else this check is empty)"
            assert [a for a, _ in listeners if not _is_loopback(a)] == [], listeners
            assert _unix_listeners(pids) == []  # control channels are unnamed socket pairs
            for folder in folders:
                assert oct(folder.stat().st_mode & 0o777) == "0o700"
                assert (folder / "store").exists() and (folder / "meta.pkl").exists()

            addresses = _network_addresses()
            ports = sorted({port for _, port in listeners})
            targets = [(a, p) for a in addresses for p in ports]
            targets += [(a, control_port) for a in addresses]
            args = dict(
                folders=[str(f) for f in folders],
                files=[str(f / name) for f in folders for name in ("store", "meta.pkl")],
                targets=targets,
            )
            probe = subprocess.run(
                [python, "-c", PROBE, json.dumps(args)],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert probe.returncode == 0, probe.stderr
            seen = json.loads(probe.stdout)
            for address in addresses:  # the probe can tell an open socket from a closed one
                assert seen[f"connect {address} {control_port}"] == "OPEN"
            opened = [
                k for k, v in seen.items() if v == "OPEN" and not k.endswith(f" {control_port}")
            ]
            assert opened == [], f"the second user reached: {opened}"
            assert session.exec("rank") == [0, 1]  # and the session still works
    finally:
        control.close()
        (tmp_path / "done").touch()
        launch.join(timeout=120)
    assert outcome.get("result") == [0, 1]
