"""Benchmarks: each teaching implementation against torch's own, measured in the same run.

    python -m dmlbook.bench launch           # dmlbook.launch.run vs torch.multiprocessing.spawn
    python -m dmlbook.bench ranks            # a %%ranks cell on persistent ranks vs launch.run
    python -m dmlbook.bench data-parallel    # average_gradients vs torch DDP, time per step
    python -m dmlbook.bench ddp --world-size 2 --json out.json
                                             # BucketedDDP and NaiveDDP vs torch DDP, per step
    python -m dmlbook.bench allreduce --world-size 2 --sizes 64KiB,1MiB,16MiB,64MiB --json out.json
                                             # every collectives.all_reduce algorithm vs gloo/NCCL
    python -m dmlbook.bench recompute --json out.json
                                             # activation memory saved and step time overhead
    python -m dmlbook.bench pipeline --json out.json
                                             # vanilla / GPipe / 1F1B step time and bubble vs
                                             # torch.distributed.pipelining, 2 stages
    python -m dmlbook.bench netlab           # TCP over a shaped netlab link vs its setting (root)
    python -m dmlbook.bench composed --json out.json
                                             # chapter 13's step at world size 8: memory and
                                             # bytes per dimension, measured / predicted
    python -m dmlbook.bench all

Every line prints the median of several repeats for both sides and their ratio (ours / torch's).
These are measurements, never assertions: the tests check correctness only. Take timing claims
at world size <= the number of cores (2 on the reference laptop).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmlbook import data_parallel as dp
from dmlbook.comm import collectives
from dmlbook.launch import device, free_port, run, threads_per_rank
from dmlbook.models import char_gpt, mlp


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


def bench_launch(repeats: int = 5) -> None:
    """Wall time from the call to the results of one all-reduce on N new ranks: ranks forked
    from the warm helper (the default), ranks as fresh interpreters (``DMLBOOK_START=spawn``),
    and torch's ``mp.spawn``, interleaved."""
    os.environ.pop("DMLBOOK_START", None)  # the default first, then spawn explicitly
    run(_one_all_reduce, 1)  # the helper starts once per caller; its start is not a launch
    for world_size in (2, 4):
        forked, spawned, theirs = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            run(_one_all_reduce, world_size)
            forked.append(time.perf_counter() - start)
            os.environ["DMLBOOK_START"] = "spawn"
            try:
                start = time.perf_counter()
                run(_one_all_reduce, world_size)
                spawned.append(time.perf_counter() - start)
            finally:
                del os.environ["DMLBOOK_START"]
            start = time.perf_counter()
            mp.spawn(_torch_spawn_rank, args=(world_size, free_port()), nprocs=world_size)
            theirs.append(time.perf_counter() - start)
        _report(f"launch + all-reduce, {world_size} ranks, forked", forked, theirs)
        _report(f"launch + all-reduce, {world_size} ranks, spawned", spawned, theirs)


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


# --------------------------------------------------------------------------- DDP (chapter 3)

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
        f"{_load_average()}"
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
    _write_json(records, json_path)
    return records


# --------------------------------------------------------------------------- all-reduce

_UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6}


def parse_size(text: str) -> int:
    """'64KiB' -> 65536, '1MiB' -> 1048576, '1000' -> 1000 (bytes)."""
    t = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit) and t[: -len(unit)].strip():
            return int(float(t[: -len(unit)]) * _UNITS[unit])
    return int(t)


def time_all_reduces(sizes: list[int], repeats: int, warmup: int, check: bool) -> list[dict]:
    """On every rank: for each size, time each algorithm and torch's all_reduce, interleaved
    repeat by repeat. Every run starts after a barrier; the slowest rank's time is the run's."""
    dev = device()
    contenders = [*collectives.ALGORITHMS, "torch"]
    records = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
        times = {name: [] for name in contenders}
        for i in range(warmup + repeats):
            for name in contenders:
                dist.barrier()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if name == "torch":
                    dist.all_reduce(tensor)
                else:
                    collectives.all_reduce(tensor, algorithm=name, check=check)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if i >= warmup:
                    times[name].append(elapsed.item())
                tensor.fill_(1.0)  # keep the values bounded across repeats
        records.append({name: statistics.median(t) for name, t in times.items()})
    return records


