"""Every collective, written from point-to-point ``isend``/``irecv`` (chapter 2; chapter 4's tree).

Chapter 2 teaches what ``dist.all_reduce`` and its relatives do on the wire by building each one
from the only primitive a network really offers, a message from one rank to another:

* ``broadcast`` and ``reduce`` walk a binomial tree: ceil(log2 p) rounds, each doubling (or
  halving) the number of ranks that hold the data;
* ``gather`` and ``scatter`` are direct: the root talks to every other rank;
* ``all_gather`` and ``reduce_scatter`` go round a ring, one chunk per step;
* ``all_reduce`` offers four algorithms, so that their cost can be measured and compared with
  :mod:`dmlbook.comm.costmodel`:

  - ``"ring"``: reduce-scatter then all-gather; every rank sends 2(p-1)/p of the tensor, the least
    any algorithm can. Each chunk is cut into slices that flow through the ring back to back, so
    that reducing one slice overlaps receiving the next;
  - ``"tree"``: binomial-tree reduce to rank 0, then binomial-tree broadcast (chapter 4);
  - ``"recursive_doubling"``: log2 p rounds of pairwise exchange of the whole tensor; the ranks
    beyond the largest power of two first hand their data to a partner and get the result back;
  - ``"naive"``: everyone sends to rank 0, which reduces and sends the result back, as a parameter
    server does.

  The ring also takes ``transfer_dtype`` (chapter 4, beside gradient compression): chunks travel
  in bf16 or fp16, half the bytes of fp32, while every addition happens in the tensor's own
  precision. Each partial sum is rounded once per hop and the result once more before it goes
  round, so the error grows with the ring's length and not with the precision of the sums; every
  rank still ends with the same bits.

Signatures follow ``torch.distributed``: the tensor is changed in place, ``src``/``dst`` are global
ranks, ``group`` selects a subgroup, and ``op`` is a ``dist.ReduceOp`` (SUM, AVG, PRODUCT, MIN,
MAX; AVG needs a floating dtype, as with NCCL). Every algorithm works for any world size and any
tensor length, including lengths shorter than the world size, and leaves every rank with the
same bits. Each call first checks, in one extra round, that all ranks passed the same shape and
dtype (``check=False`` skips it), so a mismatch is a ValueError naming the ranks, not a hang.

Inside ``with recording() as sends:`` every message a rank sends is appended to ``sends`` as a
:class:`Send` (collective, phase, step, src, dst, bytes, chunk); :func:`chunk_holdings` replays a
ring all-reduce's sends to show which chunk sits where after each step.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dmlbook.comm import trace
from dmlbook.comm.groups import balanced_blocks

__all__ = [
    "ALGORITHMS",
    "Send",
    "all_gather",
    "all_reduce",
    "broadcast",
    "chunk_holdings",
    "gather",
    "recording",
    "reduce",
    "reduce_scatter",
    "scatter",
]

ALGORITHMS = ("ring", "tree", "recursive_doubling", "naive")
# The ring cuts each chunk into slices of about this size, so that reducing one slice overlaps
# receiving the next. Smaller slices overlap more but pay more per-message latency.
RING_SLICE_BYTES = 1 << 20
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)


# --------------------------------------------------------------------------- tracing


@dataclass(frozen=True)
class Send:
    """One message: ``src`` sent ``nbytes`` to ``dst`` at ``step`` of a collective (global ranks)"""

    collective: str
    phase: str
    step: int
    src: int
    dst: int
    nbytes: int
    chunk: int | None = None  # which chunk of the tensor, for the ring algorithms


def recording() -> AbstractContextManager[list[Send]]:
    """Record every message this rank sends inside the block into the yielded list
    (:func:`dmlbook.comm.trace.recording` of :class:`Send` events)."""
    return trace.recording(Send)


def chunk_holdings(sends: list[Send], world_size: int) -> list[list[list[frozenset[int]]]]:
    """Replay a ring all-reduce's sends (gathered from every rank): ``states[t][rank][chunk]`` is
    the set of ranks whose contribution that rank's copy of that chunk holds after ``t`` steps.

    Sends are given in group ranks (a trace of the world group, as the notebook records it).
    """
    holding = [[frozenset([r]) for _ in range(world_size)] for r in range(world_size)]
    states = [[list(row) for row in holding]]
    ring = sorted(
        {(s.step, s.src, s.dst, s.chunk, s.phase) for s in sends if s.collective == "all_reduce"}
    )
    for step in sorted({s[0] for s in ring}):
        moves = [s for s in ring if s[0] == step]
        before = [list(row) for row in holding]  # all sends of a step happen at once
        for _, src, dst, chunk, phase in moves:
            if phase == "reduce-scatter":
                holding[dst][chunk] = before[dst][chunk] | before[src][chunk]
            else:
                holding[dst][chunk] = before[src][chunk]
        states.append([list(row) for row in holding])
    return states


# --------------------------------------------------------------------------- plumbing


class _Comm:
    """A rank's view of a group: its rank and size there, and messages addressed by group rank."""

    def __init__(self, group, collective: str) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.collective = collective
        self.pending: list[dist.Work] = []
        self.in_flight: list[torch.Tensor] = []  # tensors made just to be sent, kept until sent
        self.tag_base = 0  # the shape check uses its own tags, and is not recorded

    def member(self) -> bool:
        return self.rank >= 0

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def group_rank(self, global_rank: int, name: str) -> int:
        if self.group is None or self.group is dist.group.WORLD:
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
        dst = self.global_rank(peer)
        if self.tag_base == 0:  # the shape check is plumbing, not the algorithm's traffic
            trace.record(
                Send(
                    self.collective,
                    phase,
                    step,
                    self.global_rank(self.rank),
                    dst,
                    t.numel() * t.element_size(),
                    chunk,
                )
            )
        self.pending.append(dist.isend(t, dst, group=self.group, tag=self.tag_base + step))
        self.in_flight.append(t)

    def irecv(self, t: torch.Tensor, peer: int, step: int) -> dist.Work | None:
        if t.numel() == 0:
            return None
        return dist.irecv(t, self.global_rank(peer), group=self.group, tag=self.tag_base + step)

    def recv(self, t: torch.Tensor, peer: int, step: int) -> None:
        work = self.irecv(t, peer, step)
        if work is not None:
            work.wait()

    def wait_all(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
        self.in_flight.clear()


def _check_tensor(tensor, name: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; supported: {', '.join(map(str, _DTYPES))}"
        )


def _check_op(op, dtype: torch.dtype) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        raise ValueError(f"op must be ReduceOp.SUM, AVG, PRODUCT, MIN or MAX, got {op}")
    if op == ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(f"ReduceOp.AVG needs a floating dtype, got {dtype}")


def _combine(acc: torch.Tensor, incoming: torch.Tensor, op) -> None:
    """acc <- acc (op) incoming, in place. AVG sums here and divides once at the end."""
    if op == ReduceOp.SUM or op == ReduceOp.AVG:
        acc.add_(incoming)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(incoming)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def _finish_avg(t: torch.Tensor, op, size: int) -> None:
    if op == ReduceOp.AVG:
        t.div_(size)


_DTYPE_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 8
_CHECK_TAGS = 1 << 20  # tags for the shape check, clear of the algorithms' step numbers


def _check_same_shape(comm: _Comm, tensor: torch.Tensor, what: str) -> None:
    """One ring all-gather of a few integers: did every rank pass the same shape and dtype?

    Point-to-point code given mismatched tensors would wait for messages that never come; this
    turns the mismatch into a ValueError on every rank, naming the ranks that disagree.
    """
    if comm.size == 1:
        return
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"{comm.collective} supports tensors of up to {_MAX_DIMS} dimensions")
    width = 2 + _MAX_DIMS
    mine = [tensor.dim(), _DTYPE_CODE[tensor.dtype], *tensor.shape]
    fields = torch.zeros(comm.size * width, dtype=torch.int64, device=tensor.device)
    fields[comm.rank * width : comm.rank * width + len(mine)] = torch.tensor(mine)
    comm.tag_base = _CHECK_TAGS
    try:
        _ring_all_gather(comm, fields, [(r * width, (r + 1) * width) for r in range(comm.size)])
    finally:
        comm.tag_base = 0
    rows = fields.view(comm.size, width).tolist()
    if any(row != rows[0] for row in rows):

        def describe(row):
            return f"{tuple(row[2 : 2 + row[0]])} {_DTYPES[row[1]]}"

        found = ", ".join(
            f"rank {comm.global_rank(r)}: {describe(row)}" for r, row in enumerate(rows)
        )
        raise ValueError(f"{comm.collective}: ranks passed different {what} ({found})")


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A receive buffer of ``numel`` elements, reused from call to call (as gloo and NCCL keep
    theirs): a fresh multi-megabyte buffer costs a page fault per 4 KiB the first time it is
    written, which at 2 GB/s links is a large share of the transfer itself."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    if tensor.is_contiguous():
        return  # flat is a view of tensor already
    tensor.copy_(flat.view(tensor.shape))


