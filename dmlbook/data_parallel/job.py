"""How a process that torchrun started learns who it is, and joins the others (chapter 3).

``examples/train_data_parallel.py`` calls :func:`join_job` first when torchrun starts it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["join_job"]


def join_job() -> dict:
    """Read who this process is from torchrun's environment, then join the process group.

    torchrun's agent sets these environment variables in every process it starts; the process
    group is then made from them (``init_method="env://"``)."""
    where = dict(
        rank=int(os.environ["RANK"]),  # global rank, 0 .. WORLD_SIZE - 1: picks the data shard
        local_rank=int(os.environ["LOCAL_RANK"]),  # rank on this machine: picks the GPU
        world_size=int(os.environ["WORLD_SIZE"]),  # processes in the whole job
        node=int(os.environ["GROUP_RANK"]),  # this machine's number in the job
        store=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",  # the workers' store
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(where["local_rank"])  # this process's GPU: cuda:<local rank>
    # Every process connects to the store at MASTER_ADDR:MASTER_PORT, says its RANK, and waits
    # until all WORLD_SIZE have arrived; then the ranks can run collectives.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
    return where
