"""A readable DDP: torch's DistributedDataParallel written from scratch (chapter 3).

* :class:`BucketedDDP` (alias ``DistributedDataParallel``) is torch's DDP written from scratch:
  gradients are grouped into buckets, each bucket's all-reduce starts *during* backward as soon
  as its last gradient is ready, and a callback queued in the autograd engine waits for them all
  at the end of backward. It has torch's ``no_sync``, ``find_unused_parameters`` and
  ``register_comm_hook``, and its tests check it against torch's DDP.
* :class:`NaiveDDP` is chapter 1's
  :func:`~dmlbook.data_parallel.average_gradients_per_parameter` behind the same interface:
  one blocking all-reduce per parameter after backward, so a notebook (and
  ``python -m dmlbook.bench ddp``) can set the two side by side.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dmlbook.data_parallel.averaging import average_gradients_per_parameter, broadcast_parameters

__all__ = [
    "BucketedDDP",
    "DataParallelWrapper",
    "DistributedDataParallel",
    "GradBucket",
    "NaiveDDP",
    "assign_buckets",
]


@dataclass
class CommStats:
    """What a DDP wrapper communicated for the gradients, counted on this rank."""

    syncs: int = 0  # backward passes that averaged gradients (those under no_sync do not)
    collectives: int = 0  # gradient collectives launched: one per bucket, or one per parameter
    bytes: int = 0  # gradient bytes handed to communication, before any compression by a hook


class GradBucket:
    """Several gradients flattened into one buffer: what a communication hook is given.

    It has the methods of ``torch.distributed.GradBucket``, so a hook written for torch's DDP
    (``fp16_compress_hook``, chapter 4's compression hooks) runs on :class:`BucketedDDP` as is.
    """

    def __init__(self, index: int, params: list[nn.Parameter], is_last: bool) -> None:
        self._index, self._params, self._is_last = index, params, is_last
        numel, first = sum(p.numel() for p in params), params[0]
        self.set_buffer(torch.zeros(numel, dtype=first.dtype, device=first.device))

    def index(self) -> int:
        """The bucket's place in launch order: bucket 0 holds the last parameters."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients, ``(sum of the parameters' numel,)``."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the bucket's flat buffer."""
        self._buffer = tensor
        self._views = _unflatten(tensor, self._params)

    def gradients(self) -> list[torch.Tensor]:
        """One view of the buffer per parameter, shaped like it."""
        return self._views

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients the bucket holds, in buffer order."""
        return self._params

    def is_last(self) -> bool:
        """Whether this is the last bucket of the step to be communicated."""
        return self._is_last


def _unflatten(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the flat ``(n,)`` tensor, one per parameter and shaped like it."""
    pieces = flat.split([p.numel() for p in params])
    return [piece.view_as(p) for piece, p in zip(pieces, params, strict=True)]


