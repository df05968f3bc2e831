"""The one data-parallel training loop, its callbacks, and the learning-rate rules (chapters 1, 3).

* :func:`train_loop` is the loop every data-parallel chapter runs: for each batch of a batch plan,
  forward, backward, the model synchronisation (``sync``), the optimizer step, and *callbacks*
  at fixed moments (:class:`Callback`: on train start, on step start, after backward, on step, on
  epoch, on checkpoint, on fault, on train end). What differs between chapters plugs in there:
  chapter 1's learning-rate schedule, evaluation and progress bar; chapter 3's checkpoints and
  planted crashes (:class:`~dmlbook.data_parallel.checkpoint.Checkpointing`); chapter 11's
  timeline and re-partitioned batches; chapter 12's time slices and slow ranks. The loop itself
  stays the single-process loop plus one ``sync`` call: at world size 1, outside any process
  group, it *is* the single-process reference.
* A batch plan is any iterable of :class:`LocalBatch` (which samples of ``x, y`` this rank takes
  at each step) or of :class:`~dmlbook.models.Batch` (the tensors themselves).
  :func:`strided_batches` is chapter 1's: because :func:`~dmlbook.datasets.shard_indices` splits
  each epoch's permutation with a stride, the ranks' t-th local batches together are exactly
  the t-th global batch of the single-process run.
* The *step hook* (:class:`ForwardBackward`) is what a step computes: this rank's loss on its
  batch and the gradients. The default is :func:`~dmlbook.models.batch_loss` and one backward;
  a strategy whose step is not that (a pipeline schedule, ZeRO's sharded forward, a tensor-
  parallel model) passes its own, and keeps the loop, its callbacks and its records.
* :func:`train_reference` is the one single-process reference trainer: the loop at world size
  one on whole batches, which every parallel trainer is tested against (chapters 7, 9, 9b, 11,
  13).
* :func:`train` is chapter 1's entry point: SGD with a learning-rate rule on the loop, a progress
  bar on rank 0, test accuracy by :func:`sharded_accuracy` (each rank scores its share, one
  all-reduce adds up the counts). It also takes a DDP wrapper (chapter 3's or torch's).
* :func:`linear_scaling` and :func:`warmup` are the learning-rate rules for a larger global batch
  (Goyal et al. 2017, "Accurate, Large Minibatch SGD").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
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
from dmlbook.data_parallel.ddp import DataParallelWrapper
from dmlbook.datasets import shard_indices
from dmlbook.models import Batch, accuracy, batch_loss, count_correct

__all__ = [
    "Callback",
    "ForwardBackward",
    "LocalBatch",
    "LoopState",
    "NoSync",
    "TrainConfig",
    "linear_scaling",
    "sharded_accuracy",
    "strided_batches",
    "train",
    "train_loop",
    "train_reference",
    "train_step",
    "warmup",
]


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class LocalBatch:
    """One step's samples on this rank (indices into the loop's ``x, y``), and where the step
    stands in its epoch."""

    epoch: int
    index: int  # the step's position within its epoch (0 for the epoch's first batch)
    samples: Sequence[int] | torch.Tensor  # this rank's sample indices
    last_in_epoch: bool = False
    offset: int = 0  # samples of the epoch's order before this global batch
    # Samples in the global batch. None: the loss is this rank's mean and ``sync`` averages the
    # ranks' gradients (equal local batches). A number: the loss is this rank's summed loss
    # divided by it, its share of the global mean, and ``sync`` must add the gradients
    # (``GradientAveraging(divide_by=1)``): right for local batches of different sizes.
    global_size: int | None = None


@dataclass
class LoopState:
    """What the callbacks see: the model, where training stands, the last loss."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None  # None: the step hook updates the model itself
    group: object
    rank: int
    world_size: int
    step: int = 0  # optimizer steps taken since training began (the global step)
    batch: LocalBatch | Batch | None = None  # the plan's entry of the step under way, or last
    loss: torch.Tensor | None = None  # this rank's loss of that step (detached after the step)
    losses: list[float] = field(default_factory=list)  # this rank's loss at each step it ran
    callbacks: list = field(default_factory=list, repr=False)

    def emit(self, event: str, *args) -> None:
        """Call ``event`` on every callback, in order (a callback may emit further events)."""
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)


