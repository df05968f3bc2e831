"""``python -m dmlbook.bench data-parallel``: chapter 1's gradient averaging against torch's DDP.

The median step time of :func:`dmlbook.data_parallel.average_gradients` (one flat buffer, one
all-reduce, after backward) and of the naive
:func:`~dmlbook.data_parallel.average_gradients_per_parameter` (one all-reduce per parameter)
against torch's bucketed, overlapped DDP, on MLPs of two widths. The three take their steps in
turn, so that a busy machine slows all three alike; the slowest rank's time is a step's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook.bench.common import report_ratio
from dmlbook.launch import run
from dmlbook.models import mlp


def _step_times(steps: int, hidden: int) -> dict[str, list[float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def make():
        return mlp(seed=0, in_features=256, hidden=(hidden, hidden), out_features=10)

    ddp = DDP(make())
    contenders = {  # name -> (model, what runs after backward)
        "flat": (make(), dp.average_gradients),
        "per_parameter": (make(), dp.average_gradients_per_parameter),
        "torch": (ddp, lambda m: None),  # DDP averaged during backward
    }
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, (m, _) in contenders.items()}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(steps + 2):
        for name, (model, sync) in contenders.items():
            dist.barrier()
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizers[name].zero_grad()
            loss.backward()
            sync(model)
            optimizers[name].step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i >= 2:
                times[name].append(elapsed.item())
    del ddp, contenders  # before the group goes away (pytorch#56297)
    return times


def bench_data_parallel(world_size: int = 2, steps: int = 40) -> list[dict]:
    """Median step time of flat and per-parameter averaging vs torch's DDP; returns records."""
    records = []
    for hidden in (256, 1024):
        times = run(_step_times, world_size, steps, hidden, timeout=300)[0]
        ms = {name: [1e3 * t for t in ts] for name, ts in times.items()}
        for name in ("flat", "per_parameter"):
            label = f"DP step, {name}, MLP {hidden}x2, ws {world_size}"
            record = report_ratio(label, ms[name], ms["torch"], unit="ms")
            pairs = sorted(a / b for a, b in zip(ms[name], ms["torch"], strict=True))
            q = statistics.quantiles(pairs, n=4)
            print(f"{'':38s} step by step ratio: quartiles {q[0]:.2f}-{q[2]:.2f}x")
            records.append(
                dict(record, averaging=name, hidden=hidden, world_size=world_size, ratio_iqr=q)
            )
    return records
