"""The point-to-point plumbing that every from-scratch collective shares (chapter 2; chapter 4).

:mod:`dmlbook.comm.algorithms` writes each collective as a schedule of messages, and
:mod:`dmlbook.comm.collectives` wraps them in ``torch.distributed``'s signatures. Both stand on
what is here:

* ``Comm``: a rank's view of a group, its rank and size there, and messages addressed by group
  rank. Inside ``with collectives.recording_sends() as sends:`` every message sent through it is
  recorded as a :class:`~dmlbook.comm.trace.Send`; outside, the record costs nothing;
* the checks every collective makes first: a supported dtype (``DTYPES``, ``check_tensor``), a
  supported ``ReduceOp`` (``check_op``);
* ``combine``, the reduction itself (AVG sums and divides once at the end, ``finish_avg``);
* ``scratch_buffer``, receive buffers kept from call to call, and ``flat_view``/``write_back``,
  which let the algorithms work on a flat view of any tensor, contiguous or not.

They are public because the modules beside this one use them (``algorithms``, ``collectives``,
``shm`` and ``shapecheck``); a chapter reads the collectives, not this plumbing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dmlbook.comm import trace
from dmlbook.comm.trace import Send

__all__ = [
    "DTYPES",
    "Comm",
    "check_op",
    "check_tensor",
    "combine",
    "finish_avg",
    "flat_view",
    "scratch_buffer",
    "write_back",
]

# The dtypes every from-scratch collective accepts (as gloo does).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)


class Comm:
    """A rank's view of a group: its rank and size there, and messages addressed by group rank
    (translated to global ranks for ``dist.isend``, as ``torch.distributed`` wants).

    Messages go through ``dist.isend``/``dist.irecv``, the primitive chapter 2 builds on (and
    whose calls its exercise checker counts). Calling the process group's own ``send``/``recv``
    would skip their argument checks, about 7 microseconds a call here; a 64 KiB ring
    all-reduce at world size 2 (four calls, about 0.4 ms) came out 3-30 microseconds faster,
    within the machine's noise, so the ring keeps the primitive it teaches.

    A finished receive's ``Work`` is kept (``received``) until :meth:`wait_all` or the end of
    the collective, as a ring written inline keeps its last one. Freed as soon as its step was
    done (the reduce-scatter returning, its list of receives gone), the all-gather after it
    took 0.01-0.07 ms longer to post and finish on gloo at world size 2 (64 KiB and 1 MiB, two
    launches of 500 interleaved calls each, ``time.perf_counter`` between the calls); kept, it
    took as long as after the inline ring (within 0.02 ms)."""

    def __init__(self, group, collective: str) -> None:
        world = dist.group.WORLD
        self.group = group
        self.pg = world if group is None else group  # for ShapeCheck's plumbing
        self.is_world = world is not None and self.pg is world  # group ranks are global ranks
        if self.is_world:  # the process group's own answers: no lookups on every small collective
            self.rank, self.size = world.rank(), world.size()
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.collective = collective
        self.pending: list[dist.Work] = []
        self.in_flight: list[torch.Tensor] = []  # tensors made just to be sent, kept until sent
        self.received: list[dist.Work] = []  # finished receives, freed together at the end
        self._me = self.global_rank(self.rank) if self.rank >= 0 else -1

    def member(self) -> bool:
        return self.rank >= 0

    def global_rank(self, group_rank: int) -> int:
        if self.is_world:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def group_rank(self, global_rank: int, name: str) -> int:
        if self.is_world:
            ranks = range(self.size)
            if global_rank not in ranks:
                raise ValueError(f"{name}={global_rank} is not a rank of a world of {self.size}")
            return global_rank
        try:
            return dist.get_group_rank(self.group, global_rank)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{name}={global_rank} is not a rank of this group") from e

    def isend(self, t: torch.Tensor, peer: int, step: int, phase: str, chunk=None) -> None:
        """Start sending ``t`` to group rank ``peer``; :meth:`wait_all` finishes it."""
        if t.numel() == 0:
            return
        self.record(t, peer, step, phase, chunk)  # free unless a recording is open
        self.pending.append(dist.isend(t, self.global_rank(peer), self.group, step))
        self.in_flight.append(t)

    def record(self, t: torch.Tensor, peer: int, step: int, phase: str, chunk=None) -> None:
        """Count ``t`` as a message to ``peer`` in any open ``recording_sends()`` block."""
        if trace.is_recording():
            nbytes = t.numel() * t.element_size()
            dst = self.global_rank(peer)
            trace.record(Send(self.collective, phase, step, self._me, dst, nbytes, chunk))

    def irecv(self, t: torch.Tensor, peer: int, step: int) -> dist.Work | None:
        """Start receiving into ``t`` from group rank ``peer``; wait on what it returns."""
        if t.numel() == 0:
            return None
        work = dist.irecv(t, self.global_rank(peer), self.group, step)
        self.received.append(work)
        return work

    def recv(self, t: torch.Tensor, peer: int, step: int) -> None:
        work = self.irecv(t, peer, step)
        if work is not None:
            work.wait()

    def wait_all(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
        self.in_flight.clear()
        self.received.clear()


def check_tensor(tensor, name: str = "tensor") -> None:
    """A TypeError unless ``tensor`` is a tensor of one of :data:`DTYPES`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; supported: {', '.join(map(str, DTYPES))}"
        )


def check_op(op, dtype: torch.dtype) -> None:
    """A ValueError unless ``op`` is a supported ``ReduceOp`` (AVG: on a floating dtype)."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        raise ValueError(f"op must be ReduceOp.SUM, AVG, PRODUCT, MIN or MAX, got {op}")
    if op == ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(f"ReduceOp.AVG needs a floating dtype, got {dtype}")


# Each ReduceOp as an elementwise torch function; AVG sums, and finish_avg divides once at the end.
_ELEMENTWISE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
}


def combine(acc: torch.Tensor, incoming: torch.Tensor, op, out: torch.Tensor | None = None) -> None:
    """out <- acc (op) incoming; with no ``out``, into ``acc`` in place."""
    _ELEMENTWISE[op](acc, incoming, out=acc if out is None else out)


def finish_avg(t: torch.Tensor, op, size: int) -> None:
    """AVG's last step: divide the sum in ``t`` by ``size`` once (any other op: nothing)."""
    if op == ReduceOp.AVG:
        t.div_(size)


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def scratch_buffer(
    numel: int, like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A receive buffer of ``numel`` elements on ``like``'s device (of its dtype, or ``dtype``),
    reused from call to call (as gloo and NCCL keep theirs): a fresh multi-megabyte buffer costs
    a page fault per 4 KiB the first time it is written, which at 2 GB/s links is a large share
    of the transfer itself."""
    dtype = dtype or like.dtype
    key = (dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=like.device)
    return buf[:numel]


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one dimension: a view if contiguous, else a copy (see :func:`write_back`)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` (from :func:`flat_view`) into ``tensor`` if it was a copy, not a view."""
    if tensor.is_contiguous():
        return  # flat is a view of tensor already
    tensor.copy_(flat.view(tensor.shape))