class Callback:
    """Hooks into :func:`train_loop`; override what you need. Every hook gets the loop's state."""

    def on_train_start(self, state: LoopState) -> None:
        """Before the first batch."""

    def on_step_start(self, state: LoopState) -> None:
        """A step begins; ``state.batch`` is its plan entry (its rows are loaded next)."""

    def inputs(self, state: LoopState, x: torch.Tensor) -> torch.Tensor:
        """This rank's inputs of the step, transformed (e.g. augmented) before the forward."""
        return x

    def after_backward(self, state: LoopState) -> None:
        """The gradients are computed, not yet synchronised."""

    def on_step(self, state: LoopState) -> None:
        """The optimizer stepped; ``state.step`` counts this step."""

    def on_epoch(self, state: LoopState) -> None:
        """The epoch's last step is done."""

    def on_checkpoint(self, state: LoopState, path) -> None:
        """A checkpoint at ``path`` is durable."""

    def on_fault(self, state: LoopState, error: BaseException) -> None:
        """The step (or a callback's hook) raised ``error``; the loop raises it on afterwards."""

    def on_train_end(self, state: LoopState) -> None:
        """The last batch is done and the sync scheme has finished."""


class NoSync:
    """The sync scheme for gradients that are already synchronised: by a DDP wrapper during
    backward, by a step hook (ZeRO's reduce-scatter), or because there is one process."""

    def after_backward(self, model: nn.Module, step: int, group=None) -> None:
        pass

    after_step = finish = after_backward


class ForwardBackward:
    """The loop's step hook: this rank's loss on its batch, and the gradients of it.

    The loop calls ``hook(state, batch)`` once a step, after ``zero_grad`` and before the
    ``after_backward`` callbacks, the sync scheme and the optimizer step; ``batch`` is the
    step's :class:`~dmlbook.models.Batch` (already transformed by the callbacks' ``inputs``).
    It returns the loss to record (None on a rank that holds none, e.g. a pipeline's first
    stage). This default is :func:`~dmlbook.models.batch_loss` and one ``backward``. Override
    :meth:`loss` to change how the loss is computed, or ``__call__`` to run a whole different
    step (a pipeline schedule); any callable ``(state, batch) -> loss`` will do.
    """

    def __init__(self, loss_fn: Callable | None = F.cross_entropy) -> None:
        self.loss_fn = loss_fn  # None: the model brings its own loss (CharGPT)

    def loss(self, state: LoopState, batch: Batch) -> torch.Tensor:
        """This rank's loss: its mean, or its share of the global mean when the plan's entry
        names the ``global_size`` of the global batch (local batches of different sizes)."""
        global_size = getattr(state.batch, "global_size", None)
        if global_size is None:
            return batch_loss(state.model, batch, self.loss_fn)  # this rank's mean
        if self.loss_fn is None:
            raise ValueError("a plan with global_size needs a loss_fn that takes reduction=")
        total = batch_loss(state.model, batch, partial(self.loss_fn, reduction="sum"))
        return total / global_size  # this rank's share of the global batch's mean

    def __call__(self, state: LoopState, batch: Batch) -> torch.Tensor | None:
        loss = self.loss(state, batch)  # compute
        loss.backward()  # compute (and, in a DDP wrapper, communication)
        return loss


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    batches: Iterable[LocalBatch | Batch],
    *,
    sync=None,
    callbacks: Sequence[Callback] = (),
    step: int = 0,
    group=None,
    forward_backward: Callable[[LoopState, Batch], torch.Tensor | None] | None = None,
) -> LoopState:
    """Train ``model`` on the batches of ``batches``: the one training loop (chapter 1).

    ``x, y`` are the data that :class:`LocalBatch` entries index (None for a plan of
    :class:`~dmlbook.models.Batch` tensors). ``sync`` is the model synchronisation
    (:class:`GradientAveraging` by default; a DDP wrapper syncs in backward, so pass none).
    ``forward_backward`` is the step hook (:class:`ForwardBackward`: cross entropy by default);
    with ``optimizer=None`` the hook also updates the model (chapter 13's composed step runs the
    ZeRO-1 step itself), and the loop zeroes and steps nothing.
    ``step`` is the global step to count from, for a run that resumes. A step that raises (a
    callback's hook included) calls every callback's ``on_fault`` and then raises on.
    """
    rank, world = group_rank_size(group)
    if isinstance(model, DataParallelWrapper | TorchDDP):
        if sync is not None:
            name = type(model).__name__
            raise ValueError(f"a {name} averages gradients in backward: pass no sync")
        sync = NoSync()
    sync = GradientAveraging() if sync is None else sync
    forward_backward = ForwardBackward() if forward_backward is None else forward_backward
    state = LoopState(model, optimizer, group, rank, world, step, callbacks=list(callbacks))
    state.emit("on_train_start")
    for batch in batches:
        state.batch = batch
        try:
            train_step(state, x, y, sync, forward_backward)
            state.emit("on_step")
            if getattr(batch, "last_in_epoch", False):
                state.emit("on_epoch")
        except BaseException as error:
            state.emit("on_fault", error)
            raise
    sync.finish(model, state.step, group)
    state.emit("on_train_end")
    return state


