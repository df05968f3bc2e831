"""DMLBOOK_GLOO_LOOP: gloo's transport threads under the policy asked for ("low" when unset), in
every rank and in the groups made later, and the collectives unchanged (dmlbook.runtime.gloo_thread;
chapter 4)."""

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dmlbook.comm import collectives
from dmlbook.launch import run
from dmlbook.runtime import gloo_thread

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread policies through /proc and sched(7)"
)


def _policies_and_sums(n: int):
    """This rank's loop-thread policies, and the ring's and gloo's sums of the same tensor."""
    tids = gloo_thread.loop_threads()
    policies = [(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids]
    x = torch.arange(n, dtype=torch.float32) * (dist.get_rank() + 1)
    ours, theirs = x.clone(), x.clone()
    collectives.all_reduce(ours)
    dist.all_reduce(theirs)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the rank's own nice
    return policies, gloo_thread.current_policy(), ours, theirs, mine


@pytest.mark.parametrize("world_size", [2, 3])
def test_idle_puts_every_ranks_transport_thread_under_sched_idle(monkeypatch, world_size):
    monkeypatch.setenv(gloo_thread.ENV, "idle")
    results = run(_policies_and_sums, world_size, 1001, backend="gloo")
    expected = torch.arange(1001, dtype=torch.float32) * sum(range(1, world_size + 1))
    for policies, current, ours, theirs, _ in results:
        assert policies and {kind for kind, _ in policies} == {os.SCHED_IDLE}  # found and set
        assert current == "idle"
        assert torch.equal(ours, expected) and torch.equal(theirs, expected)


def test_unset_puts_the_threads_at_low_and_normal_leaves_them_as_gloo_starts_them(monkeypatch):
    monkeypatch.delenv(gloo_thread.ENV, raising=False)
    expected = torch.arange(7, dtype=torch.float32) * 3
    for policies, current, ours, theirs, _ in run(_policies_and_sums, 2, 7, backend="gloo"):
        assert policies and set(policies) == {(os.SCHED_OTHER, gloo_thread.LOW_NICE)}
        assert current == "low" == gloo_thread.DEFAULT_POLICY
        assert torch.equal(ours, expected) and torch.equal(theirs, expected)
    monkeypatch.setenv(gloo_thread.ENV, "normal")
    for policies, current, _, _, mine in run(_policies_and_sums, 2, 7, backend="gloo"):
        assert policies and set(policies) == {(os.SCHED_OTHER, mine)}  # level with the rank
        assert current == ("low" if mine == gloo_thread.LOW_NICE else "normal")


def test_a_bad_setting_is_a_clear_error_in_the_caller(monkeypatch):
    monkeypatch.setenv(gloo_thread.ENV, "fast")
    with pytest.raises(ValueError, match="DMLBOOK_GLOO_LOOP must be one of"):
        run(_policies_and_sums, 2, 7, backend="gloo")
    with pytest.raises(ValueError, match="policy must be one of"):
        gloo_thread.set_loop_policy("fast")


def test_a_thread_the_system_will_not_change_is_not_counted(monkeypatch):
    monkeypatch.setattr(gloo_thread, "loop_threads", lambda: [os.getpid()])

    def refuse(*args):
        raise PermissionError("a sandbox that refuses sched_setscheduler")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert gloo_thread.set_loop_policy("idle") == 0
    monkeypatch.undo()  # and a nice that will not change (raising a priority needs privileges)
    monkeypatch.setattr(gloo_thread, "loop_threads", lambda: [threading.get_native_id()])
    monkeypatch.setattr(os, "setpriority", refuse)
    assert gloo_thread.set_loop_policy("low") == 0


def _loop_threads_beside_a_thread_pool():
    """Find the loop threads where torch's intra-op pool has started worker threads, which keep
    this thread's name for good, with a naming wait long enough to show if it were taken."""
    torch.set_num_threads(2)
    a = torch.randn(1024, 1024)
    (a @ a @ a).sum()  # the pool's workers start, and run for a while
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names[int(tid)] = f.read().strip()
    me = threading.get_native_id()
    python = {t.native_id for t in threading.enumerate()}
    workers = [t for t, name in names.items() if name == names[me] and t not in python | {me}]
    gloo_thread.NAMING_WAIT_S = 30.0
    start = time.monotonic()
    found = gloo_thread.loop_threads()
    return len(workers), len(found), time.monotonic() - start


def test_threads_that_keep_their_creators_name_are_not_waited_for():
    (workers, found, took), _ = run(_loop_threads_beside_a_thread_pool, 2, backend="gloo")
    assert workers >= 1  # the case this is about: threads named like the rank's own
    assert found >= 1 and took < 10, f"waited {took:.1f} s for {workers} pool threads"


def _policies_once_set(deadline_s: float = 10.0) -> set[int]:
    """The loop threads' scheduling classes once every one is under SCHED_IDLE (the watcher sets
    a new group's thread within a tick or two), or as they are at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        policies = {os.sched_getscheduler(tid) for tid in gloo_thread.loop_threads()}
        if policies == {os.SCHED_IDLE} or time.monotonic() > deadline:
            return policies
        time.sleep(0.05)


def _policies_after_new_groups():
    """Groups made after the rank started, with no call to gloo_thread: one of this rank alone,
    chapter 13's layout of the world, and chapter 3's parameter server's own gloo group (what it
    makes under NCCL)."""
    from dmlbook.advanced.composition.layout import Layout, ProcessGroups

    watching = gloo_thread.watching()
    before = len(gloo_thread.loop_threads())
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    after_alone = _policies_once_set()
    groups = ProcessGroups(Layout(dp=2))  # its groups: loop threads of their own
    ps_comm = dist.new_group(backend="gloo")  # as train_parameter_server makes it under NCCL
    x = torch.ones(5)
    dist.all_reduce(x, group=groups.dp)
    dist.all_reduce(torch.ones(1), group=alone)
    dist.all_reduce(torch.ones(1), group=ps_comm)
    policies = _policies_once_set()
    return watching, before, len(gloo_thread.loop_threads()), after_alone, policies, x


def test_groups_made_later_follow_the_setting(monkeypatch):
    monkeypatch.setenv(gloo_thread.ENV, "idle")
    for watching, before, after, after_alone, policies, x in run(
        _policies_after_new_groups, 2, backend="gloo"
    ):
        assert watching
        assert after > before + 2 and after_alone == policies == {os.SCHED_IDLE}
        assert torch.equal(x, torch.full((5,), 2.0))


def test_a_setting_that_sets_nothing_under_gloo_says_so(monkeypatch, capfd):
    monkeypatch.setenv(gloo_thread.ENV, "idle")
    monkeypatch.setattr(gloo_thread, "set_loop_policy", lambda policy: 0)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert gloo_thread.follow_env() == 0
    assert "no gloo transport thread" in capfd.readouterr().err
    monkeypatch.delenv(gloo_thread.ENV)  # the default, not asked for: nothing to say
    assert gloo_thread.follow_env() == 0
    assert capfd.readouterr().err == ""
