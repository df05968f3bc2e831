"""The network lab's hosts: make them, run commands and torchrun jobs on them, remove them.

:class:`Lab` is N hosts (network namespaces) on one switch namespace, each link shaped with tc;
``with Lab(...) as lab:`` always tears them down, and so does the end of the process that made
them. Each lab's names are its own (``<prefix>-<8 hex>-h0``): runs at the same moment never share
one. A lab whose owner died (a killed kernel) is removed by the next lab that starts, or by
:func:`down`; a live run's lab never is (see :mod:`~dmlbook.netlab.claims`). :func:`status`
shows the labs. Chapter 4 shapes the links and
times all-reduces across the hosts, chapter 13 times layouts on them, and chapters 3 and 11 send
the reader to the tests that run torchrun jobs on them and kill a host; the package docstring
(:mod:`dmlbook.netlab`) explains the wiring.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from dmlbook.netlab import claims
from dmlbook.runtime.owners import Owner

__all__ = [
    "Lab",
    "NetlabError",
    "available",
    "down",
    "burst_bytes",
    "parse_rate",
    "parse_time",
    "status",
    "sweep",
]

SUBNET = "10.213.0"  # 10.213.0.0/24: private, and only ever inside this lab's namespaces
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class NetlabError(RuntimeError):
    """The lab cannot do what was asked: not root, no iproute2, a name taken, a missing qdisc."""


def burst_bytes(rate_bits: float) -> int:
    """The token bucket of a shaped link: after an idle moment this many bytes pass at line speed
    before the rate holds (at least 64 KiB, the largest packet with segmentation offload, and at
    least 1 ms of traffic at the rate). So a message of m bytes after a pause can cross up to
    m / (m - burst) times faster than the rate alone allows (chapter 4)."""
    return max(64 * 1024, int(rate_bits / 8 * 0.001))


def parse_rate(text: str) -> float:
    """``"100mbit"`` -> 1e8 bits per second (tc's units: bit, kbit, mbit, gbit, tbit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bad bandwidth {text!r}: use a number and a unit, e.g. 100mbit or 1gbit")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_time(text: str) -> float:
    """``"0.2ms"`` -> 0.0002 seconds (units us, ms, s)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", str(text).lower())
    if not m:
        raise ValueError(f"bad delay {text!r}: use a number and a unit, e.g. 0.2ms or 5ms")
    return float(m.group(1)) * TIME_UNITS[m.group(2)]


def available() -> str | None:
    """None if the lab can run here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "netlab needs root (it creates network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netlab needs iproute2: {tool!r} is not on PATH"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise NetlabError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines() if line]