# --------------------------------------------------------------------------- trees


def _tree_reduce(comm: _Comm, buf: torch.Tensor, root: int, op, step0: int = 0) -> None:
    """Binomial-tree reduce of ``buf`` (changed in place) to group rank ``root``.

    In round k, every rank whose relative rank has bit k set sends what it holds to the rank 2^k
    below it and drops out; so ceil(log2 p) rounds, and the root ends with everything.
    """
    size, me = comm.size, (comm.rank - root) % comm.size
    incoming = _scratch(buf.numel(), buf)
    mask, step = 1, step0
    while mask < size:
        if me & mask:
            comm.isend(buf, (me - mask + root) % size, step, "reduce")
            comm.wait_all()
            return
        if me + mask < size:
            comm.recv(incoming, (me + mask + root) % size, step)
            _combine(buf, incoming, op)
        mask <<= 1
        step += 1


def _tree_broadcast(comm: _Comm, buf: torch.Tensor, root: int, step0: int = 0) -> None:
    """Binomial-tree broadcast from group rank ``root``: the holders double every round."""
    size, me = comm.size, (comm.rank - root) % comm.size
    mask = 1
    while mask < size:  # receive once, from the rank that got the data one round earlier
        if me & mask:
            comm.recv(buf, (me - mask + root) % size, step0 + mask.bit_length() - 1)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # then pass it on to the ranks below in the tree
        if me + mask < size:
            comm.isend(buf, (me + mask + root) % size, step0 + mask.bit_length() - 1, "broadcast")
        mask >>= 1
    comm.wait_all()


