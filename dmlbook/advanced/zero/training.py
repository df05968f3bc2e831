"""Rank functions that train with ZeRO, and the references it must equal (chapter 9b).

:func:`zero_train` trains with a stage; :func:`ddp_train` is plain data parallelism (chapter 3's
BucketedDDP or torch's DDP) with Adam; :func:`fsdp2_train` is torch's stage 3, FSDP2. All three
run the one training loop (:func:`~dmlbook.data_parallel.loop.train_loop`) on this rank's rows of
each global batch (:func:`~dmlbook.comm.groups.local_rows`); what differs is the model wrapper
and what syncs the gradients (the ZeRO wrapper and FSDP2 themselves, so the loop's sync is
:class:`~dmlbook.data_parallel.loop.NoSync`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.zero.stages import zero_data_parallel
from dmlbook.comm import collectives as C  # a parameter below is named "collectives"
from dmlbook.comm.groups import local_rows
from dmlbook.data_parallel.loop import Callback, ForwardBackward, LoopState, NoSync, train_loop
from dmlbook.models import Batch
from dmlbook.optim import adam_update_


def _local_batches(batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Batch]:
    """This rank's rows of each global batch (equal shares: the global batch must divide)."""
    return [local_rows(Batch(x, y)) for x, y in batches]


class _MeasureLastStep(Callback):
    """Before the last step: the ZeRO wrapper's memory meter and byte counts reset, and (with
    ``record_sends``) every message its collectives send recorded until the step ends."""

    def __init__(self, zero, steps: int, record_sends: bool) -> None:
        self.zero, self.last, self.record_sends = zero, steps - 1, record_sends
        self.stack, self.sent = ExitStack(), []

    def on_step_start(self, state: LoopState) -> None:
        if state.step == self.last:
            self.zero.memory.reset()
            self.zero.sent_bytes = dict.fromkeys(self.zero.sent_bytes, 0)
            if self.record_sends:
                self.sent = self.stack.enter_context(C.recording_sends())

    def on_step(self, state: LoopState) -> None:
        self.stack.close()  # the last step's recording ends with its optimizer step


def zero_train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    stage: int,
    lr: float = 1e-2,
    loss_fn: Callable = nn.functional.cross_entropy,
    collectives: str = "torch",
    record_sends: bool = False,
) -> dict:
    """Rank function: train ``make_model()`` with ZeRO ``stage`` on each global batch (this rank
    takes its equal share of the rows). Returns the full parameters, the losses, the peak
    memory (and every sample), the unit sizes and the bytes this rank passed to (and, with
    ``record_sends``, actually sent through) the collectives in the last step."""
    zero = zero_data_parallel(make_model(), stage, lr=lr, collectives=collectives)
    meter = _MeasureLastStep(zero, len(batches), record_sends)
    # The wrapper is the model and its own optimizer: it averages the gradients in backward or
    # in its step, so the loop syncs nothing.
    state = train_loop(zero, zero, None, None, _local_batches(batches), sync=NoSync(),
                       callbacks=[meter], forward_backward=ForwardBackward(loss_fn))  # fmt: skip
    passed = dict(zero.sent_bytes)  # before full_parameters() gathers once more
    return {
        "parameters": zero.full_parameters(),
        "losses": state.losses,
        "peak": zero.memory.peak,
        "samples": list(zero.memory.samples),
        "unit_sizes": zero.unit_sizes,
        "shard_sizes": zero.shard_sizes,
        "passed_bytes": passed,
        "sent_bytes": sum(s.nbytes for s in meter.sent),
    }


def ddp_train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-2,
    loss_fn: Callable = nn.functional.cross_entropy,
    torch_ddp: bool = False,
) -> dict[str, torch.Tensor]:
    """Rank function, the reference: plain data parallelism with Adam on the same shares of the
    same batches; returns the parameters. By default chapter 3's
    :class:`~dmlbook.data_parallel.BucketedDDP` (checked against torch's DDP in chapter 3) and
    :func:`adam_update_` per parameter; ``torch_ddp=True`` uses torch's DistributedDataParallel and
    ``torch.optim.Adam``, whose first step imports torch._dynamo (seconds on a small machine).
    Outside a process group it is single-process training."""
    model = make_model()
    if torch_ddp:
        from torch.nn.parallel import DistributedDataParallel

        ddp, optimizer = DistributedDataParallel(model), torch.optim.Adam(model.parameters(), lr)
    else:
        from dmlbook.data_parallel import BucketedDDP

        ddp = BucketedDDP(model) if dist.is_initialized() else model
        optimizer = _PlainAdam(list(model.parameters()), lr)
    sync = None if ddp is not model else NoSync()  # a DDP wrapper syncs during backward
    train_loop(ddp, optimizer, None, None, _local_batches(batches), sync=sync,
               forward_backward=ForwardBackward(loss_fn))  # fmt: skip
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _PlainAdam:
    """:func:`adam_update_` on every parameter, with its moments: Adam with nothing sharded."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params, self.lr, self.steps = params, lr, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for p, (exp_avg, exp_avg_sq) in zip(self.params, self.moments, strict=True):
            adam_update_(p, p.grad, exp_avg, exp_avg_sq, self.steps, self.lr, 0.9, 0.999, 1e-8)


def fsdp2_train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-2,
    loss_fn: Callable = nn.functional.cross_entropy,
) -> dict[str, torch.Tensor]:
    """Rank function, torch's counterpart of stage 3: FSDP2 (``fully_shard`` on every module
    that owns parameters, then on the root) with ``torch.optim.Adam`` on the sharded DTensor
    parameters; returns the full parameters."""
    model = fsdp2_wrap(make_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    # FSDP2 reduce-scatters the averaged gradient in backward: the loop syncs nothing.
    train_loop(model, optimizer, None, None, _local_batches(batches), sync=NoSync(),
               forward_backward=_QuietFSDP2(loss_fn))  # fmt: skip
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def fsdp2_wrap(model: nn.Module) -> nn.Module:
    """FSDP2 around ``model``: ``fully_shard`` each module that owns parameters (a unit: gathered
    before its forward and backward, freed after, its gradient reduce-scattered), then the root
    (the parameters no unit claimed). Each parameter becomes a DTensor, sharded by rows. Chapter
    9b checks it against :class:`~dmlbook.advanced.zero.ZeroStage3`."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module)
    return fully_shard(model)


class _QuietFSDP2(ForwardBackward):
    """The loop's default step, without FSDP2's caution that in-place ops on an output that is
    a view would skip the pre-backward gather (the models here do none)."""

    def loss(self, state: LoopState, batch: Batch) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
            return super().loss(state, batch)
