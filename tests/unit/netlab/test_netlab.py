"""The network lab: hosts in namespaces, shaped links, and torchrun across two hosts."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dmlbook import data_parallel as dp
from dmlbook import models, netlab
from dmlbook.datasets import load_digits

REPO = Path(__file__).resolve().parents[3]
PREFIX = f"t{os.getpid() % 100000}"  # this run's own namespaces; never the CLI's default

needs_lab = pytest.mark.skipif(netlab.available() is not None, reason=str(netlab.available()))


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    if netlab.available() is None:
        assert netlab.down(PREFIX) == [], "a test left namespaces behind"


# --------------------------------------------------------------------------- no root needed


def test_rates_and_times_parse():
    assert netlab.parse_rate("100mbit") == 1e8
    assert netlab.parse_rate("1.5Gbit") == 1.5e9
    assert netlab.parse_time("0.2ms") == pytest.approx(2e-4)
    assert netlab.parse_time("5 ms") == pytest.approx(5e-3)
    for bad in ("100", "fast", "10 furlongs", "-1mbit", "0mbit", "1mb"):
        with pytest.raises(ValueError, match="bad bandwidth"):
            netlab.parse_rate(bad)
    with pytest.raises(ValueError, match="bad delay"):
        netlab.parse_time("soon")


def test_bad_lab_arguments():
    for hosts in (0, -2, 1.5, True, 127):
        with pytest.raises(ValueError, match="hosts"):
            netlab.Lab(hosts)
    with pytest.raises(ValueError, match="bandwidth"):
        netlab.Lab(2, bandwidth="lots")
    with pytest.raises(ValueError, match="loss"):
        netlab.Lab(2, loss=120)
    with pytest.raises(ValueError, match="prefix"):
        netlab.Lab(2, prefix="Bad-Name")
    lab = netlab.Lab(3)
    assert lab.address("h2") == "10.213.0.3"
    assert re.fullmatch(r"dmlbook-[0-9a-f]{8}-h0", lab.namespace(0))
    assert netlab.Lab(3).name != lab.name  # every lab's names are its own
    with pytest.raises(ValueError, match="no host 'h3'"):
        lab.namespace("h3")


# --------------------------------------------------------------------------- real namespaces


@pytest.mark.netns
@needs_lab
def test_up_status_down_and_two_labs_of_one_prefix_at_once():
    with netlab.Lab(2, bandwidth="200mbit", prefix=PREFIX) as lab:
        table = netlab.status(PREFIX)
        assert lab.namespace(0) in table and "10.213.0.2" in table and "rate 200Mbit" in table
        with pytest.raises(netlab.NetlabError, match="already up"):
            lab.up()
        with netlab.Lab(2, prefix=PREFIX) as second:  # a second run of the same chapter
            assert not set(map(second.namespace, second.names)) & set(map(lab.namespace, lab.names))
            # each carries traffic on its own switch, with the same addresses
            assert netlab.tcp_throughput(second, "h0", "h1", seconds=0.3) > 0
        assert lab.namespace(0) in netlab.status(PREFIX)  # the second's end left the first up
        out = lab.run(
            "h1",
            ["sh", "-c", "echo $GLOO_SOCKET_IFNAME"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "eth0"
        # the machine's own namespace never sees the lab's subnet
        assert (
            "10.213.0" not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
        )
    assert netlab.down(PREFIX) == []


@pytest.mark.netns
@needs_lab
def test_kill_a_host_and_down_leave_no_process():
    lab = netlab.Lab(2, prefix=PREFIX).up()
    try:
        sleepers = [lab.popen(h, ["sleep", "600"]) for h in lab.names]
        deadline = time.monotonic() + 5
        while (
            not all(
                subprocess.run(
                    ["ip", "netns", "pids", lab.namespace(h)], capture_output=True, text=True
                ).stdout.split()
                for h in lab.names
            )
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert lab.kill("h0") == [sleepers[0].pid]  # a whole host fails ...
        assert sleepers[0].wait(timeout=5) == -9
        assert sleepers[1].poll() is None  # ... and the other one does not notice
    finally:
        lab.down()  # kills what still runs on h1
    assert sleepers[1].wait(timeout=5) == -9


@pytest.mark.netns
@needs_lab
def test_context_manager_tears_down_on_error():
    with pytest.raises(KeyError):
        with netlab.Lab(2, prefix=PREFIX):
            raise KeyError("boom")
    assert netlab.down(PREFIX) == []


@pytest.mark.netns
@needs_lab
def test_shaped_link_never_carries_more_than_its_rate():
    # Correctness of the shaping only; the measured figures are in `python -m dmlbook.bench netlab`.
    with netlab.Lab(2, bandwidth="100mbit", prefix=PREFIX) as lab:
        bits_per_s = netlab.tcp_throughput(lab, "h0", "h1", seconds=1.0)
    assert 0.3e8 < bits_per_s <= 1.03e8


@pytest.mark.netns
@needs_lab
def test_second_link_is_separate_and_separately_shaped():
    # Chapter 4's hybrid transfer needs two links of different rates between the same hosts.
    with netlab.Lab(2, bandwidth="1gbit", second_bandwidth="100mbit", prefix=PREFIX) as lab:
        assert lab.address("h1", 1) == "10.213.0.130"
        assert "eth1  10.213.0.130" in netlab.status(PREFIX)
        before = {dev: lab.bytes_through("h1", dev) for dev in lab.links}
        slow = netlab.tcp_throughput(lab, "h0", "h1", seconds=1.0, link=1)
        after = {dev: lab.bytes_through("h1", dev) for dev in lab.links}
    assert 0.3e8 < slow <= 1.03e8  # the second link's own limit, not the first's
    received = {dev: after[dev]["rx"] - before[dev]["rx"] for dev in lab.links}
    assert received["eth1"] > 0.9 * slow / 8 * 1.0  # the stream went over eth1 ...
    assert received["eth0"] < 0.01 * received["eth1"]  # ... and not over eth0
    with pytest.raises(ValueError, match="no link 2"):
        lab.address("h0", 2)


@pytest.mark.netns
@needs_lab
def test_split_transfer_sends_each_part_over_its_own_link():
    sizes = [3_000_000, 1_000_000]
    with netlab.Lab(2, bandwidth="300mbit", second_bandwidth="100mbit", prefix=PREFIX) as lab:
        before = {dev: lab.bytes_through("h1", dev)["rx"] for dev in lab.links}
        seconds = netlab.split_transfer(lab, "h0", "h1", sizes)
        after = {dev: lab.bytes_through("h1", dev)["rx"] for dev in lab.links}
        with pytest.raises(ValueError, match="3 parts but the lab has 2 link"):
            netlab.split_transfer(lab, "h0", "h1", [1, 1, 1])
    for dev, nbytes in zip(lab.links, sizes, strict=True):
        # every byte arrived over its own link (TCP/IP headers add a few percent)
        assert nbytes <= after[dev] - before[dev] < 1.1 * nbytes
    # no part can beat its link's shaping: a lower bound on time that noise cannot break
    assert seconds[0] > 0.9 * sizes[0] * 8 / 3e8 and seconds[1] > 0.9 * sizes[1] * 8 / 1e8


@pytest.mark.netns
@needs_lab
def test_torchrun_across_two_hosts_equals_single_process(tmp_path):
    out = tmp_path / "result.pt"
    with netlab.Lab(2, bandwidth="1gbit", prefix=PREFIX) as lab:
        before = [lab.bytes_through(h) for h in lab.names]
        start = time.monotonic()
        script = str(REPO / "examples" / "train_data_parallel.py")
        lab.run_job(2, script, "--out", str(out), cwd=REPO)
        seconds = time.monotonic() - start
        after = [lab.bytes_through(h) for h in lab.names]
    print(f"2 hosts x 2 processes under torchrun: {seconds:.1f} s")
    saved = torch.load(out, weights_only=True)

    # 2 hosts x 2 processes: global ranks 0-3, each host with local ranks 0 and 1
    where = {(w["node"], w["local_rank"]): w["rank"] for w in saved["where"]}
    assert sorted(where) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(where.values()) == [0, 1, 2, 3]
    assert {w["interface"] for w in saved["where"]} == {"eth0"}

    # the same weights as one process training on the global batch
    x, y = load_digits("train")
    reference = models.mlp(seed=0)
    dp.train(reference, x, y, dp.TrainConfig(**saved["settings"]))
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(saved["state"][k], v, rtol=1e-5, atol=1e-6)

    # and the gradients really crossed the shaped links: every all-reduce must bring each host
    # the other host's contribution to every parameter, so each host receives at least
    # (steps x parameter bytes)
    steps = saved["settings"]["epochs"] * (len(x) // saved["settings"]["global_batch"])
    param_bytes = sum(v.numel() * v.element_size() for v in reference.parameters())
    for b, a in zip(before, after, strict=True):
        assert a["rx"] - b["rx"] >= steps * param_bytes


# --------------------------------------------------------------------------- owners


def _lab_in_a_process(then: str) -> subprocess.Popen:
    """A process that brings up a 1-host lab with a sleeper on it, prints the lab's record, then
    runs ``then`` (Python)."""
    code = textwrap.dedent(f"""\
        import json, os, signal, sys
        from dmlbook import netlab
        lab = netlab.Lab(1, prefix={PREFIX!r}).up()
        sleeper = lab.popen("h0", ["sleep", "600"])
        print(json.dumps([lab.name, sleeper.pid, [lab.switch, lab.namespace(0)]]), flush=True)
        {then}
    """)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.netns
@needs_lab
@pytest.mark.timeout(90)
def test_a_dead_owners_lab_is_removed_by_the_next_and_a_live_ones_never(tmp_path):
    live = _lab_in_a_process("sys.stdin.read()")  # a learner's run, still going
    live_name, live_sleeper, live_ns = json.loads(live.stdout.readline())
    killed = _lab_in_a_process("os.kill(os.getpid(), signal.SIGKILL)")  # a kernel killed mid-run
    try:
        dead_name, dead_sleeper, dead_ns = json.loads(killed.stdout.readline())
        assert killed.wait(timeout=30) == -signal.SIGKILL
        assert set(dead_ns + live_ns) <= set(netlab.lab._namespaces())
        table = netlab.status(PREFIX)
        assert f"lab {dead_name}: owner pid {killed.pid}" in table and "(dead" in table
        # the next run removes what the dead owner left (namespaces, processes, record), and
        # only that
        with netlab.Lab(1, prefix=PREFIX) as following:
            present = set(netlab.lab._namespaces())
            assert not set(dead_ns) & present and set(live_ns) <= present
            assert {r.name for r in netlab.lab.labs(PREFIX)} == {live_name, following.name}
        assert _gone(dead_sleeper) and not _gone(live_sleeper)
        # down() by prefix, from a process that does not own it, leaves a live lab alone too
        assert netlab.down(PREFIX) == [] and set(live_ns) <= set(netlab.lab._namespaces())
        assert [r.name for r in netlab.lab.labs(PREFIX)] == [live_name]
        # a pid the kernel reused is not the owner: this process's pid with another start time
        me = netlab.lab.Owner.me()
        reused = netlab.Lab(1, prefix=PREFIX)
        reused.up(owner=netlab.lab.Owner(me.pid, me.start + 1, me.host))
        assert netlab.sweep() == [reused.switch, reused.namespace(0)]
    finally:
        live.stdin.close()  # the live run ends normally: its lab goes with it
        assert live.wait(timeout=30) == 0
    assert not set(live_ns) & set(netlab.lab._namespaces()) and netlab.lab.labs(PREFIX) == []
    deadline = time.monotonic() + 5
    while not _gone(live_sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(live_sleeper)


@pytest.mark.netns
@needs_lab
@pytest.mark.timeout(60)
def test_command_line_lab_belongs_to_its_shell():
    cli = [sys.executable, "-m", "dmlbook.netlab", "--prefix", PREFIX]
    up = subprocess.run([*cli, "up", "--hosts", "2"], capture_output=True, text=True, check=True)
    (record,) = netlab.lab.labs(PREFIX)
    assert record.owner.pid == os.getpid()  # this process ran it, as a shell would
    assert f"lab {record.name}" in up.stdout and record.namespaces[1] in up.stdout
    hello = subprocess.run([*cli, "run", "h1", "--", "ip", "-br", "addr"], capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert "10.213.0.2" in hello.stdout
    # another shell's `down` leaves it alone; its own shell's (this process) removes it
    other = subprocess.run(  # (a second command keeps sh from exec'ing the first)
        ["sh", "-c", " ".join([*cli, "down"]) + "; true"], capture_output=True, text=True
    )
    assert "left alone (live owners): " + record.name in other.stdout
    assert netlab.lab.labs(PREFIX) == [record]
    mine = subprocess.run([*cli, "down"], capture_output=True, text=True, check=True)
    assert mine.stdout.split() == ["removed", *record.namespaces]
    # an instructor's --force removes a live owner's lab too
    subprocess.run([*cli, "up", "--hosts", "1"], capture_output=True, check=True)
    (record,) = netlab.lab.labs(PREFIX)
    forced = subprocess.run(
        ["sh", "-c", " ".join([*cli, "down", "--force"]) + "; true"], capture_output=True, text=True
    )
    assert forced.stdout.split() == ["removed", *record.namespaces]
    assert not set(record.namespaces) & set(netlab.lab._namespaces())
