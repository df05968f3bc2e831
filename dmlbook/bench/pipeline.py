"""``python -m dmlbook.bench pipeline``: chapter 6's pipeline schedules against torch's.

Our vanilla, GPipe and 1F1B schedules (:mod:`dmlbook.model_parallel.pipeline`) against
``torch.distributed.pipelining``'s on the same stage modules: step time, and the measured bubble
beside the theory (P-1)/(M+P-1). Chapter 6 runs :func:`bench_pipeline` on a small model.
Beyond the book, in the same run, :func:`bench_schedules` sets 1F1B, interleaved 1F1B and ZB-H1
side by side at P = 2 and 4, M = 4 and 8: their bubble (theory, measured, packed), and step time
and peak activation memory beside torch's ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` on the same model, whose losses must equal ours.

Chapter 6's timed runs use :func:`schedule_steps`, a rank function that builds this rank's stage
and runs a few steps of each schedule, recording how long each forward waited for a CPU; then
:func:`median_step` and :func:`least_idle` pick steps out of what it returned.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from dmlbook.bench.common import load_average, write_json
from dmlbook.comm.groups import device
from dmlbook.cpu_wait import cpu_wait_in_burst
from dmlbook.launch import run
from dmlbook.models import mlp


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

    out = {case: {"ours": [], "torch": [], "timelines": [], "wait": []} for case in cases}
    before = cpu_wait_in_burst()  # did every stage have a core of its own, before and after?
    for i in range(warmup + steps):
        for case in cases[i % len(cases) :] + cases[: i % len(cases)]:  # rotate the order
            ours_s, result = timed(ours.train_step, x, y, loss_fn, case[1], case[0])
            torch_s, _ = timed(torch_step, *case) if versus_torch else (math.nan, None)
            if i >= warmup:
                out[case]["ours"].append(ours_s)
                out[case]["torch"].append(torch_s)
                out[case]["timelines"].append(result.timeline)
                out[case]["wait"].append(result.wait_s)
    out["cores_busy"] = max(before, cpu_wait_in_burst())
    out["message_s"] = {m: one_message_s(batch // m, width, dev) for _, m in cases}
    return out


def schedule_steps(make_model, loss_fn, batch, cases, steps=4, measure_memory=False) -> dict:
    """On each rank of a launch: build this rank's stage of ``make_model()`` (an even split), then
    run ``steps`` training steps of each ``(schedule, microbatches)`` in ``cases``. Returns, per
    case, each step's :class:`StepResult`, with ``forward_waits``: the seconds each forward's thread
    spent ready to run but without a CPU (Linux's scheduler statistics), to tell the stage's work
    from other work on the machine, and ``op_cpu``: per op of ``timeline``, in the same order, the
    seconds of CPU time its thread used (``time.thread_time``, which stops while the thread sleeps
    in a receive or waits for a core). The ranks compute on one thread each, so that is the op's
    own work."""
    from dmlbook.cpu_wait import thread_cpu_wait_s as wait_s
    from dmlbook.model_parallel import pipeline as pp

    rank, stages = dist.get_rank(), dist.get_world_size()
    layers = pp.layers_of(make_model())
    module = pp.split_model(layers, pp.even_partition(len(layers), stages))[rank]
    stage = pp.PipelineStage(module, rank, stages)
    waited = []
    module.register_forward_pre_hook(lambda m, args: waited.append(wait_s()))
    module.register_forward_hook(lambda m, args, y: waited.append(wait_s() - waited.pop()))
    cpu = []
    for name in ("forward", "backward", "backward_weight"):  # each op's CPU time, beside its
        op = getattr(stage, name)  # wall-clock record

        def timed(*args, op=op):  # (micro-batch) or, with model chunks, (micro-batch, chunk)
            start = time.thread_time()
            op(*args)
            cpu.append(time.thread_time() - start)

        setattr(stage, name, timed)  # run_schedule calls self.forward / self.backward
    out = {}
    for schedule, microbatches in cases:
        out[schedule, microbatches] = []
        for _ in range(steps):
            module.zero_grad()
            result = stage.train_step(
                *batch, loss_fn, microbatches, schedule, measure_memory=measure_memory
            )
            result.forward_waits, waited[:] = list(waited), []
            result.op_cpu, cpu[:] = list(cpu), []
            out[schedule, microbatches].append(result)
    return out


def steps_of(results: list[dict], case) -> list[list]:
    """Per step of ``case``, the timelines of all stages (``run``'s list of
    :func:`schedule_steps` results), step 0 (the warm-up) left out."""
    return [
        [by_rank[case][k].timeline for by_rank in results] for k in range(1, len(results[0][case]))
    ]


def median_step(results: list[dict], case) -> list:
    """The step of ``case`` whose measured idle fraction is the median one."""
    from dmlbook.model_parallel import pipeline as pp
    from dmlbook.notebook import median_by

    return median_by(steps_of(results, case), key=pp.measured_bubble)


def step_on_cpu_clock(results: list[dict], case, timelines: list) -> list[list]:
    """The ops of the step of ``case`` whose ``timelines`` these are (as :func:`median_step`
    returns them), each lasting its CPU time instead of its wall-clock time (``op_cpu`` of
    :func:`schedule_steps`), started at 0: what :func:`pp.packed_timelines` replays as the step
    that the stages' own work alone would take."""
    from dmlbook.model_parallel import pipeline as pp

    for by_rank in zip(*(r[case] for r in results), strict=True):
        if by_rank[0].timeline is timelines[0]:
            return [
                [pp.OpRecord(r.op, r.microbatch, 0.0, cpu, r.chunk) for r, cpu in
                 zip(result.timeline, result.op_cpu, strict=True)]
                for result in by_rank
            ]  # fmt: skip
    raise ValueError(f"these timelines are not a step of {case}")


def least_idle(results: list[dict], case) -> float:
    """The least idle fraction of any step of ``case``. Where stages overlap, other work on the
    machine only adds idle time (a stage that slept in a receive waits for a CPU before it goes
    on), so a claim that overlap cuts idle time is checked on the step it disturbed least."""
    from dmlbook.model_parallel import pipeline as pp

    return min(map(pp.measured_bubble, steps_of(results, case)))


def one_message_s(rows: int, width: int, dev=None, repeats: int = 20) -> float:
    """On stages 0 and 1 of a launch (chapter 6 runs it beside its pipeline): the median
    one-way time of one activation (rows x width float32) between them, from ping-pongs timed
    in the same run: what each message of the pipeline costs here."""
    rank = dist.get_rank()
    buf = torch.zeros(rows, width, device=dev or device())
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


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
    (idle fraction of the stages' timelines) and the least of any step (``bubble_best``: where
    other work on the machine interrupted a step, a stage that waits for a CPU after each receive
    idles longer) beside the theory (P-1)/(M+P-1), and the step time
    over torch's on the same stage module (vanilla is set against torch's GPipe with M = 1;
    ``ratio_vs_torch`` is None without ``versus_torch``). ``cores_busy`` (the same in every
    record) is the largest share of a short compute burst that a stage spent waiting for a CPU,
    before and after the timed steps (:func:`dmlbook.cpu_wait.cpu_wait_in_burst`): near 0 where
    each stage had a core of its own; stages that share cores with other work cannot overlap,
    and their bubble then says more about that work than about the schedule.

    With ``versus_torch`` (chapter 6's quick run goes without), the run goes on beyond the book:
    the records of :func:`bench_schedules` follow, each with ``"part": "beyond the book"``.
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
        f"median of {steps} steps (slowest stage), {load_average()}; a compute burst lost up "
        f"to {measured[0]['cores_busy']:.0%} waiting for a CPU (before and after)\n"
        "bubble: measured idle fraction, the median and the least of any step (best);\n"
        "packed: the same op times with instant messages; wait: a stage's time blocked in\n"
        "receives per step; msg: one activation's one-way time"
    )
    print(
        f"{'schedule':>8s} {'M':>3s} {'median':>10s} {'bubble':>7s} {'best':>7s} {'packed':>7s} "
        f"{'theory':>7s} {'wait':>8s} {'msg':>8s} "
        + (f"{'torch':>10s} {'vs torch':>8s}" if versus_torch else "")
    )
    records = []
    for case in cases:
        schedule, m = case
        step_s = statistics.median(measured[0][case]["ours"])
        torch_s = statistics.median(measured[0][case]["torch"])  # nan without versus_torch
        ratio = step_s / torch_s if versus_torch else None
        per_step = list(zip(*(measured[r][case]["timelines"] for r in range(stages)), strict=True))
        bubbles = [pp.measured_bubble(timelines) for timelines in per_step]
        bubble = statistics.median(bubbles)
        # the same op durations with instant messages: what is left of the gap to the theory
        packed = statistics.median(pp.measured_bubble(pp.packed_timelines(t)) for t in per_step)
        theory = pp.bubble_theory(stages, m)
        wait_s = statistics.median(
            max(w) for w in zip(*(measured[r][case]["wait"] for r in range(stages)), strict=True)
        )
        message_s = measured[0]["message_s"][m]
        records.append(
            {
                "schedule": schedule,
                "stages": stages,
                "microbatches": m,
                "median_step_s": step_s,
                "steps_s": list(measured[0][case]["ours"]),  # every timed step, slowest stage
                "bubble_measured": bubble,
                "bubble_best": min(bubbles),
                "bubble_theory": theory,
                "bubble_packed": packed,
                "wait_s": wait_s,
                "message_s": message_s,
                "ratio_vs_torch": ratio,
                "cores_busy": measured[0]["cores_busy"],
            }
        )
        print(
            f"{schedule:>8s} {m:3d} {1e3 * step_s:8.1f}ms {bubble:7.3f} {min(bubbles):7.3f} "
            f"{packed:7.3f} "
            f"{theory:7.3f} {1e3 * wait_s:6.1f}ms {1e3 * message_s:6.2f}ms "
            + (f"{1e3 * torch_s:8.1f}ms {ratio:7.2f}x" if versus_torch else "")
        )
    if versus_torch:
        records += bench_schedules()
    write_json(records, json_path)
    return records