def bench_allreduce(
    world_size: int = 2,
    sizes: tuple[int, ...] = (64 << 10, 1 << 20, 16 << 20, 64 << 20),
    repeats: int = 15,
    warmup: int = 3,
    check: bool = False,
    json_path: str | None = None,
) -> list[dict]:
    """Median time of each dmlbook all-reduce algorithm against torch's, at each message size.

    ``busbw_GBps`` follows nccl-tests: bytes x 2(p-1)/p / time, the rate each rank's link moved.
    The shape check (one extra round) is off unless ``check``; torch's all_reduce has none.
    """
    measured = run(time_all_reduces, world_size, list(sizes), repeats, warmup, check, timeout=600)[
        0
    ]
    records = []
    print(
        f"all_reduce, float32, world size {world_size}, median of {repeats} "
        f"(slowest rank), baseline torch.distributed.all_reduce"
    )
    print(
        f"{'algorithm':>20s} {'bytes':>10s} {'median':>10s} {'torch':>10s} {'ratio':>6s} "
        f"{'busbw GB/s':>10s}"
    )
    for nbytes, times in zip(sizes, measured, strict=True):
        for algorithm in collectives.ALGORITHMS:
            median_s, baseline = times[algorithm], times["torch"]
            busbw = nbytes * 2 * (world_size - 1) / world_size / median_s / 1e9
            records.append(
                {
                    "algorithm": algorithm,
                    "world_size": world_size,
                    "bytes": nbytes,
                    "median_s": median_s,
                    "baseline_median_s": baseline,
                    "ratio": median_s / baseline,
                    "busbw_GBps": busbw,
                }
            )
            print(
                f"{algorithm:>20s} {_human(nbytes):>10s} {1e3 * median_s:8.3f}ms "
                f"{1e3 * baseline:8.3f}ms {median_s / baseline:5.2f}x {busbw:10.2f}"
            )
    _write_json(records, json_path)
    return records


