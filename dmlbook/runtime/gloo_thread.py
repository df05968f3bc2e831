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

:func:`set_loop_policy` gives those threads one of three places in the scheduler's queue:

* ``"normal"``: as gloo starts them (``SCHED_OTHER``, at the nice of the rank's own thread),
  level with it.
* ``"low"`` (the default): nice 19, the lowest weight ``SCHED_OTHER`` has. A spinning loop
  thread then gets a small share of a contended core instead of an equal one, so the lock holder
  it waits for gets the core sooner; yet, unlike ``SCHED_IDLE``, it keeps a share (a small one)
  of a core that stays busy.
* ``"idle"``: ``SCHED_IDLE``: the thread runs only on a core nobody else wants, and any other
  thread that wakes takes its core at once. Best on a quiet machine, worst on a busy one.

Measured on the 2-core reference machine (chapter 4 shows the first on the machine at hand; the
README and docs/performance-log.md give the rest): quiet, a 1 or 64 KiB round trip or
``dist.all_reduce`` took over 2 ms in 10-38% of calls as gloo starts the threads, 2-12% with
``"low"`` and 0-1% with ``"idle"``.
Beside two busy processes, a 1 or 64 KiB ``dist.all_reduce`` took over 2 ms in 30-42% of calls
(normal), 8-23% (low) and 8-63% (idle, with a 1 KiB median of 4 ms in one run). And where a
job's own ranks outnumber the cores (world size 3 and 4 on 2 cores), spinning loop threads are
pure waste: three test modules of collectives and data parallelism used 73-74 CPU-seconds as gloo
starts the threads, 56-57 with ``"low"`` and 53-60 with ``"idle"``. ``"low"`` did better than
``"normal"`` wherever the two did not overlap, and better than ``"idle"`` beside busy processes;
``"idle"`` did best on the quiet machine and with more ranks than cores, and worst beside busy
processes. So the book's ranks use ``"low"`` unless told otherwise. Where ``"low"`` loses: large
messages beside processes that want every core, since the loop thread moves their bytes. Beside
two spinning processes a 16 MiB all-reduce's median was 12.9-33.7 ms at nice 19 against
12.4-17.7 ms as gloo starts the threads (five rounds; equal in three, up to 2.4x in two):
``DMLBOOK_GLOO_LOOP=normal`` is the choice there.

``DMLBOOK_GLOO_LOOP`` in the caller's environment (which every rank inherits) chooses another:
every rank that :func:`dmlbook.launch.run` or :class:`~dmlbook.launch.Ranks` starts (or that
``run`` finds under torchrun) calls :func:`follow_env` once its process group is up. A group
made later (``dist.new_group``: chapter 13's layouts, chapter 3's parameter server) starts a
loop thread of its own, as gloo starts it; the first :func:`follow_env` in a rank also starts a
watcher, a daemon thread that lists ``/proc/self/task`` every :data:`WATCH_INTERVAL_S` seconds
and puts each new loop thread under the same policy, so teaching code never calls this module.
It reads a thread's name only when the set of threads changed (a new thread's name once or,
while it may not have named itself yet, a few times). Measured here, a tick costs 0.1-0.2 ms of
CPU (mostly waking the thread): 0.04-0.09% of a core. Where no thread can be set (not Linux, or
a sandbox that refuses) nothing changes; the count returned says so, and :func:`follow_env` says
it on stderr under gloo when the policy was asked for. Going back to ``"normal"`` from ``"low"``
or ``"idle"`` raises a thread's priority, which Linux allows only with privileges: refused
threads are not counted.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = [
    "DEFAULT_POLICY",
    "ENV",
    "POLICIES",
    "current_policy",
    "follow_env",
    "loop_threads",
    "policy_from_env",
    "set_loop_policy",
    "watching",
]

LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop thread
ENV = "DMLBOOK_GLOO_LOOP"
POLICIES = ("normal", "low", "idle")
DEFAULT_POLICY = "low"  # what the book's ranks use when DMLBOOK_GLOO_LOOP is unset
LOW_NICE = 19  # "low": the highest nice value, the lowest weight under SCHED_OTHER
NAMING_WAIT_S = 1.0  # how long to wait for threads just started to take their names (a busy
# machine may not run a new thread for a while; it is waited for only while one is unnamed)
JUST_STARTED_S = 1e-3  # a thread that has run less than this may not have named itself yet
WATCH_INTERVAL_S = 0.25  # how often the watcher lists this process's threads
_STRAYS: set[int] = set()  # unnamed threads waited for once in vain: not waited for again


def _thread_names() -> dict[int, str]:
    """This process's threads by id, each with its name ({} where /proc has none)."""
    names = {}
    try:
        entries = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in entries:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
    return names


def loop_threads() -> list[int]:
    """The thread ids of this process's gloo transport threads ([] where /proc has none).

    A thread starts with its creator's name and takes its own a moment later, so a loop thread
    that ``dist.new_group`` has just started may still carry this thread's. This waits (up to
    :data:`NAMING_WAIT_S`) while a thread that Python did not start carries this thread's name
    and has run for less than :data:`JUST_STARTED_S` (a loop thread names itself as it starts).
    Threads that keep the name for good (an OpenMP pool's workers) have run longer, and one
    waited for in vain is not waited for again. (This thread's id comes from
    ``threading.get_native_id()``: in a forked rank, ``threading.main_thread().native_id`` is
    still the parent's.)"""
    from dmlbook.cpu_wait import scheduler_clock

    me = threading.get_native_id()
    deadline = time.monotonic() + NAMING_WAIT_S
    while True:
        names = _thread_names()
        ours = {t.native_id for t in threading.enumerate()} | {me} | _STRAYS
        unnamed = [
            tid
            for tid, name in names.items()
            if name == names.get(me)
            and tid not in ours
            and scheduler_clock([tid])[0] < JUST_STARTED_S
        ]
        if unnamed and time.monotonic() > deadline:
            _STRAYS.update(unnamed)
        if not unnamed or time.monotonic() > deadline:
            return sorted(tid for tid, name in names.items() if name == LOOP_THREAD)
        time.sleep(0.001)


