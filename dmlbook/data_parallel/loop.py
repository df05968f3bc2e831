"""The data-parallel training loop and its learning-rate rules (chapters 1 and 3).

* :func:`train` is the training loop. It is the single-process loop plus one ``sync`` call; at
  world size 1, outside any process group, it *is* the single-process reference. Because
  :func:`~dmlbook.datasets.shard_indices` splits each epoch's permutation with a stride, the
  ranks' t-th local batches together are exactly the t-th global batch of the single-process run.
  It also takes a DDP wrapper (chapter 3's or torch's), shows a progress bar on rank 0, and
  scores the test set with :func:`sharded_accuracy`: each rank scores its share, one all-reduce
  adds up the counts.
* :func:`linear_scaling` and :func:`warmup` are the learning-rate rules for a larger global batch
  (Goyal et al. 2017, "Accurate, Large Minibatch SGD").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from tqdm.auto import tqdm

from dmlbook.comm.groups import group_rank_size
from dmlbook.data_parallel.averaging import GradientAveraging, ModelAveraging, broadcast_parameters
from dmlbook.data_parallel.ddp import _DataParallel
from dmlbook.datasets import shard_indices
from dmlbook.models import accuracy, count_correct

__all__ = ["History", "linear_scaling", "sharded_accuracy", "train", "warmup"]


# --------------------------------------------------------------------------- training


@dataclass
class History:
    """What :func:`train` measured: per-step local loss and lr, test accuracy at evaluations."""

    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)  # wall time since training began
    accuracy: list[float] = field(default_factory=list)


def sharded_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, group=None) -> float:
    """:func:`accuracy` on all of ``(x, y)``, each rank scoring only every world-th sample.

    Chapter 3's sharded evaluation. The shards may differ in length by one: unlike
    ``DistributedSampler``, nothing is padded with repeated samples, so after one all-reduce of
    (correct, total) the result is exactly the single-process accuracy. Ranks must hold the
    same model.
    """
    rank, world = group_rank_size(group)
    correct, total = count_correct(model, x[rank::world], y[rank::world])  # compute: my shard
    if world > 1:
        counts = torch.tensor([correct, total], dtype=torch.int64, device=x.device)
        dist.all_reduce(counts, group=group)  # communication: add up every rank's counts
        correct, total = counts.tolist()
    return correct / total


class _AveragedInBackward:
    """The sync scheme of a DDP wrapper: it averaged the gradients during backward already."""

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        pass

    after_step = finish = after_backward


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    global_batch: int,
    lr: float | Callable[[int], float],
    epochs: int = 1,
    seed: int = 0,
    sync: GradientAveraging | ModelAveraging | None = None,
    momentum: float = 0.0,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    eval_every: int = 0,
    loss_fn: Callable = F.cross_entropy,
    group=None,
    progress: bool = False,
) -> History:
    """Data-parallel SGD on this rank's shard of ``(x, y)``; single-process SGD at world size 1.

    ``global_batch`` is summed over the ranks, so each rank takes ``global_batch // world``
    samples a step. ``lr`` is a number or a function of the step: for a larger global batch,
    ``warmup(linear_scaling(base_lr, base_batch, global_batch), steps)``.

    ``model`` may be a DDP wrapper (:class:`BucketedDDP`, :class:`NaiveDDP` or torch's
    ``DistributedDataParallel``, chapter 3): it averages the gradients during backward, so the
    loop adds no ``sync``. ``progress`` shows a progress bar on rank 0. Test accuracy is
    :func:`sharded_accuracy`, except under ``ModelAveraging``, whose ranks hold different
    models between averages: there each rank scores its own model on the whole test set.
    """
    rank, world = group_rank_size(group)
    if global_batch < 1 or global_batch % world:
        raise ValueError(
            f"global_batch={global_batch} must be a positive multiple of the world size {world}"
        )
    if global_batch > len(x):
        raise ValueError(f"global_batch={global_batch} is larger than the {len(x)} samples")
    wrapped = isinstance(model, _DataParallel | TorchDDP)
    if wrapped and sync is not None:
        raise ValueError(f"a {type(model).__name__} averages gradients in backward: pass no sync")
    if wrapped:
        sync = _AveragedInBackward()
    else:
        sync = GradientAveraging() if sync is None else sync
        broadcast_parameters(model, group=group)  # every rank starts from rank 0's model
    score = accuracy if isinstance(sync, ModelAveraging) else partial(sharded_accuracy, group=group)
    lr_at = lr if callable(lr) else (lambda step: lr)
    local_batch = global_batch // world
    steps_per_epoch = len(x) // global_batch  # incomplete global batches are dropped
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0), momentum=momentum)
    bar = tqdm(total=epochs * steps_per_epoch, disable=not progress or rank != 0, desc="train")
    history, step, start = History(), 0, time.perf_counter()
    for epoch in range(epochs):
        shard = shard_indices(len(x), rank, world, shuffle=True, seed=seed, epoch=epoch)
        for t in range(steps_per_epoch):
            idx = shard[t * local_batch : (t + 1) * local_batch]  # this rank's part of batch t
            history.lr.append(lr_at(step))
            for g in opt.param_groups:
                g["lr"] = history.lr[-1]
            loss = loss_fn(model(x[idx]), y[idx])  # compute
            opt.zero_grad(set_to_none=True)
            loss.backward()  # compute (and, in a DDP wrapper, communication)
            sync.after_backward(model, step, group)  # communication (synchronous SGD)
            opt.step()
            sync.after_step(model, step, group)  # communication (model averaging)
            step += 1
            history.loss.append(loss.item())
            bar.update()
            bar.set_postfix(loss=f"{history.loss[-1]:.3f}", refresh=False)
            if test is not None and eval_every and step % eval_every == 0:
                history.eval_steps.append(step)
                history.eval_seconds.append(time.perf_counter() - start)
                history.accuracy.append(score(model, *test))
    bar.close()
    sync.finish(model, step, group)
    return history


# --------------------------------------------------------------------------- learning rate


def linear_scaling(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: k times the batch, k times the learning rate."""
    if base_batch < 1 or global_batch < 1:
        raise ValueError("batch sizes must be >= 1")
    return base_lr * global_batch / base_batch


def warmup(peak_lr: float, warmup_steps: int) -> Callable[[int], float]:
    """Gradual warm-up: ramp linearly to ``peak_lr`` over ``warmup_steps`` steps, then hold."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
    return lambda step: peak_lr * min(1.0, (step + 1) / warmup_steps)