def _tensors(entry: LocalBatch | Batch, x, y) -> Batch:
    """The step's tensors: the rows a :class:`LocalBatch` names, or the entry itself."""
    if isinstance(entry, LocalBatch):
        if x is None or y is None:
            raise ValueError("a plan of LocalBatch (sample indices) needs the data x and y")
        return Batch(x[entry.samples], y[entry.samples])
    inputs, targets = entry
    return Batch(inputs, targets)


def train_step(state: LoopState, x, y, sync, forward_backward: Callable) -> None:
    """One step of data-parallel SGD on this rank: load, compute, communicate, update.

    In chapter 1's :func:`train`, ``forward_backward`` is ``loss = cross_entropy(model(inputs),
    targets); loss.backward()``, and ``sync`` is :class:`GradientAveraging`, whose
    ``after_backward`` calls ``average_gradients(model)``; ``state.emit`` calls the callbacks
    (chapter 1's sets the step's learning rate and records the loss)."""
    model = state.model
    state.emit("on_step_start")
    batch = _tensors(state.batch, x, y)  # data loading: this rank's rows
    inputs = batch.inputs
    for callback in state.callbacks:
        inputs = callback.inputs(state, inputs)
    if state.optimizer is not None:  # None: the step hook updates the model itself
        state.optimizer.zero_grad()  # set_to_none (torch >= 2); a ZeRO wrapper may stand in
    loss = forward_backward(state, Batch(inputs, batch.targets))  # compute (the step hook)
    state.loss = loss
    state.emit("after_backward")
    sync.after_backward(model, state.step, state.group)  # communication (synchronous SGD)
    if state.optimizer is not None:
        state.optimizer.step()
    sync.after_step(model, state.step, state.group)  # communication (model averaging)
    state.step += 1
    state.loss = None if loss is None else loss.detach()
    state.losses.append(math.nan if loss is None else loss.item())


def train_reference(
    make_model: Callable[[], nn.Module],
    batches: Iterable[Batch],
    *,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
    lr: float = 1e-2,
    loss_fn: Callable | None = None,
    callbacks: Sequence[Callback] = (),
) -> LoopState:
    """The single-process reference every parallel trainer is tested against (chapters 7, 9,
    9b, 11, 13): ``make_model()`` trained by ``optimizer(params, lr=lr)`` on each whole
    :class:`~dmlbook.models.Batch`, one step each, by :func:`train_loop` with no sync. The loss
    is :func:`~dmlbook.models.batch_loss` with ``loss_fn`` (None: the model's own loss). Returns
    the loop's state: ``state.model`` trained, ``state.losses`` per step. It never
    communicates, so a rank of a process group may run it too."""
    model = make_model()
    opt = optimizer(model.parameters(), lr=lr)
    return train_loop(model, opt, None, None, batches, sync=NoSync(), callbacks=callbacks,
                      forward_backward=ForwardBackward(loss_fn))  # fmt: skip


def strided_batches(
    samples: int,
    global_batch: int,
    *,
    rank: int,
    world_size: int,
    epochs: int,
    seed: int = 0,
    start: tuple[int, int] = (0, 0),
) -> Iterable[LocalBatch]:
    """Chapter 1's batch plan: ``epochs`` epochs of global batches of ``global_batch`` samples,
    rank ``rank`` taking every ``world_size``-th sample of each (see
    :func:`~dmlbook.datasets.shard_indices`). Incomplete global batches are dropped. ``start``
    is ``(epoch, batch within it)`` to begin at, for a run that resumes."""
    if global_batch < 1 or global_batch % world_size:
        raise ValueError(
            f"global_batch={global_batch} must be a positive multiple of the world size "
            f"{world_size}"
        )
    if global_batch > samples:
        raise ValueError(f"global_batch={global_batch} is larger than the {samples} samples")
    return _strided(samples, global_batch, rank, world_size, epochs, seed, start)


def _strided(samples, global_batch, rank, world_size, epochs, seed, start) -> Iterable[LocalBatch]:
    local, per_epoch = global_batch // world_size, samples // global_batch
    for epoch in range(start[0], epochs):
        shard = shard_indices(samples, rank, world_size, shuffle=True, seed=seed, epoch=epoch)
        for t in range(start[1] if epoch == start[0] else 0, per_epoch):
            part = shard[t * local : (t + 1) * local]  # this rank's part of global batch t
            yield LocalBatch(
                epoch, t, part, last_in_epoch=t + 1 == per_epoch, offset=t * global_batch
            )


