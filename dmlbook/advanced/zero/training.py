"""Rank functions that train with ZeRO, and the references it must equal (chapter 9b).

:func:`train` trains with a stage; :func:`ddp_train` is plain data parallelism (chapter 3's
BucketedDDP or torch's DDP) with Adam; :func:`fsdp2_train` is torch's stage 3, FSDP2.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.zero.stages import zero_data_parallel
from dmlbook.comm import collectives as C  # a parameter below is named "collectives"
from dmlbook.models import batch_loss
from dmlbook.optim import adam_update_


def _local_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a global batch (equal shares: the global batch must divide)."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(x) % size:
        raise ValueError(f"global batch of {len(x)} does not split evenly over {size} ranks")
    share = len(x) // size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def train(
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
    losses, sends = [], []
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if last:
            zero.memory.reset()
            zero.sent_bytes = dict.fromkeys(zero.sent_bytes, 0)
        xs, ys = _local_batch(x, y)
        zero.zero_grad()
        recording = C.recording() if record_sends and last else nullcontext([])
        with recording as sent:
            loss = batch_loss(zero, (xs, ys), loss_fn)
            loss.backward()
            zero.step()
        sends = [s.nbytes for s in sent]
        losses.append(loss.item())
    passed = dict(zero.sent_bytes)  # before full_parameters() gathers once more
    return {
        "parameters": zero.full_parameters(),
        "losses": losses,
        "peak": zero.memory.peak,
        "samples": list(zero.memory.samples),
        "unit_sizes": zero.unit_sizes,
        "passed_bytes": passed,
        "sent_bytes": sum(sends),
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
    for x, y in batches:
        xs, ys = _local_batch(x, y)
        optimizer.zero_grad()
        batch_loss(ddp, (xs, ys), loss_fn).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _PlainAdam:
    """:func:`adam_update_` on every parameter, with its moments: Adam with nothing sharded."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params, self.lr, self.steps = params, lr, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def zero_grad(self) -> None:
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
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for module in list(model.modules()):
        if module is not model and any(True for _ in module.parameters(False)):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in batches:
        xs, ys = _local_batch(x, y)
        optimizer.zero_grad()
        with warnings.catch_warnings():  # a caution that in-place ops on an output that is a
            # view would skip the pre-backward gather; the models here do none
            warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
            loss = batch_loss(model, (xs, ys), loss_fn)
        loss.backward()  # FSDP2 reduce-scatters the averaged gradient
        optimizer.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