def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets, last parameter first.

    Backward produces gradients roughly in the reverse of the order in which the parameters
    were defined, so bucket 0 fills first. As in torch, a bucket is closed as soon as it holds
    ``bucket_cap_bytes`` or more (so its last parameter may take it over the cap), and it holds
    one dtype on one device.
    """
    buckets: list[list[int]] = []
    size, kind = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        if not buckets or size >= bucket_cap_bytes or (p.dtype, p.device) != kind:
            buckets.append([])  # start a new bucket
            size, kind = 0, (p.dtype, p.device)
        buckets[-1].append(i)
        size += p.numel() * p.element_size()
    return buckets


class DataParallelWrapper(nn.Module):
    """What both DDP wrappers share: the initial broadcast, ``no_sync``, and the gradient hooks.

    A hook on every parameter runs as soon as backward has accumulated the parameter's gradient
    into ``.grad``, and calls :meth:`gradient_ready`. The first hook of a backward pass queues a
    callback in the autograd engine, which runs :meth:`finish_gradient_synchronization` once
    backward is over, before ``backward()`` returns, so ``optimizer.step()`` always sees averaged
    gradients. As with
    torch's DDP: one backward per forward, and activation checkpointing of the non-reentrant
    kind (a reentrant one runs a backward inside the backward, which would end it early).
    """

    def __init__(
        self,
        module: nn.Module,
        group=None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__} needs a process group: build it in a rank function "
                "(dmlbook.launch.run) or after dist.init_process_group()"
            )
        self.module = module
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        self._src = 0 if group is None else dist.get_global_rank(group, 0)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        broadcast_parameters(module, src=self._src, group=group)  # communication: all start equal
        self._require_sync = True  # False inside no_sync()
        self._sync_backward = True  # the last forward's choice, as in torch
        self._used: set[int] = set()  # parameters that accumulated a gradient since the last sync
        self._ready: set[int] = set()  # parameters whose gradient is ready in this backward
        self._callback_queued = False  # True from the first gradient to the end of backward
        me = weakref.ref(self)  # the hooks must not keep a deleted wrapper alive

        def hook_for(index: int) -> Callable[[torch.Tensor], None]:
            def hook(param: torch.Tensor) -> None:  # autograd: param.grad is complete
                if (wrapper := me()) is not None:
                    wrapper.gradient_accumulated(index)

            return hook

        self._hooks = [
            p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(self._params)
        ]

    def __del__(self) -> None:
        for handle in self.__dict__.get("_hooks", []):
            handle.remove()

    def forward(self, *args, **kwargs):
        if self._callback_queued:  # the last backward raised before its end: start afresh
            self._callback_queued = False
            self._start_step()
        if torch.is_grad_enabled():
            # As in torch, the forward decides whether the backward through its graph syncs.
            self._sync_backward = self._require_sync
            if self._require_sync and self.broadcast_buffers:
                for buffer in self._module_buffers:  # e.g. BatchNorm's running statistics
                    dist.broadcast(buffer, src=self._src, group=self.group)  # communication
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: a backward whose forward ran in here communicates nothing.

        Gradients add up in ``.grad``; the first backward after the block (forward included)
        averages the accumulated ``.grad`` over the ranks. Divide each micro-batch's loss by
        their number to get the gradient of the mean over all of them.
        """
        before, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = before

    def gradient_accumulated(self, index: int) -> None:
        """The hook on every parameter: autograd has just added its gradient into ``.grad``."""
        self._used.add(index)
        if not self._sync_backward:
            return  # no_sync: the gradient simply stays in .grad
        if not self._callback_queued:  # the first gradient of this backward pass
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._ready.add(index)
        self.gradient_ready(index)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        try:
            self.finish_gradient_synchronization()
        finally:
            self._start_step()

    def _start_step(self) -> None:
        """Forget the last synchronisation: nothing used, nothing ready."""
        self._used.clear()
        self._ready.clear()

    def gradient_ready(self, index: int) -> None:
        """Called in backward once parameter ``index``'s gradient is in ``.grad`` (and the
        backward syncs): a wrapper that communicates during backward starts it here."""

    def finish_gradient_synchronization(self) -> None:
        """Average the gradients over the ranks; called by autograd at the end of backward."""
        raise NotImplementedError

    def _missing(self, indices: Sequence[int]) -> list[int]:
        return [i for i in indices if i not in self._ready]

    def _unused_error(self, missing: list[int]) -> RuntimeError:
        names = ", ".join(self._names[i] for i in sorted(missing))
        return RuntimeError(
            f"{type(self).__name__}: no gradient reached {names} in this backward pass, so "
            "the ranks cannot average it (the other ranks would wait for it forever). Pass "
            "find_unused_parameters=True if parameters may sit out a step; otherwise make "
            "every parameter take part in the loss."
        )

    def _globally_used(self) -> list[int]:
        """How many ranks accumulated a gradient into each parameter since the last sync."""
        used = torch.zeros(len(self._params), dtype=torch.int32, device=self._params[0].device)
        used[sorted(self._used)] = 1
        dist.all_reduce(used, group=self.group)  # communication: a small extra all-reduce
        return used.tolist()


