"""Every collective, written from point-to-point ``isend``/``irecv`` (chapter 2; chapter 4's tree).

Chapter 2 teaches what ``dist.all_reduce`` and its relatives do on the wire by building each one
from the only primitive a network really offers, a message from one rank to another:

* ``broadcast`` and ``reduce`` walk a binomial tree: ceil(log2 p) rounds, each doubling (or
  halving) the number of ranks that hold the data;
* ``gather`` and ``scatter`` are direct: the root talks to every other rank;
* ``all_gather`` and ``reduce_scatter`` go round a ring, one chunk per step;
* ``all_reduce`` offers four algorithms, :data:`ALGORITHMS`, so that their cost can be measured
  and compared with :mod:`dmlbook.comm.costmodel`: ``"ring"`` (reduce-scatter then all-gather,
  the least traffic any algorithm can send), ``"tree"`` (binomial-tree reduce to rank 0, then
  broadcast; chapter 4), ``"recursive_doubling"`` (log2 p rounds of pairwise exchange) and
  ``"naive"`` (everyone sends to rank 0, as to a parameter server). The ring also takes
  ``transfer_dtype`` (chapter 4, beside gradient compression): chunks travel in bf16 or fp16,
  half the bytes of fp32, while every addition happens in the tensor's own precision.

This module is the public layer: checks, then the algorithm, then the result written back. The
messages of each algorithm are in :mod:`dmlbook.comm.algorithms`, and the plumbing they share (a
rank's view of its group, the reduction, receive buffers) in :mod:`dmlbook.comm.p2p`.

Signatures follow ``torch.distributed``: the tensor is changed in place, ``src``/``dst`` are global
ranks, ``group`` selects a subgroup, and ``op`` is a ``dist.ReduceOp`` (SUM, AVG, PRODUCT, MIN,
MAX; AVG needs a floating dtype, as with NCCL). Every algorithm works for any world size and any
tensor length, including lengths shorter than the world size, and leaves every rank with the
same bits. Each call checks that all ranks passed the same shape and dtype (``check=False``
skips it), so a mismatch is a ValueError naming the ranks, not a hang: the rings (all-reduce,
all-gather, reduce-scatter) and recursive doubling carry the check in their first message, the
others send it first, in one extra round (:mod:`dmlbook.comm.shapecheck`).

Inside ``with recording_sends() as sends:`` every message a rank sends is appended to ``sends`` as a
:class:`Send` (collective, phase, step, src, dst, bytes, chunk); :func:`chunk_holdings` replays a
ring all-reduce's sends to show which chunk sits where after each step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch.distributed import ReduceOp

from dmlbook.comm import shm, trace
from dmlbook.comm.algorithms import (
    ALGORITHMS,
    ALL_REDUCE_BY_NAME,
    AUTO_RING_FROM_BYTES,
    choose_all_reduce,
    chunk_holdings,
    recursive_doubling_all_reduce,
    sliced_ring_all_gather,
    sliced_ring_all_reduce,
    sliced_ring_reduce_scatter,
    tree_broadcast,
    tree_reduce,
)

# A copy, for reading: to change how the ring slices, set comm.groups.RING_SLICE_BYTES.
from dmlbook.comm.groups import RING_SLICE_BYTES as RING_SLICE_BYTES
from dmlbook.comm.p2p import (
    DTYPES,
    Comm,
    check_op,
    check_tensor,
    finish_avg,
    flat_view,
    write_back,
)
from dmlbook.comm.shapecheck import ShapeCheck
from dmlbook.comm.trace import Send

__all__ = [
    "ALGORITHMS",
    "AUTO_RING_FROM_BYTES",
    "choose_all_reduce",
    "Send",
    "all_gather",
    "all_reduce",
    "broadcast",
    "chunk_holdings",
    "gather",
    "recording_sends",
    "reduce",
    "reduce_scatter",
    "scatter",
]


def recording_sends() -> AbstractContextManager[list[Send]]:
    """Record every message this rank sends inside the block into the yielded list
    (:func:`dmlbook.comm.trace.recording` of :class:`Send` events)."""
    return trace.recording(Send)


# --------------------------------------------------------------------------- the shape check


def _check_same_shape(comm: Comm, tensor: torch.Tensor, what: str) -> None:
    """The header alone to and from every peer (:class:`~dmlbook.comm.shapecheck.ShapeCheck`):
    a mismatch is a ValueError on every rank, naming the ranks that disagree, never a hang."""
    if comm.size > 1:
        ShapeCheck(comm, tensor, what).exchange()


def _carried_check(comm: Comm, tensor: torch.Tensor, what: str) -> ShapeCheck | None:
    """The check an all-gather's or reduce-scatter's ring carries in its first message:
    ``tensor`` is one chunk of the ring (None when alone in the group: nothing to check)."""
    return ShapeCheck(comm, tensor, what, shard=True) if comm.size > 1 else None


# --------------------------------------------------------------------------- public collectives


def all_reduce(
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    algorithm: str = "ring",
    check: bool = True,
    transfer_dtype: torch.dtype | None = None,
) -> None:
    """Reduce ``tensor`` over the ranks of ``group`` with ``op``; every rank gets the result.

    ``algorithm="auto"`` chooses by size, as production libraries do: recursive doubling for
    small tensors, the ring for large ones (:func:`~dmlbook.comm.algorithms.choose_all_reduce`,
    whose threshold chapter 4 measures). ``transfer_dtype`` (ring only, a floating tensor;
    with "auto", the ring): send chunks in that dtype, e.g.
    ``torch.bfloat16``, and add them up in ``tensor``'s own precision. ``algorithm="shm"``
    sends no message at all: ranks on one host meet in shared memory (:mod:`dmlbook.comm.shm`,
    chapter 4), and its size check is free.
    """
    if algorithm == "shm" and transfer_dtype is None:
        return shm.shm_all_reduce(tensor, op, group)
    check_tensor(tensor)
    check_op(op, tensor.dtype)
    if algorithm not in ALL_REDUCE_BY_NAME and algorithm != "auto":
        raise ValueError(
            f"algorithm must be one of {ALGORITHMS}, 'auto' or 'shm', got {algorithm!r}"
        )
    if transfer_dtype is not None:
        _check_transfer_dtype(transfer_dtype, tensor.dtype, op, algorithm)
    comm = Comm(group, "all_reduce")
    if not comm.member():
        return
    if comm.size == 1:
        return
    if algorithm == "auto":  # by size, as NCCL and gloo choose (chapter 4)
        nbytes = tensor.numel() * tensor.element_size()
        algorithm = "ring" if transfer_dtype else choose_all_reduce(nbytes, comm.size)
    # The ring and recursive doubling carry the check in their first message; the others send
    # it alone first.
    carried = check and algorithm in ("ring", "recursive_doubling") and tensor.numel() > 0
    if check and not carried:
        _check_same_shape(comm, tensor, "tensor shapes or dtypes")
    if tensor.numel() == 0:
        return
    flat = flat_view(tensor)
    what = "tensor shapes or dtypes"
    shapes = ShapeCheck(comm, tensor, what, transfer_dtype) if carried else None
    if algorithm == "ring":
        sliced_ring_all_reduce(comm, flat, op, transfer_dtype, shapes)
    elif algorithm == "recursive_doubling":
        recursive_doubling_all_reduce(comm, flat, op, shapes)
    else:
        ALL_REDUCE_BY_NAME[algorithm](comm, flat, op)
    finish_avg(flat, op, comm.size)
    write_back(tensor, flat)


def _check_transfer_dtype(wire: torch.dtype, dtype: torch.dtype, op, algorithm: str) -> None:
    if algorithm not in ("ring", "auto"):
        raise ValueError(f"transfer_dtype is a ring option; algorithm={algorithm!r} sends as is")
    if not (wire.is_floating_point and dtype.is_floating_point) or wire not in DTYPES:
        raise TypeError(f"transfer_dtype={wire} for a {dtype} tensor: both must be floating")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"transfer_dtype rounds partial sums: op must be SUM or AVG, got {op}")


def _tree_setup(name: str, tensor, root_rank: int, root_name: str, group, check: bool):
    """What reduce and broadcast check first. Returns (comm, the root's group rank), or None
    when this rank has nothing to do: outside ``group``, alone in it, or an empty tensor."""
    comm = Comm(group, name)
    if not comm.member():
        return None
    root = comm.group_rank(root_rank, root_name)
    if check:
        _check_same_shape(comm, tensor, "tensor shapes or dtypes")
    if comm.size == 1 or tensor.numel() == 0:
        return None
    return comm, root


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, check: bool = True) -> None:
    """Reduce ``tensor`` over the ranks onto global rank ``dst`` (binomial tree).

    Only ``dst``'s tensor changes; the other ranks' tensors are left as they were.
    """
    check_tensor(tensor)
    check_op(op, tensor.dtype)
    if (setup := _tree_setup("reduce", tensor, dst, "dst", group, check)) is None:
        return
    comm, root = setup
    work = tensor.detach().clone().view(-1) if comm.rank != root else flat_view(tensor)
    tree_reduce(comm, work, root, op)
    if comm.rank == root:
        finish_avg(work, op, comm.size)
        write_back(tensor, work)


def broadcast(tensor: torch.Tensor, src: int, group=None, check: bool = True) -> None:
    """Copy global rank ``src``'s ``tensor`` into every rank's ``tensor`` (binomial tree)."""
    check_tensor(tensor)
    if (setup := _tree_setup("broadcast", tensor, src, "src", group, check)) is None:
        return
    comm, root = setup
    flat = flat_view(tensor)
    tree_broadcast(comm, flat, root)
    write_back(tensor, flat)


def _check_list(tensors, size: int, like: torch.Tensor, name: str) -> None:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != size:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{name} must be a list of {size} tensors (one per rank), got {got}")
    for i, t in enumerate(tensors):
        check_tensor(t, f"{name}[{i}]")
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}; "
                f"expected {tuple(like.shape)} and {like.dtype} like the tensor"
            )


def _rooted(name: str, tensor, tensors, root_rank: int, root_name: str, group, check: bool):
    """Checks shared by gather and scatter: only the root passes a list of one tensor per rank.
    Returns (comm, root's group rank), or (None, None) on a rank outside ``group``."""
    check_tensor(tensor)
    comm = Comm(group, name)
    if not comm.member():
        return None, None
    root = comm.group_rank(root_rank, root_name)
    list_name = f"{name}_list"
    if comm.rank == root:
        _check_list(tensors, comm.size, tensor, list_name)
    elif tensors is not None:
        raise ValueError(f"{list_name} must be None on ranks other than {root_name}")
    if check:
        _check_same_shape(comm, tensor, "tensor shapes or dtypes")
    return comm, root


def gather(
    tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, check: bool = True
) -> None:
    """Every rank sends ``tensor`` to global rank ``dst``, which stores rank i's in
    ``gather_list[i]`` (group rank order). Other ranks pass ``gather_list=None``."""
    comm, root = _rooted("gather", tensor, gather_list, dst, "dst", group, check)
    if comm is None:
        return
    if comm.rank == root:
        recvs = []
        for r in range(comm.size):
            if r == root:
                gather_list[r].copy_(tensor)
            else:
                out = gather_list[r]
                buf = out if out.is_contiguous() else torch.empty_like(out)
                recvs.append((out, buf, comm.irecv(buf, r, 0)))
        for out, buf, work in recvs:
            if work is not None:
                work.wait()
            if buf is not out:
                out.copy_(buf)
    else:
        comm.isend(tensor.contiguous(), root, 0, "gather")
        comm.wait_all()


def scatter(
    tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, check: bool = True
) -> None:
    """Global rank ``src`` sends ``scatter_list[i]`` to group rank i, which stores it in
    ``tensor``. Other ranks pass ``scatter_list=None``."""
    comm, root = _rooted("scatter", tensor, scatter_list, src, "src", group, check)
    if comm is None:
        return
    if comm.rank == root:
        for r in range(comm.size):
            if r == root:
                tensor.copy_(scatter_list[r])
            else:
                comm.isend(scatter_list[r].contiguous(), r, 0, "scatter")
        comm.wait_all()
    else:
        flat = flat_view(tensor)
        comm.recv(flat, root, 0)
        write_back(tensor, flat)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, check: bool = True
) -> None:
    """Every rank ends with every rank's ``tensor``: ``tensor_list[i]`` is group rank i's (ring)."""
    check_tensor(tensor)
    comm = Comm(group, "all_gather")
    if not comm.member():
        return
    _check_list(tensor_list, comm.size, tensor, "tensor_list")
    # the check rides in the ring's first message
    shapes = _carried_check(comm, tensor, "tensor shapes or dtypes") if check else None
    n = tensor.numel()
    flat = torch.empty(comm.size * n, dtype=tensor.dtype, device=tensor.device)
    flat[comm.rank * n : (comm.rank + 1) * n] = tensor.reshape(-1)
    chunks = [(r * n, (r + 1) * n) for r in range(comm.size)]
    sliced_ring_all_gather(comm, flat, chunks, check=shapes)
    for r, out in enumerate(tensor_list):
        out.copy_(flat[r * n : (r + 1) * n].view(tensor.shape))


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op=ReduceOp.SUM,
    group=None,
    check: bool = True,
) -> None:
    """Reduce ``input_list[i]`` over the ranks into group rank i's ``output`` (ring)."""
    check_tensor(output, "output")
    check_op(op, output.dtype)
    comm = Comm(group, "reduce_scatter")
    if not comm.member():
        return
    _check_list(input_list, comm.size, output, "input_list")
    # the check rides in the ring's first message
    shapes = _carried_check(comm, output, "output shapes or dtypes") if check else None
    n = output.numel()
    flat = torch.cat([t.reshape(-1) for t in input_list]) if n else output.new_empty(0)
    chunks = [(r * n, (r + 1) * n) for r in range(comm.size)]
    sliced_ring_reduce_scatter(comm, flat, op, chunks, check=shapes)
    comm.wait_all()  # its last sends
    mine = flat[comm.rank * n : (comm.rank + 1) * n]
    finish_avg(mine, op, comm.size)
    output.copy_(mine.view(output.shape))