def set_loop_policy(policy: str) -> int:
    """Put every gloo transport thread of this process under ``policy`` ("normal", "low" or
    "idle", see the module's docstring). Returns how many threads were set: 0 where none
    could be."""
    setting = _setting(policy)
    return 0 if setting is None else _apply(loop_threads(), setting)


def _setting(policy: str) -> tuple[int, int | None] | None:
    """(scheduling class, nice or None) for ``policy``, "normal" level with the calling thread;
    None where threads cannot be set here."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")):
        return None
    kind = os.SCHED_IDLE if policy == "idle" else os.SCHED_OTHER
    # "normal": level with the calling thread (whose nice a new thread inherits), not nice 0
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return kind, {"normal": mine, "low": LOW_NICE, "idle": None}[policy]


def _apply(tids, setting: tuple[int, int | None]) -> int:
    """Put the threads ``tids`` under ``setting``; how many it could set."""
    kind, nice = setting
    done = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, kind, os.sched_param(0))
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, nice)  # on Linux, that thread's alone
        except OSError:  # gone, or refused (raising a thread's priority needs privileges)
            continue
        done += 1
    return done


def current_policy() -> str | None:
    """ "normal", "low" or "idle" when every gloo transport thread of this process is under it
    ("low": nice 19 under ``SCHED_OTHER``; any other nice counts as "normal", so in a process
    that already runs at nice 19 the two are one), "mixed" when they differ; None when there is
    none to ask (or no way to ask)."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    found = set()
    for tid in loop_threads():
        try:
            if os.sched_getscheduler(tid) == getattr(os, "SCHED_IDLE", None):
                found.add("idle")
            else:
                found.add("low" if os.getpriority(os.PRIO_PROCESS, tid) == LOW_NICE else "normal")
        except OSError:
            continue
    if not found:
        return None
    return found.pop() if len(found) == 1 else "mixed"


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
    """Put this process's loop threads under the policy ``DMLBOOK_GLOO_LOOP`` asks for, or
    :data:`DEFAULT_POLICY` when it is unset, and keep putting those of groups made later under it
    (the watcher, started by the first call in a process). Returns how many were set now. Under
    gloo, a policy asked for that could change no thread is said on stderr rather than ignored."""
    asked = policy_from_env()
    policy = asked or DEFAULT_POLICY
    seen = _tids()  # before setting: a thread started meanwhile is the watcher's to set
    done = set_loop_policy(policy)
    setting = _setting(policy)
    if setting is not None and seen:
        _Watcher.follow(setting, seen)
    if done == 0 and asked:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            print(
                f"dmlbook: {ENV}={policy}, but no gloo transport thread ({LOOP_THREAD}) could be "
                "set here; gloo runs as it starts",
                file=sys.stderr,
            )
    return done


def watching() -> bool:
    """Whether this process's watcher runs (a rank's, once :func:`follow_env` started it)."""
    watcher = _Watcher.current
    return watcher is not None and watcher.thread.is_alive()


def _tids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _name(tid: int) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return None


class _Watcher:
    """The daemon thread that puts each new loop thread of this process under the policy.

    Each tick lists ``/proc/self/task``; only when the set changed does it read the new threads'
    names. A new thread named like the thread that called :func:`follow_env` and that has run
    less than :data:`JUST_STARTED_S` may not have named itself yet: it is read again on the next
    ticks, for up to :data:`NAMING_WAIT_S`. Threads it has seen once it never sets again, so a
    policy set by hand afterwards (chapter 4's cell) stays."""

    current: _Watcher | None = None
    lock = threading.Lock()

    def __init__(self, setting: tuple[int, int | None], seen: set[int]) -> None:
        self.setting, self.seen, self.pid = setting, set(seen), os.getpid()
        self.creator = _name(threading.get_native_id())
        self.pending: dict[int, float] = {}  # a new thread not named yet -> when first seen
        self.thread = threading.Thread(target=self._watch, name="dmlbook-gloo-watch", daemon=True)

    @classmethod
    def follow(cls, setting: tuple[int, int | None], seen: set[int]) -> None:
        """Start this process's watcher, or give the running one the policy now asked for."""
        with cls.lock:
            watcher = cls.current
            if watcher is not None and watcher.pid == os.getpid() and watcher.thread.is_alive():
                watcher.setting = setting
                return
            cls.current = cls(setting, seen)  # (in a forked child, the parent's is not running)
            cls.current.thread.start()

    def _watch(self) -> None:
        from dmlbook.cpu_wait import scheduler_clock

        last = set(self.seen)
        while True:
            time.sleep(WATCH_INTERVAL_S)
            now = _tids()
            if now == last and not self.pending:
                continue
            last = now
            python = {t.native_id for t in threading.enumerate()}
            for tid in now - self.seen:
                first = self.pending.setdefault(tid, time.monotonic())
                name = _name(tid)
                if name == LOOP_THREAD:
                    _apply([tid], self.setting)
                elif (
                    name == self.creator
                    and tid not in python
                    and scheduler_clock([tid])[0] < JUST_STARTED_S
                    and time.monotonic() - first < NAMING_WAIT_S
                ):
                    continue  # may not have named itself yet: read it again next tick
                self.seen.add(tid)
                self.pending.pop(tid, None)
            self.seen &= now  # ended threads (their ids may come back for new ones)
            self.pending = {t: s for t, s in self.pending.items() if t in now}