def _write_json(records: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {path}")


def _load_average() -> str:
    """Timings on a shared box mean little without it."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start"


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


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


# --------------------------------------------------------------------------- recomputation


def bench_recompute(repeats: int = 10, json_path: str | None = None) -> list[dict]:
    """Checkpointing at sqrt(n) segments, ours and torch.utils.checkpoint's, against none:
    activation bytes saved (counted) and step-time overhead (median of ``repeats``)."""
    from dmlbook.model_parallel import recompute

    records = recompute.benchmark(repeats=repeats)
    print(f"recomputation at sqrt(n) segments, median of {repeats} steps, {_load_average()}")
    for r in records:
        print(
            f"{r['model']:9s} {r['implementation']:6s} {r['segments']:2d} of {r['layers']:2d} "
            f"segments: {100 * r['activation_bytes_saved_fraction']:5.1f}% less activation "
            f"memory, {100 * r['time_overhead_fraction']:+6.1f}% step time"
        )
    _write_json(records, json_path)
    return records


# --------------------------------------------------------------------------- pipeline (ch. 6)


def _pipeline_step_times(
    cases: list[tuple[str, int]],
    steps: int,
    warmup: int,
    width: int,
    depth: int,
    batch: int,
    versus_torch: bool,
) -> dict:
    """On every stage: step times of our schedules and torch's, interleaved round by round.

    The model is ``depth`` Linear(width, width) layers (ReLU between) split evenly, so every
    stage does the same work and an op's compute dwarfs its messages. Each step starts after a
    barrier; its time is the slowest stage's. Our steps also return this stage's timeline.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dmlbook.model_parallel import pipeline as pp

    rank, stages, dev = dist.get_rank(), dist.get_world_size(), device()
    model = mlp(seed=0, in_features=width, hidden=(width,) * (depth - 1), out_features=width)
    module = pp.split_model(pp.layers_of(model), pp.even_partition(depth, stages))[rank].to(dev)
    ours = pp.PipelineStage(module, rank, stages, device=dev)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(batch, width, generator=g).to(dev) for _ in range(2))
    loss_fn = torch.nn.functional.mse_loss
    theirs = {}  # torch's counterpart: vanilla is GPipe with one micro-batch
    for schedule, microbatches in cases if versus_torch else []:
        kind = {"vanilla": ScheduleGPipe, "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        stage = PipelineStage(module, rank, stages, dev)
        theirs[schedule, microbatches] = kind(stage, microbatches, loss_fn=loss_fn)

    def torch_step(schedule, microbatches):
        runner = theirs[schedule, microbatches]
        if rank == 0:
            runner.step(x)
        elif rank == stages - 1:
            runner.step(target=y)
        else:
            runner.step()

    def timed(step, *args) -> tuple[float, object]:
        module.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        result = step(*args)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest stage's time
        return elapsed.item(), result

    out = {case: {"ours": [], "torch": [], "timelines": []} for case in cases}
    for i in range(warmup + steps):
        for case in cases[i % len(cases) :] + cases[: i % len(cases)]:  # rotate the order
            ours_s, result = timed(ours.train_step, x, y, loss_fn, case[1], case[0])
            torch_s, _ = timed(torch_step, *case) if versus_torch else (math.nan, None)
            if i >= warmup:
                out[case]["ours"].append(ours_s)
                out[case]["torch"].append(torch_s)
                out[case]["timelines"].append(result.timeline)
    return out


def bench_pipeline(
    stages: int = 2,
    microbatches: tuple[int, ...] = (2, 4, 8),
    steps: int = 10,
    warmup: int = 2,
    width: int = 1024,
    depth: int = 8,
    batch: int = 256,
    json_path: str | None = None,
    versus_torch: bool = True,
    schedules: tuple[str, ...] = ("gpipe", "1f1b"),
) -> list[dict]:
    """Our vanilla, GPipe and 1F1B pipelines against torch.distributed.pipelining's schedules.

    Per schedule and micro-batch count: the median step time, the median measured bubble
    (idle fraction of the stages' timelines) beside the theory (P-1)/(M+P-1), and the step time
    over torch's on the same stage module (vanilla is set against torch's GPipe with M = 1;
    ``ratio_vs_torch`` is None without ``versus_torch``).
    """
    from dmlbook.model_parallel import pipeline as pp

    cases = [("vanilla", 1)] + [(s, m) for s in schedules for m in microbatches]
    measured = run(
        _pipeline_step_times,
        stages,
        cases,
        steps,
        warmup,
        width,
        depth,
        batch,
        versus_torch,
        timeout=600,
    )
    print(
        f"pipeline step, {stages} stages, MLP {depth} x Linear({width}, {width}), batch {batch}, "
        f"median of {steps} steps (slowest stage), {_load_average()}\n"
        "bubble: measured idle fraction; packed: the same op times with instant messages"
    )
    print(
        f"{'schedule':>8s} {'M':>3s} {'median':>10s} {'bubble':>7s} {'packed':>7s} "
        f"{'theory':>7s} " + (f"{'torch':>10s} {'vs torch':>8s}" if versus_torch else "")
    )
    records = []
    for case in cases:
        schedule, m = case
        step_s = statistics.median(measured[0][case]["ours"])
        torch_s = statistics.median(measured[0][case]["torch"])  # nan without versus_torch
        ratio = step_s / torch_s if versus_torch else None
        per_step = list(zip(*(measured[r][case]["timelines"] for r in range(stages)), strict=True))
        bubble = statistics.median(pp.measured_bubble(timelines) for timelines in per_step)
        # the same op durations with instant messages: what is left of the gap to the theory
        packed = statistics.median(pp.measured_bubble(pp.packed_timelines(t)) for t in per_step)
        theory = pp.bubble_theory(stages, m)
        records.append(
            {
                "schedule": schedule,
                "stages": stages,
                "microbatches": m,
                "median_step_s": step_s,
                "bubble_measured": bubble,
                "bubble_theory": theory,
                "ratio_vs_torch": ratio,
            }
        )
        print(
            f"{schedule:>8s} {m:3d} {1e3 * step_s:8.1f}ms {bubble:7.3f} {packed:7.3f} "
            f"{theory:7.3f} " + (f"{1e3 * torch_s:8.1f}ms {ratio:7.2f}x" if versus_torch else "")
        )
    _write_json(records, json_path)
    return records


BENCHES = (
    "launch",
    "ranks",
    "data-parallel",
    "ddp",
    "allreduce",
    "recompute",
    "pipeline",
    "netlab",
    "composed",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("which", choices=[*BENCHES, "all"])
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB,64MiB", help="allreduce sizes")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per size (allreduce)")
    parser.add_argument("--check", action="store_true", help="allreduce: keep the shape check")
    parser.add_argument(
        "--json",
        help="ranks, allreduce, ddp, recompute, pipeline, composed: write the records to this file",
    )
    parser.add_argument("--models", default=",".join(DDP_MODELS), help="ddp: models to time")
    parser.add_argument("--steps", type=int, default=50, help="ddp: timed steps per model")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="ddp: bucket size")
    args = parser.parse_args(argv)
    every = args.which == "all"
    if every or args.which == "launch":
        bench_launch()
    if every or args.which == "ranks":
        from dmlbook.bench_ranks import bench_ranks

        _write_json(bench_ranks(), args.json if args.which == "ranks" else None)
    if every or args.which == "data-parallel":
        bench_data_parallel(args.world_size)
    if every or args.which == "ddp":
        models = tuple(args.models.split(","))
        json_path = args.json if args.which == "ddp" else None
        bench_ddp(args.world_size, models, args.steps, 5, args.bucket_cap_mb, json_path)
    if every or args.which == "allreduce":
        sizes = tuple(parse_size(s) for s in args.sizes.split(","))
        bench_allreduce(args.world_size, sizes, args.repeats, check=args.check, json_path=args.json)
    if every or args.which == "recompute":
        bench_recompute(json_path=args.json if args.which == "recompute" else None)
    if every or args.which == "pipeline":
        bench_pipeline(json_path=args.json if args.which == "pipeline" else None)
    if every or args.which == "netlab":
        bench_netlab()
    if every or args.which == "composed":
        from dmlbook.bench_composed import bench_composed

        bench_composed(json_path=args.json if args.which == "composed" else None)


if __name__ == "__main__":
    main()
