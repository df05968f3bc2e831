"""Benchmarks: each teaching implementation against torch's own, measured in the same run.

    python -m dmlbook.bench launch           # dmlbook.launch.run vs torch.multiprocessing.spawn
    python -m dmlbook.bench data-parallel    # average_gradients vs torch DDP, time per step
    python -m dmlbook.bench netlab           # TCP over a shaped netlab link vs its setting (root)
    python -m dmlbook.bench all

Every line prints the median of several repeats for both sides and their ratio (ours / torch's).
These are measurements, never assertions: the tests check correctness only. Take timing claims
at world size <= the number of cores (2 on the reference laptop).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmlbook import data_parallel as dp
from dmlbook.launch import run, threads_per_rank
from dmlbook.models import mlp


def _report(name: str, ours: list[float], theirs: list[float], unit: str = "s") -> float:
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{name:38s} ours {a:8.3f} {unit}   torch {b:8.3f} {unit}   ratio {a / b:5.2f}x")
    return a / b


# --------------------------------------------------------------------------- launch latency


def _one_all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _torch_spawn_rank(rank: int, world_size: int, port: int) -> None:
    # What torch's own spawn needs around the same rank function: env, init, destroy.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    _one_all_reduce()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_launch(repeats: int = 5) -> None:
    """Wall time from the call to the results of one all-reduce on N fresh ranks."""
    for world_size in (2, 4):
        ours, theirs = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            run(_one_all_reduce, world_size)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            mp.spawn(_torch_spawn_rank, args=(world_size, _free_port()), nprocs=world_size)
            theirs.append(time.perf_counter() - start)
        _report(f"launch + 1 all-reduce, world size {world_size}", ours, theirs)


# --------------------------------------------------------------------------- data parallel


def _step_times(steps: int, hidden: int) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def time_steps(model, sync) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            sync(model)
            opt.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    make = lambda: mlp(seed=0, in_features=256, hidden=(hidden, hidden), out_features=10)
    ours = time_steps(make(), dp.average_gradients)
    ddp = DDP(make())
    theirs = time_steps(ddp, lambda m: None)  # DDP averaged during backward
    del ddp  # before the group goes away (pytorch#56297)
    return {"ours": ours, "torch": theirs}


def bench_data_parallel(world_size: int = 2, steps: int = 30) -> None:
    """Median step time of naive per-parameter averaging vs torch's bucketed, overlapped DDP."""
    for hidden in (256, 1024):
        results = run(_step_times, world_size, steps, hidden, timeout=300)
        ours = [r["ours"] for r in results]
        theirs = [r["torch"] for r in results]
        name = f"DP step, MLP {hidden}x2, world size {world_size}"
        _report(name, [1e3 * t for t in ours], [1e3 * t for t in theirs], unit="ms")


# --------------------------------------------------------------------------- network lab


def bench_netlab(settings: tuple[str, ...] = ("100mbit", "300mbit", "1gbit")) -> None:
    """One TCP stream between two netlab hosts against the rate the link is shaped to."""
    from dmlbook import netlab

    if reason := netlab.available():
        print(f"netlab: skipped ({reason})")
        return
    for rate in settings:
        with netlab.Lab(2, bandwidth=rate, prefix="bench") as lab:
            runs = [netlab.tcp_throughput(lab, "h0", "h1", seconds=1.5) for _ in range(3)]
        measured, target = statistics.median(runs) / 1e6, netlab.parse_rate(rate) / 1e6
        print(
            f"netlab TCP over a {rate:>8s} link          measured {measured:7.1f} Mbit/s   "
            f"setting {target:7.1f} Mbit/s   ratio {measured / target:5.2f}x"
        )


BENCHES = {"launch": bench_launch, "data-parallel": bench_data_parallel, "netlab": bench_netlab}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dmlbook.bench", description=__doc__)
    parser.add_argument("which", choices=[*BENCHES, "all"])
    args = parser.parse_args(argv)
    for name, bench in BENCHES.items():
        if args.which in (name, "all"):
            bench()


if __name__ == "__main__":
    main()
