"""Chapter 1's data-parallel training, on local processes or across machines under torchrun.

    python examples/train_data_parallel.py --world-size 4
    # on each of two machines (HOST0 is the first one's address):
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id job1 examples/train_data_parallel.py --out result.pt

Every rank trains the MLP on its shard of the UCI digits with averaged gradients
(:func:`dmlbook.data_parallel.train`). Rank 0 saves the final weights and, for every global
rank, which node and local rank it was, to ``--out``.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook import models
from dmlbook.datasets import load_digits
from dmlbook.launch import device, exit_now, run

SETTINGS = dict(global_batch=64, lr=0.1, epochs=2, seed=0)


def train() -> dict:
    x, y = load_digits("train")
    x_test, y_test = load_digits("test")
    model = models.mlp(seed=0).to(device())
    dp.train(model, x.to(device()), y.to(device()), dp.TrainConfig(**SETTINGS))
    where = dict(
        rank=dist.get_rank(),
        node=int(os.environ.get("GROUP_RANK", 0)),  # torchrun's node rank
        local_rank=int(os.environ["LOCAL_RANK"]),
        interface=os.environ.get("GLOO_SOCKET_IFNAME", ""),
    )
    print(
        f"{socket.gethostname()}: global rank {where['rank']} is local rank "
        f"{where['local_rank']} on node {where['node']}",
        flush=True,
    )
    return dict(
        where=where,
        accuracy=dp.accuracy(model, x_test.to(device()), y_test.to(device())),
        state={k: v.cpu() for k, v in model.state_dict().items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="local ranks (not torchrun)")
    parser.add_argument("--out", default=None, help="where rank 0 saves the results")
    args = parser.parse_args()
    results = run(train, args.world_size)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank has the results
        print(f"test accuracy {results[0]['accuracy']:.3f} on {len(results)} ranks")
        if args.out:
            torch.save(
                dict(
                    state=results[0]["state"],
                    where=[r["where"] for r in results],
                    settings=SETTINGS,
                ),
                args.out,
            )


if __name__ == "__main__":
    main()
    exit_now()  # skip the interpreter's teardown of torch (see launch.exit_now)
