"""A learner's ranks are that learner's own (the class-server case: many users on one machine).

While a ``Ranks(2)`` session and a ``run`` are live, a second local user (uid 65534) can neither
read the runs' private folders nor open their rendezvous store (a ``FileStore`` in that folder),
nor connect to any listening socket of their ranks, on loopback or any address of the machine,
nor find them in the machine's ``/proc/net/tcp*``, nor enter their network namespace: each run's
ranks have a user and network namespace of their own (:mod:`dmlbook.runtime.private_net`). The
caller, the helper and the process that makes the namespaces listen on nothing; no one listens on
an AF_UNIX address (the control channels are socket pairs, which nobody can address). A control
listener on every interface, opened by the test, shows that the probe does see a socket that is
open to it. Where the kernel refuses user namespaces, the ranks run in the machine's network, as
before, with a warning that says what is exposed.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from dmlbook.launch import Ranks, run
from dmlbook.runtime import private_net, zygote
from dmlbook.runtime.rank_group import MAKE_NETWORK

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root, to act as a second local user (uid 65534)",
)
linux = pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's")

# Run as uid 65534 with the system's Python (it cannot read the venv under root's home).
PROBE = r"""
import ctypes, json, os, socket, sys
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
libc = ctypes.CDLL(None, use_errno=True)
for pid in args["pids"]:  # enter a rank's network namespace, as nsenter would
    try:
        fd = os.open("/proc/%d/ns/net" % pid, os.O_RDONLY)
        entered = libc.setns(fd, 0x40000000) == 0
        os.close(fd)
        out["setns %d" % pid] = "OPEN" if entered else "denied"
    except OSError:
        out["setns %d" % pid] = "denied"
tables = ""
for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # the machine's (this process's network's)
    with open(table) as f:
        tables += f.read()
out["inodes"] = sorted({line.split()[9] for line in tables.splitlines() if ":" in line.split()[1]})
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


def _tcp(pid: int | str = "self") -> list[tuple[str, str, int, str]]:
    """Every TCP socket of ``pid``'s network namespace: (inode, bound address, port, state)."""
    rows = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            rows.append((fields[9], _address(address), int(port, 16), fields[3]))
    return rows


def _tcp_listeners(pids: list[int]) -> list[tuple[str, int]]:
    """(bound address, port) of each listening TCP socket the processes hold, each looked up in
    its own process's network namespace."""
    found = []
    for pid in pids:
        inodes = _socket_inodes([pid])
        found += [(a, p) for i, a, p, state in _tcp(pid) if state == "0A" and i in inodes]
    return found


def _unix_listeners(pids: list[int]) -> list[str]:
    listening = []
    for pid in pids:
        inodes = _socket_inodes([pid])
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
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


