"""``python -m dmlbook.bench launch``: what starting ranks costs (the launcher every chapter uses).

* The wall time from the call to the results of one all-reduce on N new ranks: ranks forked from
  :func:`dmlbook.launch.run`'s warm helper (the default), ranks as fresh interpreters
  (``DMLBOOK_START=spawn``), and torch's ``mp.spawn`` around the same rank function.
* The tail: 200 launches at world size 4, their median, p95, slowest and how many took over 1 s
  (the goal is none; a TCPStore rendezvous stalled about one in ten for 5 s, see
  :func:`dmlbook.runtime.rank_group.rendezvous_env`), and the start of a ``Ranks`` session.
* What the private network costs (:mod:`dmlbook.runtime.private_net`: each run's ranks in a user
  and network namespace of their own): launches at world size 4 and ``Ranks(4)`` starts with it
  and without it (``DMLBOOK_PRIVATE_NET=0``), interleaved one by one so that a shared machine's
  load falls on both alike, and the time to make one namespace pair.
* The memory one learner's live ranks cost, as PSS (``/proc/PID/smaps_rollup``: shared pages
  split among the processes that share them, so the figures add up): the caller, the helper
  (with the small process that makes each run's network) and each rank of a ``Ranks`` session
  at world sizes 2 and 4. Ranks fork from the helper and share its copy of torch, which RSS
  would count once per process.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmlbook.bench.common import load_average, one_all_reduce, report_ratio
from dmlbook.launch import Ranks, free_port, run, threads_per_rank
from dmlbook.runtime import private_net, zygote
from dmlbook.runtime.rank_group import RankGroup

TAIL_LAUNCHES = 200
TAIL_WORLD_SIZE = 4
SLOW_S = 1.0


def _torch_spawn_rank(rank: int, world_size: int, port: int) -> None:
    # What torch's own spawn needs around the same rank function: env, init, destroy.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    one_all_reduce()
    dist.destroy_process_group()


def bench_launch(repeats: int = 5) -> list[dict]:
    """Every figure of this module: the comparison, the tail, a session's start, the memory;
    returned as records (``what`` says which)."""
    print(load_average())
    records = [dict(what="launch vs mp.spawn", **r) for r in bench_launch_vs_torch(repeats)]
    records.append(dict(what="launch tail", world_size=TAIL_WORLD_SIZE, **bench_launch_tail()))
    records += [dict(what="Ranks start", **r) for r in bench_session_start(repeats)]
    records.append(dict(what="private network", world_size=TAIL_WORLD_SIZE, **bench_private_net()))
    records += [dict(what="memory (PSS, MiB)", **r) for r in bench_memory()]
    return records


def bench_launch_vs_torch(repeats: int = 5) -> list[dict]:
    """Wall time from the call to the results of one all-reduce on N new ranks: ranks forked
    from the warm helper (the default), ranks as fresh interpreters (``DMLBOOK_START=spawn``),
    and torch's ``mp.spawn``, interleaved."""
    os.environ.pop("DMLBOOK_START", None)  # the default first, then spawn explicitly
    run(one_all_reduce, 1)  # the helper starts once per caller; its start is not a launch
    records = []
    for world_size in (2, 4):
        forked, spawned, theirs = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            run(one_all_reduce, world_size)
            forked.append(time.perf_counter() - start)
            os.environ["DMLBOOK_START"] = "spawn"
            try:
                start = time.perf_counter()
                run(one_all_reduce, world_size)
                spawned.append(time.perf_counter() - start)
            finally:
                del os.environ["DMLBOOK_START"]
            start = time.perf_counter()
            mp.spawn(_torch_spawn_rank, args=(world_size, free_port()), nprocs=world_size)
            theirs.append(time.perf_counter() - start)
        records.append(
            report_ratio(f"launch + all-reduce, {world_size} ranks, forked", forked, theirs)
        )
        name = f"launch + all-reduce, {world_size} ranks, spawned"
        records.append(report_ratio(name, spawned, theirs))
    return records


def bench_launch_tail(launches: int = TAIL_LAUNCHES, world_size: int = TAIL_WORLD_SIZE) -> dict:
    """``launches`` launches of one all-reduce at ``world_size``: median, p95, max, over 1 s."""
    run(one_all_reduce, 1)  # a helper that is already up
    times = []
    for _ in range(launches):
        start = time.perf_counter()
        run(one_all_reduce, world_size)
        times.append(time.perf_counter() - start)
    times.sort()
    figures = dict(
        median=statistics.median(times),
        p95=times[min(len(times) - 1, round(0.95 * len(times)) - 1)],
        slowest=times[-1],
        over_1s=sum(t > SLOW_S for t in times),
        launches=launches,
    )
    print(
        f"launch + all-reduce, {world_size} ranks, {launches} launches: median "
        f"{figures['median']:.3f} s, p95 {figures['p95']:.3f} s, "
        f"slowest {figures['slowest']:.3f} s, over {SLOW_S:g} s: {figures['over_1s']}"
        f"   ({load_average()})"
    )
    return figures


