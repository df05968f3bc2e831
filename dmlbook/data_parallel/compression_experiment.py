"""Chapter 4's gradient-compression experiment: the digits MLP trained under torch's DDP with each
of :mod:`dmlbook.comm.compression`'s hooks, from the same start, with the bytes TCP really sent.

:func:`train_schemes`, a rank function (``run(train_schemes, 2, backend="gloo")``), trains once
per scheme on the one loop (:func:`dmlbook.data_parallel.loop.train_loop`) and measures the wire
with :class:`~dmlbook.comm.compression.WireMeter`; :func:`compare_schemes` turns the ranks'
results into one table: measured and counted bytes, and the accuracy each scheme reaches.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dmlbook.comm.compression import SCHEMES, Scheme, WireMeter
from dmlbook.data_parallel.loop import strided_batches, train_loop
from dmlbook.datasets import load_digits
from dmlbook.models import mlp

__all__ = ["DigitsRun", "compare_schemes", "train_schemes"]


@dataclass
class DigitsRun:
    """How :func:`train_schemes` trains the digits MLP (plain SGD, as chapter 1)."""

    epochs: int = 10
    global_batch: int = 64  # summed over the ranks
    lr: float = 0.3
    momentum: float = 0.0  # 0.9 costs 1-bit+EF points: try SignState(chunk=64) then
    hidden: tuple[int, ...] = (128,)  # 64 -> 128 -> 10: 9,610 gradients, one DDP bucket
    seed: int = 0  # initial weights and the data order


def train_schemes(
    schemes: list[str] | dict[str, Scheme] | None = None, config: DigitsRun | None = None
) -> dict:
    """Rank function: train the digits MLP under torch's DDP once per scheme, from the same init.

    ``schemes``: names from :data:`~dmlbook.comm.compression.SCHEMES` (all of them by default)
    or your own ``{name: (hook, make_state)}``. Launch it over gloo, even with GPUs: the meter
    counts TCP, which NCCL over NVLink or shared memory avoids. :func:`compare_schemes` reads
    the results.
    """
    schemes = _named(schemes)
    config = config or DigitsRun()
    x, y = load_digits("train")
    x_test, y_test = load_digits("test")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, (hook, make_state) in schemes.items():
        state = make_state()
        model = mlp(seed=config.seed, in_features=64, hidden=config.hidden, out_features=10)
        ddp = DDP(model)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
        plan = strided_batches(len(x), config.global_batch, rank=rank, world_size=world,
                               epochs=config.epochs, seed=config.seed)  # fmt: skip
        dist.barrier()  # DDP's construction traffic stays outside the measurement
        with WireMeter() as wire:
            # the one loop; DDP's backward runs the hook once per bucket (communication)
            losses = train_loop(ddp, opt, x, y, plan).losses
            dist.barrier()  # every rank has received all we sent, so the kernel sent it all
        with torch.no_grad():
            correct = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        results[name] = dict(
            accuracy=correct,
            loss=losses,
            wire_bytes=wire.bytes,
            segments=wire.segments,
            hook_bytes=state.bytes_sent,
            collectives=state.collectives,
            params=torch.cat([p.detach().flatten() for p in model.parameters()]),
        )
        del ddp, opt  # free DDP before the process group goes away (pytorch#56297)
    return results


def _named(schemes: list[str] | dict[str, Scheme] | None) -> dict[str, Scheme]:
    if isinstance(schemes, dict):
        return schemes
    names = list(SCHEMES) if schemes is None else list(schemes)
    if unknown := [n for n in names if n not in SCHEMES]:
        raise ValueError(f"unknown schemes {unknown}; choose from {list(SCHEMES)}")
    return {n: SCHEMES[n] for n in names}


def compare_schemes(per_rank: list[dict]) -> dict[str, dict]:
    """One table from :func:`train_schemes`' results on every rank (``run``'s list, by rank).

    Returns, per scheme: ``accuracy`` (test set), ``loss`` (per step, mean over ranks),
    ``wire_bytes`` and ``segments`` (measured TCP payload and segments, summed over ranks),
    ``hook_bytes`` (the hooks' own count, summed), ``collectives`` (rank 0's count: every rank
    runs as many), ``wire_vs_fp32`` (when fp32 ran) and ``ranks_agree`` (every rank ended with
    bit-identical parameters).
    """
    table = {}
    for name in per_rank[0]:
        runs = [r[name] for r in per_rank]
        table[name] = dict(
            accuracy=runs[0]["accuracy"],
            loss=torch.tensor([r["loss"] for r in runs]).mean(dim=0).tolist(),
            **{k: sum(r[k] for r in runs) for k in ("wire_bytes", "segments", "hook_bytes")},
            collectives=runs[0]["collectives"],
            ranks_agree=all(torch.equal(r["params"], runs[0]["params"]) for r in runs),
        )
    if "fp32" in table:
        for row in table.values():
            row["wire_vs_fp32"] = row["wire_bytes"] / table["fp32"]["wire_bytes"]
    return table