# ---- beyond the book: interleaved 1F1B and ZB-H1 against torch's -------------------------------

_TORCH_KINDS = {  # ours -> torch.distributed.pipelining's class of the same schedule
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",  # with one chunk per rank: ZB-H1 (torch's ZB1P)
}


def _schedule_step_times(cases, steps: int, warmup: int, width: int, depth: int, batch: int):
    """On every stage: each case's step time, timeline and peak saved bytes, ours and torch's
    on the same chunks of one MLP (the losses too, to check that both computed the same)."""
    from torch.distributed import pipelining

    from dmlbook.model_parallel import pipeline as pp
    from dmlbook.model_parallel.recompute import SavedTensorMeter

    rank, stages, dev = dist.get_rank(), dist.get_world_size(), device()
    model = mlp(seed=0, in_features=width, hidden=(width,) * (depth - 1), out_features=width)
    layers = [layer.to(dev) for layer in pp.layers_of(model)]
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(batch, width, generator=g).to(dev) for _ in range(2))
    loss_fn = torch.nn.functional.mse_loss
    ours, theirs = {}, {}
    for case in cases:
        schedule, chunks, microbatches = case
        parts = pp.split_model(layers, pp.even_partition(depth, stages * chunks))
        mine = [parts[c * stages + rank] for c in range(chunks)]
        ours[case] = pp.PipelineStage(mine if chunks > 1 else mine[0], rank, stages, device=dev)
        their_stages = [
            pipelining.PipelineStage(m, c * stages + rank, stages * chunks, dev)
            for c, m in enumerate(mine)
        ]
        kind = getattr(pipelining, _TORCH_KINDS[schedule])
        their_stages = their_stages[0] if schedule == "1f1b" else their_stages
        theirs[case] = kind(their_stages, microbatches, loss_fn=loss_fn)
    keep = [*model.parameters(), x, y]  # not activation memory

    def our_step(case):
        result = ours[case].train_step(x, y, loss_fn, case[2], case[0], measure_memory=True)
        return result.loss, result.peak_saved_bytes, result.timeline

    def torch_step(case):
        losses: list[torch.Tensor] = []
        with SavedTensorMeter(keep) as meter:
            if rank == 0:
                theirs[case].step(x)
            elif rank == stages - 1:
                theirs[case].step(target=y, losses=losses)
            else:
                theirs[case].step()
        return (torch.stack(losses).mean().item() if losses else None), meter.peak, None

    def timed(step, case):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        out = step(case)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest stage's time
        return elapsed.item(), out

    keys = ("ours", "torch", "timelines", "bytes", "torch_bytes", "loss", "torch_loss")
    out = {case: {key: [] for key in keys} for case in cases}
    for i in range(warmup + steps):
        for case in cases[i % len(cases) :] + cases[: i % len(cases)]:  # rotate the order
            ours_s, (loss, saved, timeline) = timed(our_step, case)
            torch_s, (torch_loss, torch_saved, _) = timed(torch_step, case)
            if i >= warmup:
                record = out[case]
                record["ours"].append(ours_s)
                record["torch"].append(torch_s)
                record["timelines"].append(timeline)
                record["bytes"].append(saved)
                record["torch_bytes"].append(torch_saved)
                record["loss"].append(loss)
                record["torch_loss"].append(torch_loss)
    return out


