"""Chapter 11's elastic data-parallel training: the script torchrun's elastic agent (re)starts.

On one machine, 2 workers, and the agent may restart the group once (rank 1 kills itself at
step 25, once):

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a fresh store per restarted group
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/elastic_train.py runs/elastic --kill-step 25

On several machines (HOST0 is the first one's address), 1 to 4 nodes, each node joining or
leaving at any time; the job goes on while at least one is left. The same line on every machine:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:4 --nproc-per-node 2 \\
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        examples/elastic_train.py /shared/runs/job1

The run directory must be one that every node can read and write (a shared filesystem): the
checkpoints and the timeline live there. Each (re)start resumes from the latest checkpoint,
re-partitions the data and rescales the learning rate for the world size it finds
(:func:`dmlbook.advanced.elastic.train_worker`).
"""

import argparse
import os

from dmlbook.advanced.elastic import ElasticConfig, train_worker
from dmlbook.launch import exit_now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="checkpoints, timeline and samples go here")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--local-batch", type=int, default=16, help="samples per worker per step")
    parser.add_argument("--base-lr", type=float, default=0.1, help="the LR at --base-batch")
    parser.add_argument("--base-batch", type=int, default=32)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--kill-step", type=int, default=None, help="plant a failure at this step")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill", choices=("worker", "node"), default="worker")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step")
    args = parser.parse_args()
    config = ElasticConfig(
        run_dir=args.run_dir,
        epochs=args.epochs,
        local_batch=args.local_batch,
        base_lr=args.base_lr,
        base_batch=args.base_batch,
        every=args.every,
        kill_step=args.kill_step,
        kill_rank=args.kill_rank,
        kill=args.kill,
        step_delay=args.step_delay,
    )
    result = train_worker(config)
    if result is not None:
        print(
            f"done: step {result['step']} at world size {result['world']}, "
            f"test accuracy {result['accuracy']:.3f} (pid {os.getpid()})",
            flush=True,
        )


if __name__ == "__main__":
    main()
    exit_now()  # skip the interpreter's teardown of torch (see launch.exit_now)
