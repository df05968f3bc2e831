"""``python -m dmlbook.bench ddp``: chapter 3's BucketedDDP and NaiveDDP against torch's DDP.

The median step time (forward, backward, SGD step; the slowest rank's) of each DDP on the same
models and data, interleaved step by step: a deep, narrow MLP of many small gradients, where
bucketing pays, a char-GPT, and a wide MLP of a few large ones.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook.bench.common import load_average, write_json
from dmlbook.comm.groups import device
from dmlbook.launch import run
from dmlbook.models import char_gpt, mlp

# name -> (what it is, model factory, batch factory (rank seeds it), loss)
DDP_MODELS = {
    "deep-mlp": (
        "MLP, 64 layers of 64, batch 64: 128 small tensors, 1 MB",
        lambda: mlp(seed=0, in_features=64, hidden=(64,) * 63, out_features=10),
        lambda g: (torch.randn(64, 64, generator=g), torch.randint(10, (64,), generator=g)),
        lambda model, x, y: torch.nn.functional.cross_entropy(model(x), y),
    ),
    "gpt": (
        "CharGPT, 4 layers of 256, batch 4 x 32 tokens: 53 tensors, 13 MB",
        lambda: char_gpt(65, seed=0, block_size=64, n_layer=4, n_head=4, n_embd=256),
        lambda g: tuple(torch.randint(65, (2, 4, 32), generator=g)),
        lambda model, idx, targets: model(idx, targets)[1],
    ),
    "wide-mlp": (
        "MLP 1024 -> 4 x 2048 -> 10, batch 32: 10 tensors, 59 MB",
        lambda: mlp(seed=0, in_features=1024, hidden=(2048,) * 4, out_features=10),
        lambda g: (torch.randn(32, 1024, generator=g), torch.randint(10, (32,), generator=g)),
        lambda model, x, y: torch.nn.functional.cross_entropy(model(x), y),
    ),
}
DDP_IMPLEMENTATIONS = ("bucketed", "naive", "torch")


def _ddp_step_times(model_name: str, steps: int, warmup: int, bucket_cap_mb: float) -> dict:
    """On every rank: the step time of each DDP on one model, interleaved step by step.

    Each round times one step of every implementation (in a rotating order), each after a
    barrier; a step's time is the slowest rank's. Returns medians over the rounds after warm-up.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, build, make_batch, loss_fn = DDP_MODELS[model_name]
    dev = device()
    batch = [t.to(dev) for t in make_batch(torch.Generator().manual_seed(dist.get_rank()))]
    wrappers = {
        "bucketed": dp.BucketedDDP(build().to(dev), bucket_cap_mb=bucket_cap_mb),
        "naive": dp.NaiveDDP(build().to(dev)),
        "torch": DDP(build().to(dev), bucket_cap_mb=bucket_cap_mb),
    }
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in wrappers.items()}
    times: dict[str, list[float]] = {name: [] for name in wrappers}
    for i in range(warmup + steps):
        order = DDP_IMPLEMENTATIONS[i % 3 :] + DDP_IMPLEMENTATIONS[: i % 3]
        for name in order:
            model, opt = wrappers[name], opts[name]
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = loss_fn(model, *batch)  # compute
            opt.zero_grad(set_to_none=True)
            loss.backward()  # compute and communication
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i >= warmup:
                times[name].append(elapsed.item())
    stats = wrappers["bucketed"].stats
    result = {name: statistics.median(t) for name, t in times.items()}
    result["buckets"] = stats.collectives // max(1, stats.syncs)
    result["parameters"] = sum(1 for _ in wrappers["torch"].parameters())
    del wrappers, opts  # free torch's DDP before the group goes away (pytorch#56297)
    return result


def bench_ddp(
    world_size: int = 2,
    models: tuple[str, ...] = tuple(DDP_MODELS),
    steps: int = 50,
    warmup: int = 5,
    bucket_cap_mb: float = 25.0,
    json_path: str | None = None,
) -> list[dict]:
    """Median step time of BucketedDDP and NaiveDDP against torch's DDP, same model and data.

    The deep, narrow MLP has many small gradients: naive DDP pays one all-reduce latency per
    tensor, bucketed DDP one per bucket. Both bucketed DDPs get the same ``bucket_cap_mb``.
    """
    print(
        f"DDP step (forward, backward, SGD step), world size {world_size}, median of {steps} "
        f"steps after {warmup} warm-up (slowest rank), bucket_cap_mb={bucket_cap_mb:g}, "
        f"{load_average()}"
    )
    print(f"{'model':>9s} {'implementation':>15s} {'median':>10s} {'vs torch':>8s}  collectives")
    records = []
    for name in models:
        measured = run(
            _ddp_step_times, world_size, name, steps, warmup, bucket_cap_mb, timeout=600
        )[0]
        baseline = measured["torch"]
        for impl in DDP_IMPLEMENTATIONS:
            median_s = measured[impl]
            collectives = {
                "bucketed": f"{measured['buckets']} per step (buckets)",
                "naive": f"{measured['parameters']} per step (one per parameter)",
                "torch": "torch's buckets",
            }[impl]
            records.append(
                {
                    "implementation": impl,
                    "world_size": world_size,
                    "median_step_s": median_s,
                    "ratio_vs_torch": median_s / baseline,
                    "model": name,
                    "bucket_cap_mb": bucket_cap_mb,
                }
            )
            print(
                f"{name:>9s} {impl:>15s} {1e3 * median_s:8.2f}ms {median_s / baseline:7.2f}x  "
                f"{collectives}"
            )
        print(f"{'':>9s} ({DDP_MODELS[name][0]})")
    write_json(records, json_path)
    return records
