"""One rank function, launched three ways (chapter 3: world size, rank and local rank).

    python examples/hello_ranks.py 4                        # 4 fresh processes on this machine
    torchrun --standalone --nproc-per-node 2 examples/hello_ranks.py
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/hello_ranks.py   # on each node

Under torchrun the world size comes from torchrun, and ``run`` calls the function in place.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

from dmlbook.comm.groups import device
from dmlbook.launch import exit_now, run


def whoami() -> tuple[int, int, int]:
    """(global rank, local rank on its machine, world size seen by an all-reduce of ones)."""
    ones = torch.ones(1, device=device())
    dist.all_reduce(ones)  # every rank contributes 1
    print(
        f"host {socket.gethostname()}: rank {dist.get_rank()} local rank "
        f"{os.environ['LOCAL_RANK']} on {device()}"
    )
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), int(ones.item())


if __name__ == "__main__":
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else None  # None: torchrun decides
    results = run(whoami, world_size)
    # One write per line: under torchrun every rank shares the terminal.
    sys.stdout.write(f"rank {os.environ.get('RANK', 'caller')} results {results}\n")
    exit_now()  # skip the interpreter's teardown of torch (see launch.exit_now)