class BucketedDDP(DataParallelWrapper):
    """``DistributedDataParallel`` from scratch: bucketed all-reduces overlapped with backward.

    Chapter 3 uses it to show what torch's DDP does. The parameters are grouped into buckets
    of about ``bucket_cap_mb`` (:func:`assign_buckets`); as soon as backward has produced the
    last gradient of a bucket, the bucket is flattened and its all-reduce starts, while backward
    goes on computing the earlier layers' gradients. Buckets start strictly in order, so every
    rank issues the same collectives in the same order. At the end of backward,
    :meth:`finish_gradient_synchronization` waits for all of them and copies the averages back
    into ``.grad`` (Li et al. 2020, "PyTorch Distributed", VLDB).

    A parameter that got no gradient leaves its bucket incomplete. Then backward raises a
    ``RuntimeError`` naming it, unless ``find_unused_parameters=True``: at the end of backward
    such a parameter contributes its ``.grad`` (zeros if it has none) to its bucket; if no rank
    used it since the last sync its ``.grad`` is left as it was (None after ``zero_grad``),
    else it gets the average. This is torch's behaviour, checked against it in the tests.

    ``register_comm_hook(state, hook)`` replaces the default average with torch's contract
    (chapter 4's :func:`dmlbook.comm.compression.allreduce_hook` is that average, as a hook);
    ``stats`` counts what was communicated. Unlike torch, the buckets keep their first layout
    (torch re-buckets once, in the order the gradients arrived in the first step).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        group=None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__(module, group, broadcast_buffers, find_unused_parameters)
        self.bucket_cap_mb = bucket_cap_mb
        self._members = assign_buckets(self._params, int(bucket_cap_mb * 2**20))
        self._bucket_of = {i: b for b, members in enumerate(self._members) for i in members}
        last = len(self._members) - 1
        self._buckets = [
            GradBucket(b, [self._params[i] for i in members], is_last=b == last)
            for b, members in enumerate(self._members)
        ]
        self._comm_state, self._comm_hook = None, self.allreduce_bucket  # register_comm_hook
        self._custom_hook = False
        self._futures: list[torch.futures.Future] = []  # one per launched bucket
        self._start_step()

    def register_comm_hook(self, state, hook: Callable) -> None:
        """Communicate each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's
        contract): the future's value is the bucket's flat gradient averaged over the ranks."""
        if self._custom_hook:
            raise RuntimeError("register_comm_hook can be called only once")
        self._comm_state, self._comm_hook, self._custom_hook = state, hook, True

    def _start_step(self) -> None:
        super()._start_step()
        for future in self._futures:  # all done, unless the last backward failed half-way
            future.wait()
        self._futures = []
        self._waiting_for = [len(members) for members in self._members]  # gradients per bucket
        self._next_bucket = 0  # the next bucket to launch

    def gradient_ready(self, index: int) -> None:
        """The hook: backward has just put parameter ``index``'s gradient in ``.grad``."""
        bucket = self._bucket_of[index]
        self._waiting_for[bucket] -= 1  # gradients the bucket still waits for
        if self._waiting_for[bucket] == 0:  # its last one: the bucket is full
            self.launch_ready_buckets()

    def launch_ready_buckets(self) -> None:
        """Start every full bucket's all-reduce, in bucket order: all ranks must issue the same
        collectives in the same order, whatever order their gradients came in."""
        while self._next_bucket < len(self._buckets) and not self._waiting_for[self._next_bucket]:
            bucket = self._buckets[self._next_bucket]
            self._futures.append(self.launch_bucket(bucket))  # returns at once
            self._next_bucket += 1

    def launch_bucket(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Copy the bucket's gradients into its flat buffer and hand it to the communication
        hook, which starts averaging it over the ranks and returns a future at once."""
        self._count(bucket)
        grads = [_grad_or_zeros(p) for p in bucket.parameters()]
        torch._foreach_copy_(bucket.gradients(), grads)  # flatten into the (n,) buffer
        return self._comm_hook(self._comm_state, bucket)  # communication, in the background

    def allreduce_bucket(self, state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The default communication hook: divide the buffer by the world size and start an
        all-reduce (sum) of it; the future's value is the averaged buffer."""
        buffer = bucket.buffer().div_(self.world_size)
        work = dist.all_reduce(buffer, group=self.group, async_op=True)  # returns at once
        return work.get_future().then(lambda done: done.value()[0])

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket and copy the averaged gradients back into ``.grad``.

        The autograd engine calls it at the end of every backward pass that syncs.
        """
        used = self._launch_the_rest()  # None unless find_unused_parameters
        for bucket, future in zip(self._buckets, self._futures, strict=True):
            averaged = _unflatten(future.wait(), bucket.parameters())  # blocks until it is done
            if used is None:  # every parameter has its .grad: one call copies them all
                torch._foreach_copy_([p.grad for p in bucket.parameters()], averaged)
            else:
                self._copy_used(bucket, averaged, used)
        self.stats.syncs += 1

    def _count(self, bucket: GradBucket) -> None:
        self.stats.collectives += 1
        self.stats.bytes += bucket.buffer().numel() * bucket.buffer().element_size()

    def _launch_the_rest(self) -> list[int] | None:
        """Every bucket must have started in backward. With ``find_unused_parameters``, launch
        those that a parameter without a gradient held back, and return how many ranks used
        each parameter; without it, such a parameter is an error."""
        not_launched = [i for m in self._members[self._next_bucket :] for i in m]
        if missing := self._missing(not_launched):
            if not self.find_unused_parameters:
                raise self._unused_error(missing)  # (then _start_step waits for those launched)
            self._waiting_for = [0] * len(self._buckets)  # count the unused ones as ready
            self.launch_ready_buckets()
        return self._globally_used() if self.find_unused_parameters else None

    def _copy_used(self, bucket: GradBucket, averaged: list[torch.Tensor], used: list[int]) -> None:
        members = self._members[bucket.index()]
        for i, p, grad in zip(members, bucket.parameters(), averaged, strict=True):
            if not used[i]:
                continue  # no rank used it: leave .grad alone, as torch does
            if p.grad is None:  # unused here, used on another rank
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, or zeros for a parameter that got no gradient (find_unused_parameters)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


DistributedDataParallel = BucketedDDP


class NaiveDDP(DataParallelWrapper):
    """Chapter 1's :func:`average_gradients_per_parameter` behind :class:`BucketedDDP`'s interface.

    After backward, one blocking all-reduce per parameter: nothing overlaps with backward, and
    each small tensor pays a collective's latency. ``python -m dmlbook.bench ddp`` measures the
    difference. ``no_sync`` and ``find_unused_parameters`` behave as in :class:`BucketedDDP`.
    """

    def finish_gradient_synchronization(self) -> None:
        """All-reduce each gradient in turn and divide by the world size (after backward)."""
        if not self.find_unused_parameters:
            if missing := self._missing(range(len(self._params))):
                raise self._unused_error(missing)
            average_gradients_per_parameter(self.module, self.group)  # communication
            sent = self._params
        else:
            used = self._globally_used()
            sent = [p for i, p in enumerate(self._params) if used[i]]  # skip the unused
            for p in sent:
                if p.grad is None:  # unused here, used on another rank
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.group)  # communication
                p.grad /= self.world_size
        self.stats.syncs += 1
        self.stats.collectives += len(sent)
        self.stats.bytes += sum(p.numel() * p.element_size() for p in sent)
