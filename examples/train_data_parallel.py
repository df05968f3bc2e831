"""Chapter 1's data-parallel training, on local processes or across machines under torchrun.

    python examples/train_data_parallel.py --world-size 4
    # two torchrun agents on this machine, playing two nodes of two processes each:
    python examples/train_data_parallel.py --local-nodes 2 --nproc-per-node 2 --out result.pt
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
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook import models
from dmlbook.comm.groups import device
from dmlbook.data_parallel.job import join_job
from dmlbook.datasets import load_digits
from dmlbook.launch import exit_now, free_port, run

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
        store=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",  # workers' store
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", ""),  # "True": agent hosts it
    )
    print(
        f"{socket.gethostname()}: global rank {where['rank']} is local rank "
        f"{where['local_rank']} on node {where['node']}",
        flush=True,
    )
    return dict(
        where=where,
        accuracy=models.accuracy(model, x_test.to(device()), y_test.to(device())),
        state={k: v.cpu() for k, v in model.state_dict().items()},
    )


def torchrun_on_this_machine(nodes: int, nproc_per_node: int, out: str) -> None:
    """Play ``nodes`` machines on this one: one torchrun agent per node, all running this script.

    The agents meet at a c10d rendezvous on 127.0.0.1. On real machines torchrun tells which
    agent hosts the rendezvous from the host name; agents sharing one host are told
    (``is_host``). Raises ``SystemExit`` with the agents' output if one fails.
    """
    port = free_port()  # below the ephemeral range: no outgoing connection takes it meanwhile
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        agents = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(nodes),
                    "--nproc-per-node",
                    str(nproc_per_node),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    "local",
                    "--rdzv-conf",
                    f"is_host={int(node == 0)}",
                    "--log-dir",
                    logs,
                    __file__,
                    "--out",
                    out,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for node in range(nodes)
        ]
        outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    if any(agent.returncode for agent in agents):
        raise SystemExit("a torchrun agent failed:\n" + "\n".join(outputs))
    print("".join(outputs), end="")
    if out:  # where the agents met, beside the workers' store they were handed
        torch.save(torch.load(out, weights_only=True) | {"rendezvous": f"127.0.0.1:{port}"}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="local ranks (not torchrun)")
    parser.add_argument("--out", default=None, help="where rank 0 saves the results")
    parser.add_argument(
        "--local-nodes",
        type=int,
        default=None,
        help="start this many torchrun agents here, playing as many nodes",
    )
    parser.add_argument("--nproc-per-node", type=int, default=2, help="with --local-nodes")
    args = parser.parse_args()
    if args.local_nodes:
        torchrun_on_this_machine(args.local_nodes, args.nproc_per_node, args.out)
        return
    under_torchrun = "RANK" in os.environ
    if under_torchrun:
        join_job()  # then run() calls train here, in this process, and gathers the results
    results = run(train, args.world_size)
    if under_torchrun:
        dist.destroy_process_group()
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
