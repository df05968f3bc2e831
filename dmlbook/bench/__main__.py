"""``python -m dmlbook.bench ...``: the benchmark command line (:func:`main`; its options are
:func:`dmlbook.bench.build_parser`'s); the measurements chapters 2, 3, 4, 6 and 13 and the README
quote."""

from __future__ import annotations

import torch

from dmlbook.bench import build_parser
from dmlbook.bench.common import write_json


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks ``argv`` names (default: the command line), as :func:`build_parser`
    reads it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.which == "gpu-check":
        from dmlbook.bench.gpu import gpu_check

        raise SystemExit(gpu_check())
    every = args.which == "all"
    records: list[dict] = []  # every bench's records, each tagged with its bench

    def keep(bench: str, rows) -> None:
        records.extend({"bench": bench, **row} for row in rows or [])

    if every or args.which == "launch":
        from dmlbook.bench.launch import bench_launch

        keep("launch", bench_launch())
    if every or args.which == "ranks":
        from dmlbook.bench.ranks import bench_ranks

        keep("ranks", bench_ranks())
    if every or args.which == "data-parallel":
        from dmlbook.bench.data_parallel import bench_data_parallel

        keep("data-parallel", bench_data_parallel(args.world_size))
    if every or args.which == "ddp":
        from dmlbook.bench.ddp import bench_ddp

        models = tuple(args.models.split(","))
        keep("ddp", bench_ddp(args.world_size, models, args.steps, 5, args.bucket_cap_mb))
    if every or args.which == "allreduce":
        from dmlbook.bench.allreduce import bench_allreduce, parse_size

        sizes = tuple(parse_size(s) for s in args.sizes.split(","))
        keep("allreduce", bench_allreduce(args.world_size, sizes, args.repeats, check=args.check))
    if every or args.which == "recompute":
        from dmlbook.bench.recompute import bench_recompute

        keep("recompute", bench_recompute())
    if every or args.which == "pipeline":
        from dmlbook.bench.pipeline import bench_pipeline

        keep("pipeline", bench_pipeline())
    if every or args.which == "netlab":
        from dmlbook.bench.netlab import bench_netlab

        keep("netlab", bench_netlab())
    if every or args.which == "composed":
        from dmlbook.bench.composed import bench_composed

        keep("composed", bench_composed())
    if every or args.which == "tp-check":
        from dmlbook.bench.tp_check import bench_tp_check

        keep("tp-check", bench_tp_check())
    if (every and torch.cuda.is_available()) or args.which == "gpu":
        from dmlbook.bench.gpu import bench_gpu

        keep("gpu", bench_gpu())
    if not every:  # one bench: its own records, as before, without the tag
        records = [{k: v for k, v in row.items() if k != "bench"} for row in records]
    write_json(records, args.json)


if __name__ == "__main__":  # not in the ranks that torch's spawn starts, which import this file
    main()