def _tree_all_reduce(comm: _Comm, flat: torch.Tensor, op, step0: int = 0) -> None:
    rounds = math.ceil(math.log2(comm.size))
    _tree_reduce(comm, flat, 0, op, step0)
    _tree_broadcast(comm, flat, 0, step0 + rounds)


# --------------------------------------------------------------------------- all-reduce algorithms


def _ring_slices(start: int, stop: int, element_size: int) -> list[tuple[int, int]]:
    n = stop - start
    parts = max(1, min(16, math.ceil(n * element_size / RING_SLICE_BYTES)))
    return [(start + a, start + b) for a, b in balanced_blocks(n, parts) if b > a]


def _ring_reduce_scatter(comm: _Comm, flat: torch.Tensor, op, chunks, wire=None) -> None:
    """p-1 steps: at step s rank r sends chunk (r-s-1) mod p to r+1 and adds the chunk arriving
    from r-1 into its own copy; afterwards rank r holds chunk r summed over every rank.

    Each chunk travels as slices: a slice is forwarded as soon as it has been reduced, so
    receiving the next slice overlaps the addition. With ``wire`` (a dtype), slices are sent
    rounded to it and added, on arrival, into ``flat``'s own precision.
    """
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    if size == 1:
        return
    wire = wire or flat.dtype
    send = (lambda t: t) if wire == flat.dtype else (lambda t: t.to(wire))
    slices = [_ring_slices(a, b, flat.element_size()) for a, b in chunks]
    longest = max(b - a for a, b in chunks)
    scratch = _scratch(2 * longest, flat.new_empty(0, dtype=wire)).split(longest)  # two steps'

    def post_recvs(step: int):
        c = (rank - step - 2) % size
        base = chunks[c][0]
        buf = scratch[step % 2]
        return [(a, b, comm.irecv(buf[a - base : b - base], left, step)) for a, b in slices[c]]

    c = (rank - 1) % size
    for a, b in slices[c]:
        comm.isend(send(flat[a:b]), right, 0, "reduce-scatter", c)
    recvs = post_recvs(0)
    for step in range(size - 1):
        c = (rank - step - 2) % size
        base = chunks[c][0]
        nxt = post_recvs(step + 1) if step + 1 < size - 1 else []
        for a, b, work in recvs:
            if work is not None:
                work.wait()
            _combine(flat[a:b], scratch[step % 2][a - base : b - base], op)
            if step + 1 < size - 1:  # forward the freshly reduced slice straight away
                comm.isend(send(flat[a:b]), right, step + 1, "reduce-scatter", c)
        recvs = nxt
    comm.wait_all()