def bench_schedules(
    stages: tuple[int, ...] = (2, 4),
    microbatches: tuple[int, ...] = (4, 8),
    steps: int = 6,
    warmup: int = 1,
    width: int = 512,
    depth: int = 8,
    batch: int = 256,
    chunks: int = 2,
) -> list[dict]:
    """1F1B, interleaved 1F1B (``chunks`` = v model chunks per rank) and ZB-H1 on an MLP of
    ``depth`` Linear(width, width) layers, at each P in ``stages`` and M in ``microbatches``.

    Per case: the bubble with equal op times (``bubble_theory``), measured (median over steps of
    the idle fraction of the stages' timelines) and packed (the same op times, instant messages);
    the median step time (slowest stage) of ours and of torch's class of the same schedule on the
    same chunks, and each one's peak bytes autograd saved for backward (the most of any rank,
    counted by the same ``SavedTensorMeter``). Our loss and torch's must be equal (asserted).
    ``ratio_vs_torch`` is given at the P that has a core per rank (1F1B's rows are left out of
    it: the main table has them); with more ranks than cores the timings are not claims.
    """
    from dmlbook.model_parallel import pipeline as pp

    cores = os.cpu_count() or 1
    records = []
    print(
        f"\nbeyond the book: interleaved 1F1B (v = {chunks}) and ZB-H1 against 1F1B and torch's "
        f"schedules, MLP {depth} x Linear({width}, {width}), batch {batch}, median of {steps} "
        f"steps; memory: peak bytes autograd saved (the most of any rank)"
    )
    for p in stages:
        if depth < p * chunks:
            raise ValueError(f"{depth} layers cannot make {p * chunks} chunks")
        cases = [
            (schedule, chunks if schedule == "interleaved" else 1, m)
            for m in microbatches
            for schedule in ("1f1b", "interleaved", "zb-h1")
        ]
        measured = run(
            _schedule_step_times, p, cases, steps, warmup, width, depth, batch, timeout=600
        )
        shared = p > cores
        print(
            f"P = {p} ranks on {cores} cores"
            + (
                ": oversubscribed, ranks take turns on the cores; times are not claims"
                if shared
                else ""
            )  # fmt: skip
        )
        print(
            f"{'schedule':>11s} {'v':>2s} {'M':>3s} {'theory':>7s} {'measured':>8s} "
            f"{'packed':>7s} {'ours':>9s} {'torch':>9s} {'vs torch':>8s} {'ours MB':>8s} "
            f"{'torch MB':>8s}"
        )
        for case in cases:
            schedule, v, m = case
            loss = measured[-1][case]["loss"][0]
            torch_loss = measured[-1][case]["torch_loss"][0]
            assert abs(loss - torch_loss) <= 1e-5 * max(1.0, abs(loss)), (case, loss, torch_loss)
            per_step = list(zip(*(measured[r][case]["timelines"] for r in range(p)), strict=True))
            bubble = statistics.median(pp.measured_bubble(t) for t in per_step)
            packed = statistics.median(pp.measured_bubble(pp.packed_timelines(t)) for t in per_step)
            theory = pp.bubble_theory(p, m, schedule, v)
            step_s = statistics.median(measured[0][case]["ours"])
            torch_s = statistics.median(measured[0][case]["torch"])
            ratio = step_s / torch_s if not shared and schedule != "1f1b" else None
            saved = max(max(measured[r][case]["bytes"]) for r in range(p))
            torch_saved = max(max(measured[r][case]["torch_bytes"]) for r in range(p))
            records.append(
                {
                    "part": "beyond the book",
                    "schedule": schedule,
                    "chunks": v,
                    "stages": p,
                    "microbatches": m,
                    "bubble_theory": theory,
                    "bubble_measured": bubble,
                    "bubble_packed": packed,
                    "median_step_s": step_s,
                    "torch_median_step_s": torch_s,
                    "ratio_vs_torch": ratio,
                    "peak_saved_bytes": saved,
                    "torch_peak_saved_bytes": torch_saved,
                    "loss": loss,
                    "torch_loss": torch_loss,
                    "oversubscribed": shared,
                }
            )
            print(
                f"{schedule:>11s} {v:2d} {m:3d} {theory:7.3f} {bubble:8.3f} {packed:7.3f} "
                f"{1e3 * step_s:7.1f}ms {1e3 * torch_s:7.1f}ms "
                + (f"{ratio:7.2f}x " if ratio is not None else f"{'':>8s} ")
                + f"{saved / 1e6:8.2f} {torch_saved / 1e6:8.2f}"
            )
    return records
