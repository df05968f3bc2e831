"""Time chapter 13's composed training step under several layouts on the ranks of a job.

    python examples/composed_layouts.py --world-size 8 --out times.json
    # one node per host of a network lab (see dmlbook.netlab), or per real machine:
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id job1 examples/composed_layouts.py --layouts dp2.tp2.pp2,dp8 --out times.json

Rank 0 writes ``{layout: {"step": [seconds, ...], "forward/backward": [...], ...}}``: each
step's time on the slowest rank, and that rank's time in each part of it
(``training.PHASES``), after one warm-up step. The model is the char-GPT of
``dmlbook.advanced.composition.planner.NETLAB_MODEL``.
"""

import argparse
import json
import os

from dmlbook.advanced.composition.planner import netlab_batches, netlab_model, parse_layout
from dmlbook.advanced.composition.training import time_layouts
from dmlbook.launch import exit_now, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="local ranks (not torchrun)")
    parser.add_argument("--layouts", default="dp2.tp2.pp2,dp8,tp8")
    parser.add_argument("--steps", type=int, default=4, help="steps per layout, warm-up included")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON")
    args = parser.parse_args()
    layouts = [parse_layout(text) for text in args.layouts.split(",")]
    batches = netlab_batches(args.steps)
    times = run(time_layouts, args.world_size, netlab_model, batches, layouts,
                args.microbatches)[0]  # fmt: skip
    if os.environ.get("RANK", "0") == "0":
        with open(args.out, "w") as f:
            json.dump(times, f, indent=1)


if __name__ == "__main__":
    main()
    exit_now()  # skip the interpreter's teardown of torch (see launch.exit_now)