@dataclass
class Lab:
    """N hosts on one switch; each link limited to ``bandwidth``, optionally delayed and lossy."""

    hosts: int
    bandwidth: str | None = None  # e.g. "1gbit"; None leaves the links unshaped
    delay: str | None = None  # e.g. "0.2ms" one way per link end; needs the kernel's netem
    loss: float | None = None  # percent of packets dropped per link end; needs netem
    prefix: str = "dmlbook"  # a readable tag; the lab's own name adds a unique id (see name)
    second_bandwidth: str | None = None  # if set, a second link per host (eth1) at this rate
    # <prefix>-<8 hex>, unique to this lab: namespaces <name>-sw, <name>-h0, <name>-h1, ...
    name: str = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or self.hosts < 1:
            raise ValueError(f"hosts must be an integer >= 1, got {self.hosts!r}")
        if self.hosts > 126:
            raise ValueError(f"at most 126 hosts fit in {SUBNET}.0/25, got {self.hosts}")
        for rate in (self.bandwidth, self.second_bandwidth):
            if rate is not None:
                parse_rate(rate)
        if self.delay is not None:
            parse_time(self.delay)
        if self.loss is not None and not 0 <= self.loss < 100:
            raise ValueError(f"loss is a percentage in [0, 100), got {self.loss}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", self.prefix):
            raise ValueError(
                f"prefix must be 1-12 lowercase letters or digits, got {self.prefix!r}"
            )
        self.name = f"{self.prefix}-{secrets.token_hex(4)}"
        self._record: claims.Record | None = None

    # ----------------------------------------------------------------------- names

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    @property
    def names(self) -> list[str]:
        """The hosts' short names, ``h0``, ``h1``, ..."""
        return [f"h{i}" for i in range(self.hosts)]

    def namespace(self, host: str | int) -> str:
        """The namespace of ``host`` (``"h1"`` or ``1``)."""
        name = f"h{host}" if isinstance(host, int) else host
        if name not in self.names:
            raise ValueError(f"no host {host!r} in this lab; its hosts are {self.names}")
        return f"{self.name}-{name}"

    @property
    def links(self) -> dict[str, str | None]:
        """Each host's interfaces and their rates: eth0, and eth1 if there is a second link."""
        second = {"eth1": self.second_bandwidth} if self.second_bandwidth else {}
        return {"eth0": self.bandwidth, **second}

    def address(self, host: str | int, link: int = 0) -> str:
        """The IPv4 address of ``host`` on link 0 (eth0, 10.213.0.0/25) or 1 (eth1, .128/25)."""
        if link not in range(len(self.links)):
            raise ValueError(f"no link {link}: this lab has links {list(range(len(self.links)))}")
        return f"{SUBNET}.{int(self.namespace(host).rsplit('-h', 1)[1]) + 1 + 128 * link}"

    # ----------------------------------------------------------------------- up and down

    def up(self, owner: Owner | None = None) -> Lab:
        """Create the switch and the hosts; on any error, remove what was made and re-raise.

        First removes the labs whose owners died (:func:`sweep`), then records this lab as
        ``owner``'s (this process by default; the command line's ``up`` names its shell), so
        that a later run can tell whether it is still in use.
        """
        if reason := available():
            raise NetlabError(reason)
        if self._record is not None:
            raise NetlabError(f"lab {self.name} is already up")
        sweep()
        namespaces = (self.switch, *map(self.namespace, self.names))
        taken = set(namespaces) & set(_namespaces())
        record = claims.Record(self.name, self.prefix, self.hosts, namespaces, owner or Owner.me())
        try:
            if taken:
                raise FileExistsError
            claims.claim(record)
        except FileExistsError:
            raise NetlabError(
                f"lab {self.name} exists already (namespaces {sorted(taken)}): refusing to reuse it"
            ) from None
        self._record = record
        if record.owner == Owner.me():  # also removed when this process ends normally
            atexit.register(self._at_exit)
        try:
            _sh("ip", "netns", "add", self.switch)
            for link in range(len(self.links)):  # one bridge per link: br0, br1
                _sh("ip", "-n", self.switch, "link", "add", f"br{link}", "type", "bridge")
                _sh("ip", "-n", self.switch, "link", "set", f"br{link}", "up")
            for i, host in enumerate(self.names):
                ns = self.namespace(host)
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                for link, (dev, rate) in enumerate(self.links.items()):
                    self._wire(ns, dev, f"{'pq'[link]}{i}", link, self.address(host, link), rate)
        except BaseException:
            self.down()
            raise
        return self

    def _wire(self, ns: str, dev: str, port: str, link: int, address: str, rate) -> None:
        """A veth pair from ``dev`` in host ``ns`` to ``port`` on switch bridge ``br<link>``."""
        sw = ["ip", "-n", self.switch, "link", "set", port]
        # both ends are born inside their namespaces: nothing touches the machine's own
        _sh("ip", "link", "add", dev, "netns", ns, "type", "veth",
            "peer", "name", port, "netns", self.switch)  # fmt: skip
        _sh(*sw, "master", f"br{link}")
        _sh(*sw, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{address}/25", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        self._shape(ns, dev, rate)  # host -> switch
        self._shape(self.switch, port, rate)  # switch -> host

    def _shape(self, ns: str, dev: str, bandwidth: str | None) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        tbf_parent = ["root"]
        if self.delay is not None or self.loss:
            netem = ["netem"] + (["delay", self.delay] if self.delay else [])
            netem += ["loss", f"{self.loss}%"] if self.loss else []
            out = _sh(*tc, "root", "handle", "1:", *netem, check=False)
            if out.returncode != 0:
                raise NetlabError(
                    "delay and loss need the kernel's netem qdisc (sch_netem), which this kernel "
                    f"lacks ({out.stderr.strip().rstrip('.')}); bandwidth limits (tbf) work without"
                )
            tbf_parent = ["parent", "1:1", "handle", "10:"]
        if bandwidth is not None:
            rate = parse_rate(bandwidth)
            burst = burst_bytes(rate)
            _sh(*tc, *tbf_parent, "tbf", "rate", f"{int(rate)}bit", "burst", str(burst),
                "latency", "20ms")  # fmt: skip

    def down(self) -> None:
        """Kill what runs on the hosts, delete them and the switch. Safe to call twice."""
        record, self._record = self._record, None
        if record is not None:
            atexit.unregister(self._at_exit)
            _remove(record)

    def _at_exit(self) -> None:
        if self._record is not None and self._record.owner.pid == os.getpid():  # not a fork's
            self.down()

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ----------------------------------------------------------------------- using the hosts

    def command(self, host: str | int, cmd: list[str]) -> list[str]:
        """``cmd`` as it runs inside ``host``: gloo told to use the host's own interface."""
        return ["ip", "netns", "exec", self.namespace(host), "env", "GLOO_SOCKET_IFNAME=eth0", *cmd]

    def torchrun(
        self,
        host: str | int,
        nproc_per_node: int,
        *script_and_args: str,
        port: int = 29400,
        job: str = "netlab",
        log_dir: str | None = None,
    ) -> list[str]:
        """The torchrun command line that makes ``host`` one node of a job over every host.

        h0 hosts the c10d rendezvous. On real machines torchrun recognises the rendezvous
        host by its name; inside a namespace every host has the machine's name, so we say
        which one it is (``is_host``) and which address each node has (``--local-addr``).
        ``log_dir`` is torchrun's ``--log-dir``; without it torchrun makes a ``torchelastic_*``
        folder in the temporary directory and leaves it there.
        """
        logs = [] if log_dir is None else ["--log-dir", log_dir]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(self.hosts),
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.address(0)}:{port}",
            "--rdzv-id",
            job,
            "--rdzv-conf",
            f"is_host={int(self.namespace(host) == self.namespace(0))}",
            "--local-addr",
            self.address(host),
            *logs,
            *script_and_args,
        ]

    def run_job(
        self, nproc_per_node: int, *script_and_args: str, timeout: float = 180.0, **kwargs
    ) -> list[str]:
        """Run one torchrun job with a node on every host; return each host's output.

        Raises :class:`NetlabError` with the output of the hosts that failed. ``kwargs`` go to
        :class:`subprocess.Popen` (``cwd``, ``env``); ranks get one thread each by default.
        torchrun's own log folders go to a temporary folder that is removed after the job.
        """
        kwargs.setdefault("env", dict(os.environ, OMP_NUM_THREADS="1"))
        with tempfile.TemporaryDirectory(
            prefix="dmlbook-torchrun-", ignore_cleanup_errors=True
        ) as log_dir:
            procs = [
                self.popen(
                    host,
                    self.torchrun(
                        host, nproc_per_node, *script_and_args, log_dir=f"{log_dir}/{host}"
                    ),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    **kwargs,
                )
                for host in self.names
            ]
            try:
                logs = [p.communicate(timeout=timeout)[0] for p in procs]
            except subprocess.TimeoutExpired as e:
                raise NetlabError(f"the torchrun job ran past {timeout} s") from e
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        failed = [
            (h, p.returncode, log)
            for h, p, log in zip(self.names, procs, logs, strict=True)
            if p.returncode != 0
        ]
        if failed:
            raise NetlabError(
                "\n".join(f"{h} exited with {rc}:\n{log[-3000:]}" for h, rc, log in failed)
            )
        return logs

    def popen(self, host: str | int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside ``host``; ``kwargs`` go to :class:`subprocess.Popen`."""
        return subprocess.Popen(self.command(host, cmd), **kwargs)

    def run(self, host: str | int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host`` to completion; ``kwargs`` go to :func:`subprocess.run`."""
        return subprocess.run(self.command(host, cmd), **kwargs)

    def kill(self, host: str | int) -> list[int]:
        """Kill every process on ``host`` at once, as when a machine fails; returns their pids."""
        return _kill_namespace(self.namespace(host))

    def bytes_through(self, host: str | int, dev: str = "eth0") -> dict[str, int]:
        """Bytes received and sent so far by ``host``'s ``dev`` (the kernel's counters)."""
        out = _sh("ip", "-n", self.namespace(host), "-s", "-j", "link", "show", "dev", dev)
        stats = json.loads(out.stdout)[0]["stats64"]
        return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"]}


def _remove(record: claims.Record) -> list[str]:
    """Kill every process in the lab's namespaces, delete them, then forget the lab."""
    for ns in record.namespaces:
        _kill_namespace(ns)
        _sh("ip", "netns", "del", ns, check=False)  # its veths go with it
    claims.release(record)
    return list(record.namespaces)


def sweep() -> list[str]:
    """Remove every lab whose owner is dead (a crash's leftover); returns their namespaces.

    Labs are recognised by their recorded owner, never by their names: a live run's lab stays.
    """
    return [ns for r in claims.records() if r.owner.is_dead() for ns in _remove(r)]


def down(prefix: str | None = "dmlbook", force: bool = False) -> list[str]:
    """Remove the labs named ``prefix`` (the tag given to :class:`Lab`, or one lab's own name)
    that this process (or its parent, the shell of ``python -m dmlbook.netlab``) owns or whose
    owner is dead; ``prefix=None`` means every lab. Returns the namespaces removed.

    A lab owned by another live process is left alone: on a shared server it is another
    learner's. ``force=True`` (an instructor's `down --force`) removes those too and, for a
    ``prefix``, its namespaces that no record claims (left by an older version of this package).
    """
    callers = {Owner.me()}
    try:
        callers.add(Owner.of(os.getppid()))
    except ValueError:
        pass
    removed = []
    for r in claims.records():
        if prefix in (None, r.prefix, r.name) and (
            force or r.owner in callers or r.owner.is_dead()
        ):
            removed += _remove(r)
    if force and prefix:
        recorded = {ns for r in claims.records() for ns in r.namespaces}
        tag = re.escape(prefix)
        for ns in _namespaces():
            if ns not in recorded and re.fullmatch(rf"{tag}(-[0-9a-f]{{8}})?-(sw|h\d+)", ns):
                _kill_namespace(ns)
                _sh("ip", "netns", "del", ns, check=False)
                removed.append(ns)
    return removed


def labs(prefix: str | None = None) -> list[claims.Record]:
    """The recorded labs named ``prefix`` (a tag or one lab's name; None: all), of any owner."""
    return [r for r in claims.records() if prefix in (None, r.prefix, r.name)]


def _kill_namespace(ns: str) -> list[int]:
    """SIGKILL every process inside namespace ``ns``; returns their pids."""
    pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def status(prefix: str | None = "dmlbook") -> str:
    """A table of the labs named ``prefix`` (None: all): owner, then each host's namespace,
    address and the qdiscs shaping its links."""
    found = labs(prefix)
    if not found:
        return f"no netlab labs named {prefix!r}" if prefix else "no netlab labs"
    present, rows = set(_namespaces()), []
    for lab in found:
        state = (
            "dead: `python -m dmlbook.netlab down` removes it" if lab.owner.is_dead() else "live"
        )
        rows.append(f"lab {lab.name}: owner pid {lab.owner.pid} on {lab.owner.host} ({state})")
        for ns in lab.namespaces:
            if ns.endswith("-sw") or ns not in present:
                continue
            for dev in json.loads(_sh("ip", "-n", ns, "-j", "addr", "show").stdout):
                if not dev["ifname"].startswith("eth"):
                    continue
                ip4 = [a["local"] for a in dev["addr_info"] if a["family"] == "inet"]
                tc = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev["ifname"])
                shaping = "; ".join(_describe_qdisc(q) for q in tc.stdout.strip().splitlines())
                rows.append(f"  {ns:24s} {dev['ifname']:5s} {', '.join(ip4):13s} {shaping}")
    return "\n".join(rows)


def _describe_qdisc(line: str) -> str:
    """``qdisc tbf 8001: root refcnt 3 rate 200Mbit ...`` -> ``tbf rate 200Mbit ...``."""
    parts = line.split()
    rest = parts[parts.index("refcnt") + 2 :] if "refcnt" in parts else parts[4:]
    return " ".join([parts[1], *rest]) if parts[1] != "noqueue" else "unshaped"
