"""Time every dmlbook all-reduce algorithm and torch's on the ranks of a job (chapter 4).

    python examples/time_allreduce.py --world-size 2 --out times.json
    # one node per host of a network lab (see dmlbook.netlab), or per real machine:
    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id job1 examples/time_allreduce.py --sizes 1MiB,4MiB --out times.json

Rank 0 writes one record per algorithm and size: algorithm, world_size, bytes, median_s (the
slowest rank's time, median over the repeats, as ``python -m dmlbook.bench allreduce``) and
fastest_s (the fastest of those runs: the one other work on the machine delayed least).
"""

import argparse
import json
import os
import statistics

from dmlbook.bench.allreduce import parse_size, time_all_reduces
from dmlbook.comm import collectives
from dmlbook.launch import exit_now, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="local ranks (not torchrun)")
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON records")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    # every run of each contender (summary=None): rank 0 writes their median and the fastest
    ranks = run(time_all_reduces, args.world_size, sizes, args.repeats, 1, False, summary=None)
    per_size = ranks[0]
    world = int(os.environ.get("WORLD_SIZE", args.world_size or 1))
    if os.environ.get("RANK", "0") == "0":
        records = [
            dict(
                algorithm=name,
                world_size=world,
                bytes=nbytes,
                median_s=statistics.median(runs[name]),
                fastest_s=min(runs[name]),
            )
            for nbytes, runs in zip(sizes, per_size, strict=True)
            for name in (*collectives.ALGORITHMS, "torch")
        ]
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
    exit_now()  # skip the interpreter's teardown of torch (see launch.exit_now)