def _ring_all_gather(comm: _Comm, flat: torch.Tensor, chunks, step0: int = 0) -> None:
    """p-1 steps: rank r starts by sending its chunk r to r+1; each step forwards what arrived."""
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    if size == 1:
        return
    slices = [_ring_slices(a, b, flat.element_size()) for a, b in chunks]
    for a, b in slices[rank]:
        comm.isend(flat[a:b], right, step0, "all-gather", rank)
    for step in range(size - 1):
        c = (rank - step - 1) % size
        recvs = [(a, b, comm.irecv(flat[a:b], left, step0 + step)) for a, b in slices[c]]
        for a, b, work in recvs:
            if work is not None:
                work.wait()
            if step + 1 < size - 1:
                comm.isend(flat[a:b], right, step0 + step + 1, "all-gather", c)
    comm.wait_all()


def _ring_all_reduce(comm: _Comm, flat: torch.Tensor, op, wire=None) -> None:
    chunks = balanced_blocks(flat.numel(), comm.size)
    _ring_reduce_scatter(comm, flat, op, chunks, wire)
    if wire is None or wire == flat.dtype:
        _ring_all_gather(comm, flat, chunks, step0=comm.size - 1)
        return
    # The reduced chunks go round as they travel: rounded to the wire dtype, the owner's own
    # chunk included, so that every rank ends with the same bits.
    low = flat.to(wire)
    _ring_all_gather(comm, low, chunks, step0=comm.size - 1)
    flat.copy_(low)


def _recursive_doubling_all_reduce(comm: _Comm, flat: torch.Tensor, op) -> None:
    """Pairwise exchange of the whole tensor with the rank 2^k away, for k = 0, 1, ...

    With p not a power of two, the first 2r ranks (r = p minus the largest power of two below it)
    pair up: each even one hands its data to the odd one above it, sits out the exchange rounds,
    and receives the result at the end.
    """
    size, rank = comm.size, comm.rank
    pow2 = 1 << (size.bit_length() - 1)
    extra = size - pow2
    incoming = _scratch(flat.numel(), flat)
    step = 0
    if rank < 2 * extra:
        if rank % 2 == 0:  # hand over, wait for the answer
            comm.isend(flat, rank + 1, step, "fold in")
            comm.wait_all()
            comm.recv(flat, rank + 1, step + 1 + pow2.bit_length() - 1)
            return
        comm.recv(incoming, rank - 1, step)
        _combine(flat, incoming, op)
        virtual = rank // 2
    else:
        virtual = rank - extra
    step = 1

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    mask = 1
    while mask < pow2:
        partner = real(virtual ^ mask)
        work = comm.irecv(incoming, partner, step)
        comm.isend(flat, partner, step, "exchange")
        work.wait()
        comm.wait_all()
        _combine(flat, incoming, op)
        mask <<= 1
        step += 1
    if rank < 2 * extra:  # odd partner of an even rank that sat out
        comm.isend(flat, rank - 1, step, "fold out")
        comm.wait_all()


def _naive_all_reduce(comm: _Comm, flat: torch.Tensor, op) -> None:
    """Everyone sends to rank 0, one after another through its link; it sends the result back."""
    if comm.rank == 0:
        incoming = _scratch(flat.numel(), flat)
        for src in range(1, comm.size):
            comm.recv(incoming, src, 0)
            _combine(flat, incoming, op)
        for dst in range(1, comm.size):
            comm.isend(flat, dst, 1, "send back")
        comm.wait_all()
    else:
        comm.isend(flat, 0, 0, "send in")
        comm.wait_all()
        comm.recv(flat, 0, 1)


