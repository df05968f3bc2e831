"""The six stages of a data-parallel training step, written out and each one timed (chapter 3).

:func:`train_in_six_stages` is chapter 1's synchronous data-parallel SGD as a plain loop, one
labelled line per stage of the book's picture: input pre-processing, input data partition, data
loading, training (forward and backward), model synchronisation (one all-reduce per gradient),
model update. It computes what :func:`~dmlbook.data_parallel.train_loop` computes with
:func:`~dmlbook.data_parallel.strided_batches` and per-parameter gradient averaging; it exists to
be read, and to time each stage with a :class:`StageClock`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.data_parallel.averaging import average_gradients_per_parameter
from dmlbook.datasets import shard_indices

__all__ = ["STEP_STAGES", "StageClock", "train_in_six_stages", "warm_up"]

STEP_STAGES = ("pre-processing", "partition", "loading", "training", "synchronisation", "update")


class StageClock:
    """Seconds spent in each stage: ``with clock("loading"): ...`` adds the block's wall time."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STEP_STAGES, 0.0)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start


def train_in_six_stages(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_raw: torch.Tensor,
    y: torch.Tensor,
    *,
    global_batch: int,
    epochs: int,
    clock: StageClock,
    group=None,
) -> None:
    """Synchronous data-parallel SGD on this rank's shard of ``(x_raw, y)``, each stage timed.

    Every rank starts from the same model and takes ``global_batch // world size`` samples a
    step; the ranks' gradients are averaged, so every rank takes the same optimizer step."""
    rank, world = group_rank_size(group)
    local = global_batch // world  # samples per rank and step
    warm_up(model, x_raw[rank * local : (rank + 1) * local], y[:local], group)
    with clock("pre-processing"):  # 1. normalise the raw pixels (mean 0, standard deviation 1)
        x = (x_raw - x_raw.mean()) / x_raw.std()
    for epoch in range(epochs):
        with clock("partition"):  # 2. this rank's sample indices in each global batch
            order = shard_indices(len(x), rank, world, shuffle=True, epoch=epoch)
            batches = [order[t * local : (t + 1) * local] for t in range(len(x) // global_batch)]
        for mine in batches:
            with clock("loading"):  # 3. gather this rank's batch
                inputs, targets = x[mine], y[mine]
            with clock("training"):  # 4. forward and backward on the local batch (compute)
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), targets).backward()
            with clock("synchronisation"):  # 5. all-reduce each gradient, divide (communication)
                average_gradients_per_parameter(model, group)
            with clock("update"):  # 6. the optimizer step, the same on every rank
                optimizer.step()


def warm_up(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, group=None) -> None:
    """One untimed forward, backward and gradient all-reduce, then a barrier; no update.

    The first call of each kind pays one-off costs (allocating buffers, gloo's first
    connection), and the ranks start at different moments: without this, the first all-reduce
    would hold both, on whichever rank arrived first. The gradients are dropped, so the model
    is left exactly as it was."""
    F.cross_entropy(model(inputs), targets).backward()
    average_gradients_per_parameter(model, group)
    model.zero_grad(set_to_none=True)
    barrier(group)  # the clocks start with every rank here