def bench_session_start(repeats: int = 5) -> list[dict]:
    """From ``Ranks(N)`` to ranks that answer (their process group is up), then close."""
    run(one_all_reduce, 1)  # a helper that is already up: its own start is not the session's
    records = []
    for world_size in (2, 4):
        starts = []
        for _ in range(repeats):
            start = time.perf_counter()
            with Ranks(world_size) as session:
                starts.append(time.perf_counter() - start)
                session.exec("t = torch.ones(1); dist.all_reduce(t)")
        print(
            f"Ranks({world_size}) start: median {statistics.median(starts):.3f} s,"
            f" slowest {max(starts):.3f} s over {repeats}"
        )
        records.append(
            dict(world_size=world_size, median=statistics.median(starts), slowest=max(starts))
        )
    return records


def bench_private_net(launches: int = 60, starts: int = 15, world_size: int = TAIL_WORLD_SIZE):
    """Launches of one all-reduce and ``Ranks`` starts at ``world_size``, each with the private
    network and without it (``DMLBOOK_PRIVATE_NET=0``), alternating; and the time to make one
    user and network namespace pair (what the private network adds to a start)."""
    run(one_all_reduce, 1)  # a helper that is already up
    saved = os.environ.get(private_net.SWITCH)
    times: dict[str, dict[str, list[float]]] = {"launch": {}, "start": {}}
    try:
        for i in range(2 * max(launches, starts)):
            switch = "01"[i % 2]
            os.environ[private_net.SWITCH] = switch
            if i // 2 < launches:
                start = time.perf_counter()
                run(one_all_reduce, world_size)
                times["launch"].setdefault(switch, []).append(time.perf_counter() - start)
            if i // 2 < starts:
                start = time.perf_counter()
                with Ranks(world_size):
                    times["start"].setdefault(switch, []).append(time.perf_counter() - start)
        os.environ[private_net.SWITCH] = "1"
        group, making = RankGroup(1, "gloo", 60.0), []
        try:
            for _ in range(launches):
                start = time.perf_counter()
                made = group.make_network()
                making.append(time.perf_counter() - start)
                made.close()
        finally:
            group.close()
    finally:
        if saved is None:
            os.environ.pop(private_net.SWITCH, None)
        else:
            os.environ[private_net.SWITCH] = saved
    figures = {
        f"{what}_{'private' if switch == '1' else 'shared'}_median": statistics.median(values)
        for what, by_switch in times.items()
        for switch, values in by_switch.items()
    }
    figures["make_namespaces_median"] = statistics.median(making)
    if made.refused:
        print(f"private network: refused here ({made.refused}); both columns are the same setup")
    print(
        f"private network, {world_size} ranks: launch median "
        f"{figures['launch_private_median']:.3f} s vs {figures['launch_shared_median']:.3f} s "
        f"without ({figures['launch_private_median'] / figures['launch_shared_median']:.2f}x), "
        f"Ranks start {figures['start_private_median']:.3f} s vs "
        f"{figures['start_shared_median']:.3f} s "
        f"({figures['start_private_median'] / figures['start_shared_median']:.2f}x); "
        f"making the namespaces: median {1e3 * figures['make_namespaces_median']:.1f} ms"
        f"   ({load_average()})"
    )
    return figures


def pss_mib(pid: int) -> float | None:
    """A process's proportional set size in MiB (Linux), None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _makers(ranks: set[int]) -> list[int]:
    """The helper's children that are not ranks: the process that makes each run's network."""
    pid = zygote.helper().process.pid
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children if int(c) not in ranks]


def bench_memory() -> list[dict]:
    """PSS of the caller, the helper and each rank while a ``Ranks`` session is live."""
    records = []
    for world_size in (2, 4):
        with Ranks(world_size) as session:
            # what a chapter's cell leaves behind: a process group that has run a collective
            session.exec("t = torch.ones(1 << 10); dist.all_reduce(t)")
            ranks = [pss_mib(s.pid) for s in session.status()]
            helper = pss_mib(zygote.helper().process.pid) if zygote.enabled() else None
            if helper is not None:  # with the small process that makes each run's network
                helper += sum(
                    pss_mib(pid) or 0.0 for pid in _makers({s.pid for s in session.status()})
                )
            caller = pss_mib(os.getpid())
        if None in ranks or caller is None:
            print("memory: /proc/PID/smaps_rollup is not readable here (Linux only)")
            return records
        total = caller + (helper or 0.0) + sum(ranks)
        print(
            f"memory (PSS), Ranks({world_size}) live: caller {caller:.0f} MiB, helper "
            f"{helper or 0:.0f} MiB, ranks {' + '.join(f'{r:.0f}' for r in ranks)} MiB;"
            f" one learner {total:.0f} MiB"
        )
        records.append(
            dict(world_size=world_size, caller=caller, helper=helper, ranks=ranks, total=total)
        )
    return records