_ALL_REDUCE = {
    "ring": _ring_all_reduce,
    "tree": _tree_all_reduce,
    "recursive_doubling": _recursive_doubling_all_reduce,
    "naive": _naive_all_reduce,
}


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

    ``transfer_dtype`` (ring only, a floating tensor): send chunks in that dtype, e.g.
    ``torch.bfloat16``, and add them up in ``tensor``'s own precision.
    """
    _check_tensor(tensor)
    _check_op(op, tensor.dtype)
    if algorithm not in _ALL_REDUCE:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if transfer_dtype is not None:
        _check_transfer_dtype(transfer_dtype, tensor.dtype, op, algorithm)
    comm = _Comm(group, "all_reduce")
    if not comm.member():
        return
    if check:
        _check_same_shape(comm, tensor, "tensor shapes or dtypes")
    if comm.size == 1 or tensor.numel() == 0:
        return
    flat = _flat(tensor)
    if transfer_dtype is None:
        _ALL_REDUCE[algorithm](comm, flat, op)
    else:
        _ring_all_reduce(comm, flat, op, wire=transfer_dtype)
    _finish_avg(flat, op, comm.size)
    _write_back(tensor, flat)


def _check_transfer_dtype(wire: torch.dtype, dtype: torch.dtype, op, algorithm: str) -> None:
    if algorithm != "ring":
        raise ValueError(f"transfer_dtype is a ring option; algorithm={algorithm!r} sends as is")
    if not (wire.is_floating_point and dtype.is_floating_point) or wire not in _DTYPES:
        raise TypeError(f"transfer_dtype={wire} for a {dtype} tensor: both must be floating")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"transfer_dtype rounds partial sums: op must be SUM or AVG, got {op}")


def _tree_setup(name: str, tensor, root_rank: int, root_name: str, group, check: bool):
    """What reduce and broadcast check first. Returns (comm, the root's group rank), or None
    when this rank has nothing to do: outside ``group``, alone in it, or an empty tensor."""
    comm = _Comm(group, name)
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
    _check_tensor(tensor)
    _check_op(op, tensor.dtype)
    if (setup := _tree_setup("reduce", tensor, dst, "dst", group, check)) is None:
        return
    comm, root = setup
    work = tensor.detach().clone().view(-1) if comm.rank != root else _flat(tensor)
    _tree_reduce(comm, work, root, op)
    if comm.rank == root:
        _finish_avg(work, op, comm.size)
        _write_back(tensor, work)


def broadcast(tensor: torch.Tensor, src: int, group=None, check: bool = True) -> None:
    """Copy global rank ``src``'s ``tensor`` into every rank's ``tensor`` (binomial tree)."""
    _check_tensor(tensor)
    if (setup := _tree_setup("broadcast", tensor, src, "src", group, check)) is None:
        return
    comm, root = setup
    flat = _flat(tensor)
    _tree_broadcast(comm, flat, root)
    _write_back(tensor, flat)


def _check_list(tensors, size: int, like: torch.Tensor, name: str) -> None:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != size:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{name} must be a list of {size} tensors (one per rank), got {got}")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{name}[{i}]")
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}; "
                f"expected {tuple(like.shape)} and {like.dtype} like the tensor"
            )


def _rooted(name: str, tensor, tensors, root_rank: int, root_name: str, group, check: bool):
    """Checks shared by gather and scatter: only the root passes a list of one tensor per rank.
    Returns (comm, root's group rank), or (None, None) on a rank outside ``group``."""
    _check_tensor(tensor)
    comm = _Comm(group, name)
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
        flat = _flat(tensor)
        comm.recv(flat, root, 0)
        _write_back(tensor, flat)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, check: bool = True
) -> None:
    """Every rank ends with every rank's ``tensor``: ``tensor_list[i]`` is group rank i's (ring)."""
    _check_tensor(tensor)
    comm = _Comm(group, "all_gather")
    if not comm.member():
        return
    _check_list(tensor_list, comm.size, tensor, "tensor_list")
    if check:
        _check_same_shape(comm, tensor, "tensor shapes or dtypes")
    n = tensor.numel()
    flat = torch.empty(comm.size * n, dtype=tensor.dtype, device=tensor.device)
    flat[comm.rank * n : (comm.rank + 1) * n] = tensor.reshape(-1)
    _ring_all_gather(comm, flat, [(r * n, (r + 1) * n) for r in range(comm.size)])
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
    _check_tensor(output, "output")
    _check_op(op, output.dtype)
    comm = _Comm(group, "reduce_scatter")
    if not comm.member():
        return
    _check_list(input_list, comm.size, output, "input_list")
    if check:
        _check_same_shape(comm, output, "output shapes or dtypes")
    n = output.numel()
    flat = torch.cat([t.reshape(-1) for t in input_list]) if n else output.new_empty(0)
    _ring_reduce_scatter(comm, flat, op, [(r * n, (r + 1) * n) for r in range(comm.size)])
    mine = flat[comm.rank * n : (comm.rank + 1) * n]
    _finish_avg(mine, op, comm.size)
    output.copy_(mine.view(output.shape))