def _net(pid: int | str = "self") -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _kernel_refuses() -> str:
    """Why this machine refuses a private network to this user ('' if it does not)."""
    mine, theirs = socket.socketpair()
    with mine:
        subprocess.run(
            [sys.executable, "-c", MAKE_NETWORK, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            timeout=60,
        )
        theirs.close()
        outcome = private_net.receive(mine, 60)
    outcome.close()
    return outcome.refused


def wait_for_flag(probe_dir: str) -> int:
    """A `run` rank that stays live until the test is done: its pid and private folder first."""
    rank = dist.get_rank()
    # written whole, then renamed: the test polls for the name and must never read half a file
    partial = Path(probe_dir, f".rank{rank}.partial")
    partial.write_text(json.dumps(dict(pid=os.getpid(), folder=sys.argv[1])))  # argv: folder, rank
    os.replace(partial, Path(probe_dir, f"rank{rank}.json"))
    deadline = time.monotonic() + 90
    while not Path(probe_dir, "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return rank


@as_root
@linux
def test_a_second_user_cannot_reach_a_learners_ranks(tmp_path):
    python = _system_python()
    if refused := _kernel_refuses():
        pytest.skip(f"this kernel refuses a private network ({refused}); tested below")
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
            session_pids = [s.pid for s in session.status()]
            run_pids = [r["pid"] for r in ranks]
            rank_pids = session_pids + run_pids
            machinery = [os.getpid()]  # the caller, the helper and the namespaces' maker
            if zygote.enabled():
                helper = zygote.helper().process.pid
                machinery += [helper, *[c for c in _children(helper) if c not in rank_pids]]
                assert len(machinery) == 3, machinery

            # each run's ranks share a network of their own, not the machine's nor the other's
            assert len({_net(p) for p in session_pids}) == len({_net(p) for p in run_pids}) == 1
            nets = {_net(), _net(session_pids[0]), _net(run_pids[0])}
            assert len(nets) == 3, nets
            assert {_net(p) for p in machinery} == {_net()}
            # gloo's listeners are there, on the ranks' own loopback; the rest listen on nothing
            listeners = _tcp_listeners(rank_pids)
            assert listeners, "gloo's pair listeners should be seen (else this check is empty)"
            assert [a for a, _ in listeners if not _is_loopback(a)] == [], listeners
            control_port = control.getsockname()[1]
            assert [p for _, p in _tcp_listeners(machinery) if p != control_port] == []
            assert _unix_listeners(rank_pids + machinery) == []  # socket pairs, never addresses
            # the machine's tables do not list any socket of the ranks
            rank_sockets = _socket_inodes(rank_pids)
            assert rank_sockets, "the ranks' sockets should be seen"
            assert rank_sockets.isdisjoint(i for i, *_ in _tcp())
            for folder in folders:
                assert oct(folder.stat().st_mode & 0o777) == "0o700"
                assert (folder / "store").exists() and (folder / "meta.pkl").exists()

            addresses = ["127.0.0.1", "::1", *_network_addresses()]
            ports = sorted({port for _, port in listeners})
            args = dict(
                folders=[str(f) for f in folders],
                files=[str(f / name) for f in folders for name in ("store", "meta.pkl")],
                targets=[(a, p) for a in addresses for p in [*ports, control_port]],
                pids=rank_pids,
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
                if address != "::1":  # (which a machine without IPv6 lacks)
                    assert seen[f"connect {address} {control_port}"] == "OPEN", address
            assert rank_sockets.isdisjoint(seen.pop("inodes")), "the second user found them"
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


def where() -> dict:
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    return dict(net=_net(), uid=os.getuid(), gid=os.getgid(), home=os.path.expanduser("~"))


@linux
def test_a_run_has_a_network_of_its_own_unless_switched_off(monkeypatch):
    if refused := _kernel_refuses():
        pytest.skip(f"this kernel refuses a private network ({refused}); tested below")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        own = run(where, 3)
        monkeypatch.setenv(private_net.SWITCH, "0")
        shared = run(where, 2)
    assert [str(w.message) for w in caught] == []  # on, it is quiet; off, it is asked for
    me = dict(net=_net(), uid=os.getuid(), gid=os.getgid(), home=os.path.expanduser("~"))
    assert len({r["net"] for r in own}) == 1 and own[0]["net"] != me["net"]
    assert [{**r, "net": me["net"]} for r in own] == [me] * 3  # the same user inside
    assert shared == [me] * 2
    monkeypatch.setenv(private_net.SWITCH, "yes")
    with pytest.raises(ValueError, match=private_net.SWITCH):
        run(where, 1)


REFUSED = textwrap.dedent("""
    import json, os, warnings
    import torch.distributed as dist
    from dmlbook.launch import Ranks, run

    def net():
        dist.barrier()
        return os.readlink("/proc/self/ns/net")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launched = run(net, 2)
        with Ranks(2) as session:
            session.exec("import os; dist.barrier()")
            kept = session.exec("os.readlink('/proc/self/ns/net')", filename="cell")
    print(json.dumps(dict(caller=os.readlink("/proc/self/ns/net"), launched=launched,
                          kept=kept, warnings=[str(w.message) for w in caught])))
""")


@linux
@pytest.mark.timeout(300)
def test_where_the_kernel_refuses_ranks_run_as_before_with_a_warning():
    # A user namespace of our own (as any user may make here), inside which user namespaces are
    # turned off: the kernel there refuses what the launcher asks for, as it does where an
    # administrator turned them off (max_user_namespaces 0).
    unshare = shutil.which("unshare")
    if unshare is None or _kernel_refuses():
        pytest.skip("needs unshare(1) and user namespaces, to turn them off in one")
    off = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", "sh", "-c", off, "sh",
         sys.executable, "-c", REFUSED],
        env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["launched"] == [seen["caller"]] * 2 and seen["kept"] == [seen["caller"]] * 2
    assert len(seen["warnings"]) == 2, seen["warnings"]  # one line for each start
    for line in seen["warnings"]:
        assert "\n" not in line and "unshare failed" in line and "max_user_namespaces" in line
        assert "gloo listeners on 127.0.0.1 are reachable by other local users" in line


@linux
@pytest.mark.parametrize("step", ["_write", "_loopback_up"])
def test_a_namespace_refused_half_way_is_a_refusal_not_a_broken_rank(step):
    # AppArmor's restriction (Ubuntu 24.04) lets unshare succeed and refuses what comes next;
    # the process that made the namespace just exits, and the ranks start where they are.
    code = textwrap.dedent(f"""
        import errno, sys
        from dmlbook.runtime import private_net
        def refuse(*args):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        private_net.{step} = refuse
        private_net.make(int(sys.argv[1]))
    """)
    mine, theirs = socket.socketpair()
    with mine:
        maker = subprocess.run(
            [sys.executable, "-c", code, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        theirs.close()
        outcome = private_net.receive(mine, 60)
    assert maker.returncode == 0, maker.stderr
    assert outcome.fds == []
    if "unshare failed" in outcome.refused:
        pytest.skip(f"this kernel refuses a private network ({outcome.refused})")
    what = "map the user" if step == "_write" else "bring lo up"
    assert outcome.refused == f"{what} failed: EPERM"