# --------------------------------------------------------------------------- chapter 1's train


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


@dataclass
class _Chapter1(Callback):
    """:func:`train`'s callbacks: the learning-rate rule, evaluation, the progress bar."""

    history: History
    lr_at: Callable[[int], float]
    test: tuple[torch.Tensor, torch.Tensor] | None
    eval_every: int
    score: Callable
    bar: tqdm
    start: float = 0.0

    def on_train_start(self, state: LoopState) -> None:
        self.start = time.perf_counter()

    def on_step_start(self, state: LoopState) -> None:
        self.history.lr.append(self.lr_at(state.step))
        for g in state.optimizer.param_groups:
            g["lr"] = self.history.lr[-1]

    def on_step(self, state: LoopState) -> None:
        self.history.loss.append(state.losses[-1])
        self.bar.update()
        self.bar.set_postfix(loss=f"{state.losses[-1]:.3f}", refresh=False)
        if self.test is not None and self.eval_every and state.step % self.eval_every == 0:
            self.history.eval_steps.append(state.step)
            self.history.eval_seconds.append(time.perf_counter() - self.start)
            self.history.accuracy.append(self.score(state.model, *self.test))

    def on_train_end(self, state: LoopState) -> None:
        self.bar.close()


@dataclass(frozen=True)
class TrainConfig:
    """What fixes a run of :func:`train`, apart from the model, the data and the sync scheme."""

    global_batch: int  # samples per step, summed over the ranks
    lr: float | Callable[[int], float]  # a number, or a function of the step (warm-up)
    epochs: int = 1
    seed: int = 0  # the epochs' shuffles
    momentum: float = 0.0  # SGD's
    eval_every: int = 0  # steps between two test-accuracy evaluations (0: none)
    progress: bool = False  # a progress bar on rank 0
    base_batch: int | None = None  # if set: lr is for this batch, scaled to global_batch (linear)
    warmup_steps: int = 0  # if > 0: ramp up to the (scaled) lr over this many steps


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    *,
    sync: GradientAveraging | ModelAveraging | None = None,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    loss_fn: Callable = F.cross_entropy,
    group=None,
) -> History:
    """Data-parallel SGD on this rank's shard of ``(x, y)``; single-process SGD at world size 1.

    ``config`` (:class:`TrainConfig`) fixes the run. Its ``global_batch`` is summed over the
    ranks, so each rank takes ``global_batch // world`` samples a step. Its ``lr`` is a number or
    a function of the step: for a larger global batch,
    ``warmup(linear_scaling(base_lr, base_batch, global_batch), steps)``, which
    ``TrainConfig(lr=base_lr, base_batch=base_batch, warmup_steps=steps)`` also asks for.

    ``model`` may be a DDP wrapper (:class:`BucketedDDP`, :class:`NaiveDDP` or torch's
    ``DistributedDataParallel``, chapter 3): it averages the gradients during backward, so the
    loop adds no ``sync``. Test accuracy on ``test``, every ``config.eval_every`` steps, is
    :func:`sharded_accuracy`, except under ``ModelAveraging``, whose ranks hold different
    models between averages: there each rank scores its own model on the whole test set.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a dp.TrainConfig, got {type(config).__name__}")
    global_batch, lr, epochs = config.global_batch, config.lr, config.epochs
    rank, world = group_rank_size(group)
    batches = strided_batches(
        len(x), global_batch, rank=rank, world_size=world, epochs=epochs, seed=config.seed
    )
    if not isinstance(model, DataParallelWrapper | TorchDDP):
        broadcast_parameters(model, group=group)  # every rank starts from rank 0's model
    score = accuracy if isinstance(sync, ModelAveraging) else partial(sharded_accuracy, group=group)
    if (config.base_batch is not None or config.warmup_steps) and callable(lr):
        raise ValueError("base_batch and warmup_steps scale a number lr, not a function")
    if config.base_batch is not None:
        lr = linear_scaling(lr, config.base_batch, global_batch)
    if config.warmup_steps:
        lr = warmup(lr, config.warmup_steps)
    lr_at = lr if callable(lr) else (lambda step: lr)
    history = History()
    steps = epochs * (len(x) // global_batch)
    bar = tqdm(total=steps, disable=not config.progress or rank != 0, desc="train")
    chapter1 = _Chapter1(history, lr_at, test, config.eval_every, score, bar)
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0), momentum=config.momentum)
    train_loop(model, opt, x, y, batches, sync=sync, callbacks=[chapter1], group=group,
               forward_backward=ForwardBackward(loss_fn))  # fmt: skip
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
