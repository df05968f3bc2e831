"""Benchmarks: each teaching implementation against torch's own, measured in the same run (the
numbers chapters 2, 3, 4, 6, 9 and 13 and the README quote; each module names its chapter)::

    python -m dmlbook.bench launch           # dmlbook.launch.run vs torch.multiprocessing.spawn;
                                             # 200 launches at world size 4 (median, p95, > 1 s),
                                             # a Ranks session's start, memory (PSS) per learner
    python -m dmlbook.bench ranks            # a %%ranks cell on persistent ranks vs launch.run
    python -m dmlbook.bench data-parallel    # average_gradients (flat) and the per-parameter
                                             # baseline vs torch DDP, time per step
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
    python -m dmlbook.bench tp-check --json out.json
                                             # a TP + SP step with and without the shape
                                             # checks of its collectives, at 2 and 3 ranks
    python -m dmlbook.bench gpu              # bf16 GEMM vs the card's peak; memory estimate vs
                                             # the CUDA allocator (needs a GPU)
    python -m dmlbook.bench gpu-check        # `make gpu-check`: gpu tests, chapter 8 and the
                                             # GPU benchmarks on one GPU, one table at the end
    python -m dmlbook.bench all --json out.json
                                             # every benchmark above but gpu-check (gpu only
                                             # where CUDA is present); the file holds every
                                             # record, each tagged with its bench

Every line prints the median of several repeats for both sides and their ratio (ours / torch's).
These are measurements, never assertions: the tests check correctness only. Take timing claims
at world size <= the number of cores (2 on the reference laptop).
"""

from __future__ import annotations

import argparse

# One module per benchmark (dmlbook.bench.launch, .ddp, .allreduce, ...), each imported by the
# program (dmlbook/bench/__main__.py) only when its benchmark runs; what they share is in
# dmlbook.bench.common.


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
    "tp-check",
    "gpu",
)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dmlbook.bench`` (a test parses every command a chapter
    prints with it)."""
    from dmlbook.bench.ddp import DDP_MODELS

    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("which", choices=[*BENCHES, "gpu-check", "all"])
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB,64MiB", help="allreduce sizes")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per size (allreduce)")
    parser.add_argument("--check", action="store_true", help="allreduce: keep the shape check")
    parser.add_argument(
        "--json",
        help="write the records to this file (with all: every bench's, each tagged with its bench)",
    )
    parser.add_argument("--models", default=",".join(DDP_MODELS), help="ddp: models to time")
    parser.add_argument("--steps", type=int, default=50, help="ddp: timed steps per model")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="ddp: bucket size")
    return parser
