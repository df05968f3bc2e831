"""Gloo's transport thread and the scheduler: where a small message's 3-4 ms went (chapter 4).

On the 2-core reference machine one gloo round trip in four or five took 3-4 ms instead of
0.2: a 1 KiB ping-pong between two ranks had a median of 0.15-0.19 ms and 15-25% of its round
trips above 2 ms, and ``dist.all_reduce`` as many. Python's own sockets between the same two
processes never did (32 KiB round trips: 0.04 ms, none above 2 ms). The time went to a thread.

Gloo's TCP transport runs one event-loop thread per process group (Linux names it
``gloo_tcp_loop``). It reads arriving bytes and sends queued ones, and before it touches a
connection it *tries* that connection's lock; when the lock is taken (the rank's own thread is
posting a send or a receive) it returns and asks epoll again, which reports the same bytes
again: it spins. Posting a message writes to the socket, and on loopback that write wakes the
other rank's threads; on two cores shared by two ranks' threads the writer is often preempted
while it holds the lock, so the loop thread spins until the scheduler takes its core away, up to
a time slice of 3-4 ms. ``/proc/<pid>/task/<tid>/schedstat`` showed it: during a ping-pong the
loop thread ran 0.56 ms per round trip, and the rank's main thread waited 0.69 ms per round trip
for a core.

:func:`set_loop_policy` moves those threads to ``SCHED_IDLE``: they run only on a core nobody
else wants, so a spinning loop thread gives way at once to the thread it waits for. On the quiet
reference machine that removed the slow round trips (0-1% above 2 ms, p90 0.21-0.45 ms against
3-4 ms, ping-pong and ``all_reduce`` alike) and made gloo's all-reduce and the book's ring faster
together (``bench allreduce``, three runs each way: gloo 9.9-10.4 ms at 16 MiB against
10.5-17.9; the ring 1.03-1.17x gloo at 64 KiB against 1.33-2.80x). Torch's DDP step did not slow
(``bench data-parallel``: 2.88 and 14.4 ms against 2.86 and 15.2 for the two MLPs).

It is not the default. A thread that runs only on a free core is, by design, last in line on a
machine whose cores are all taken, as a classroom server's can be. Beside two busy processes on
the two cores the runs here disagreed: one measured a median of 3.2 ms for a 64 KiB
``all_reduce`` with idle loop threads against 0.35 at the normal policy, two more 0.36-0.38
against 0.28-0.44, and ``bench allreduce`` 1.19 ms against 1.51 at 1 MiB. Beside the test suite
(three workers on the two cores) chapter 4's ping-pong had 42% of its round trips above 2 ms
with idle loop threads against 18% at the normal policy, and beside other ranks' collectives
2-53% against 0-6% in four runs: there the stall it removes hardly happens, and the loop threads
wait for a free core. So the setting is the user's to make, where cores are free.

``DMLBOOK_GLOO_LOOP=idle`` in the caller's environment makes every rank that
:func:`dmlbook.launch.run` or :class:`~dmlbook.launch.Ranks` starts call
``set_loop_policy("idle")`` once its process group is up (the rank's environment then says so
too). A group made later (``dist.new_group``) starts a loop thread of its own, at the normal
policy: :func:`follow_env` after making it applies the setting again, as chapter 13's meshes and
layouts do. Where threads cannot be found or changed (not Linux, or a sandbox that refuses
``sched_setscheduler``) nothing changes, and the return value says so.
"""

from __future__ import annotations

import os

__all__ = [
    "ENV",
    "LOOP_THREAD",
    "POLICIES",
    "follow_env",
    "loop_threads",
    "policy_from_env",
    "set_loop_policy",
]

LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop thread
ENV = "DMLBOOK_GLOO_LOOP"
POLICIES = ("normal", "idle")


def loop_threads() -> list[int]:
    """The thread ids of this process's gloo transport threads ([] where /proc has none)."""
    tids = []
    try:
        entries = os.listdir("/proc/self/task")
    except OSError:
        return tids
    for tid in entries:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == LOOP_THREAD:
                    tids.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return tids


def set_loop_policy(policy: str) -> int:
    """Put every gloo transport thread of this process under ``policy``: "idle"
    (``SCHED_IDLE``: it runs only on a core nobody else wants) or "normal" (``SCHED_OTHER``, as
    gloo starts it). Returns how many threads were changed: 0 where none could be."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not hasattr(os, "sched_setscheduler"):
        return 0
    kind = os.SCHED_IDLE if policy == "idle" else os.SCHED_OTHER
    changed = 0
    for tid in loop_threads():
        try:
            os.sched_setscheduler(tid, kind, os.sched_param(0))
        except OSError:  # gone, or refused (leaving SCHED_IDLE may need privileges)
            continue
        changed += 1
    return changed


def policy_from_env() -> str | None:
    """The policy ``DMLBOOK_GLOO_LOOP`` asks for (None when unset or empty); a ValueError for
    any other value, raised in the caller before a rank starts."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value not in POLICIES:
        raise ValueError(f"{ENV} must be one of {POLICIES} or unset, got {value!r}")
    return value


def follow_env() -> int:
    """Apply ``DMLBOOK_GLOO_LOOP`` to this process's loop threads, those of groups made since the
    rank started included; 0 (and nothing changed) when it is unset."""
    policy = policy_from_env()
    return set_loop_policy(policy) if policy else 0
