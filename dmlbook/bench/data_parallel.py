"""``python -m dmlbook.bench data-parallel``: chapter 1's gradient averaging against torch's DDP.

The median step time of :func:`dmlbook.data_parallel.average_gradients` (one all-reduce per
parameter, after backward) against torch's bucketed, overlapped DDP, on MLPs of two widths.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook.bench.common import _report
from dmlbook.launch import run
from dmlbook.models import mlp


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
