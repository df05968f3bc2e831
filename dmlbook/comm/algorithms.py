"""The message schedules behind every collective: binomial tree, ring, recursive doubling and
naive (chapter 2; the tree and the reduced-precision ring in chapter 4).

Each function here is one algorithm written as the messages each rank sends and receives through
a :class:`~dmlbook.comm.p2p.Comm`, on a flat tensor changed in place; the checks, the tensor's
shape and ``AVG``'s final division are left to :mod:`dmlbook.comm.collectives`, which calls them.

* ``tree_reduce`` and ``tree_broadcast`` walk a binomial tree: ceil(log2 p) rounds, each
  halving (or doubling) the number of ranks that hold the data. ``reduce`` and ``broadcast``
  are these; the tree all-reduce is one then the other (chapter 4);
* :func:`ring_reduce_scatter_step` is the ring's reduce-scatter as chapter 2 teaches it: one
  step, one chunk each way, on the world group. :func:`ring_reduce_scatter` runs its p-1 steps.
  They are the reference that the optimised ring below is tested equal to;
* ``sliced_ring_reduce_scatter`` and ``sliced_ring_all_gather`` go round a ring, one chunk per
  step. Each chunk is cut into slices that flow through the ring back to back, so that reducing
  one slice overlaps receiving the next; given a shape check, the first slice travels behind
  its header. The ring all-reduce is one then the other: every rank sends 2(p-1)/p of the
  tensor, the least any algorithm can. With a ``wire`` dtype (chapter 4, beside gradient
  compression) chunks travel in bf16 or fp16, half the bytes of fp32, while every
  addition happens in the tensor's own precision. Each partial sum is rounded once per hop and
  the result once more before it goes round, so the error grows with the ring's length and not
  with the precision of the sums; every rank still ends with the same bits.
  :func:`chunk_holdings` replays a ring all-reduce's recorded sends to show which chunk sits
  where after each step;
* ``recursive_doubling_all_reduce``: log2 p rounds of pairwise exchange of the whole tensor; the
  ranks beyond the largest power of two first hand their data to a partner and get the result
  back;
* the naive all-reduce: everyone sends to rank 0, which reduces and sends the result back, as a
  parameter server does.

:data:`ALGORITHMS` names the four all-reduces, whose costs :mod:`dmlbook.comm.costmodel` models,
and :data:`ALL_REDUCE_BY_NAME` maps each name to its function. The functions taking a ``comm``
are public for :mod:`dmlbook.comm.collectives`, which calls them (and chapter 2's exercises,
which switch them off): a learner calls the collectives.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dmlbook.comm.groups import RING_SLICE_BYTES, ring_schedule, ring_slices
from dmlbook.comm.p2p import Comm, combine, scratch_buffer
from dmlbook.comm.shapecheck import ShapeCheck
from dmlbook.comm.trace import Send

__all__ = [
    "ALGORITHMS",
    "ALL_REDUCE_BY_NAME",
    "recursive_doubling_all_reduce",
    "sliced_ring_all_gather",
    "sliced_ring_all_reduce",
    "sliced_ring_reduce_scatter",
    "tree_broadcast",
    "tree_reduce",
    "ring_reduce_scatter",
    "ring_reduce_scatter_step",
    "AUTO_RING_FROM_BYTES",
    "RING_SLICE_BYTES",
    "choose_all_reduce",
    "chunk_holdings",
]

ALGORITHMS = ("ring", "tree", "recursive_doubling", "naive")
# The ring cuts each chunk into slices of about this size, so that reducing one slice overlaps
# receiving the next. Smaller slices overlap more but pay more per-message latency.


# --------------------------------------------------------------------------- trees


def tree_reduce(comm: Comm, buf: torch.Tensor, root: int, op, step0: int = 0) -> None:
    """Binomial-tree reduce of ``buf`` (changed in place) to group rank ``root``.

    In round k, every rank whose relative rank has bit k set sends what it holds to the rank 2^k
    below it and drops out; so ceil(log2 p) rounds, and the root ends with everything.
    """
    size, me = comm.size, (comm.rank - root) % comm.size
    incoming = scratch_buffer(buf.numel(), buf)
    mask, step = 1, step0
    while mask < size:
        if me & mask:
            comm.isend(buf, (me - mask + root) % size, step, "reduce")
            comm.wait_all()
            return
        if me + mask < size:
            comm.recv(incoming, (me + mask + root) % size, step)
            combine(buf, incoming, op)
        mask <<= 1
        step += 1


def tree_broadcast(comm: Comm, buf: torch.Tensor, root: int, step0: int = 0) -> None:
    """Binomial-tree broadcast from group rank ``root``: the holders double every round."""
    size, me = comm.size, (comm.rank - root) % comm.size
    rounds = (size - 1).bit_length()  # the largest mask goes first: its round is step0

    def round_of(mask: int) -> int:
        return step0 + rounds - mask.bit_length()

    mask = 1
    while mask < size:  # receive once, from the rank that got the data one round earlier
        if me & mask:
            comm.recv(buf, (me - mask + root) % size, round_of(mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # then pass it on to the ranks below in the tree
        if me + mask < size:
            comm.isend(buf, (me + mask + root) % size, round_of(mask), "broadcast")
        mask >>= 1
    comm.wait_all()


def _tree_all_reduce(comm: Comm, flat: torch.Tensor, op, step0: int = 0) -> None:
    rounds = math.ceil(math.log2(comm.size))
    tree_reduce(comm, flat, 0, op, step0)
    tree_broadcast(comm, flat, 0, step0 + rounds)


# --------------------------------------------------------------------------- the ring


def ring_reduce_scatter_step(chunks: list[torch.Tensor], step: int) -> None:
    """Step ``step`` of a ring reduce-scatter on the world group (chapter 2's teaching version).

    ``chunks`` holds this rank's p chunks, changed in place. Rank r sends chunk (r-step-1) mod p
    to its right neighbour and adds the chunk arriving from its left one into its own copy;
    after steps 0 .. p-2, rank r's ``chunks[r]`` is summed over every rank.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    send = (rank - step - 1) % p  # the chunk this rank passes on
    receive = (rank - step - 2) % p  # the chunk its left neighbour passes on
    incoming = torch.empty_like(chunks[receive])
    request = dist.isend(chunks[send], dst=(rank + 1) % p)  # communication: post the send,
    dist.recv(incoming, src=(rank - 1) % p)  # then wait for the left neighbour's chunk
    request.wait()
    chunks[receive] += incoming  # computation: add it in


def ring_reduce_scatter(chunks: list[torch.Tensor]) -> None:
    """The ring reduce-scatter (SUM): p-1 steps of :func:`ring_reduce_scatter_step`."""
    for step in range(dist.get_world_size() - 1):
        ring_reduce_scatter_step(chunks, step)


def sliced_ring_reduce_scatter(
    comm: Comm,
    flat: torch.Tensor,
    op,
    chunks,
    wire=None,
    check: ShapeCheck | None = None,
    slices=None,
) -> None:
    """p-1 steps: at step s rank r sends chunk (r-s-1) mod p to r+1 and adds the chunk arriving
    from r-1 into its own copy; afterwards rank r holds chunk r summed over every rank.

    Each chunk travels as slices (``slices[c]``, by default :func:`ring_slices` of each chunk):
    a slice is forwarded as soon as it has been reduced, so receiving the next slice overlaps
    the addition. With ``wire`` (a dtype), slices are sent rounded to it and added, on arrival,
    into ``flat``'s own precision. With ``check``, the first slice travels behind the shape
    check's header (:mod:`dmlbook.comm.shapecheck`). The last sends may still be on their way
    when it returns: the caller's ``comm.wait_all()`` finishes them (an all-reduce's all-gather
    starts meanwhile).
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    wire = wire or flat.dtype
    if slices is None:
        slices = [ring_slices(a, b, flat.element_size()) for a, b in chunks]
    longest = max(b - a for a, b in chunks)
    scratch = scratch_buffer(2 * longest, flat, wire)  # two steps' chunks: this one's and the next

    def on_wire(a: int, b: int) -> torch.Tensor:
        return flat[a:b] if wire == flat.dtype else flat[a:b].to(wire)

    def post_recvs(step: int, arrived: torch.Tensor | None = None):
        """(start, stop, receive, where it lands) for each slice of this step's chunk; a slice
        that ``arrived`` already (behind the header) needs no receive."""
        c = (rank - step - 2) % size
        offset = (step % 2) * longest - chunks[c][0]  # flat index -> scratch index
        recvs = []
        for a, b in slices[c]:
            if arrived is not None:
                got, arrived = arrived[: (b - a) * scratch.element_size()].view(wire), None
                recvs.append((a, b, None, got))
            else:
                into = scratch[offset + a : offset + b]
                recvs.append((a, b, comm.irecv(into, left, step), into))
        return recvs

    first = (rank - 1) % size
    if check is None:
        recvs = post_recvs(0)  # receives are posted before the step's sends go out
        for a, b in slices[first]:
            comm.isend(on_wire(a, b), right, 0, "reduce-scatter", first)
    else:
        check.post_receives()
        head = slices[first][:1]
        inline = bool(head) and check.carries((head[0][1] - head[0][0]) * wire.itemsize)
        check.ring_start(right, on_wire(*head[0]) if inline else None, first)
        for a, b in slices[first][1 if inline else 0 :]:
            comm.isend(on_wire(a, b), right, 0, "reduce-scatter", first)
        recvs = post_recvs(0, check.verify())  # a mismatch raises here, on every rank
    for step in range(size - 1):
        c = (rank - step - 2) % size
        last = step == size - 2
        nxt = [] if last else post_recvs(step + 1)
        for a, b, work, got in recvs:
            if work is not None:
                work.wait()
            combine(flat[a:b], got, op)
            if not last:  # forward the freshly reduced slice straight away
                comm.isend(on_wire(a, b), right, step + 1, "reduce-scatter", c)
        recvs = nxt


def _all_gather_receives(
    comm: Comm, flat: torch.Tensor, slices, step0: int, step: int, arrived=None
):
    """Post the receives of all-gather step ``step``: chunk (r-step-1) mod p, slice by slice
    (``slices[c]``), from the left neighbour, straight into ``flat``; a first slice that
    ``arrived`` already (behind the shape check's header) is copied in and needs no receive.
    Returns (start, stop, receive) per slice."""
    c, left = (comm.rank - step - 1) % comm.size, (comm.rank - 1) % comm.size
    recvs = []
    for a, b in slices[c]:
        if arrived is not None:
            flat[a:b] = arrived[: (b - a) * flat.element_size()].view(flat.dtype)
            recvs.append((a, b, None))
            arrived = None
        else:
            recvs.append((a, b, comm.irecv(flat[a:b], left, step0 + step)))
    return recvs


def sliced_ring_all_gather(
    comm: Comm,
    flat: torch.Tensor,
    chunks,
    step0: int = 0,
    slices=None,
    check: ShapeCheck | None = None,
) -> None:
    """p-1 steps: rank r starts by sending its chunk r to r+1; each step forwards what arrived.

    With ``check`` (``step0`` 0, a ring of its own rather than an all-reduce's second half),
    the first slice travels behind the shape check's header (:mod:`dmlbook.comm.shapecheck`),
    as in :func:`sliced_ring_reduce_scatter`."""
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    right = (rank + 1) % size
    if slices is None:
        slices = [ring_slices(a, b, flat.element_size()) for a, b in chunks]
    if check is None:
        # receives are posted a step ahead, before the step's sends go out
        recvs = _all_gather_receives(comm, flat, slices, step0, 0)
        for a, b in slices[rank]:
            comm.isend(flat[a:b], right, step0, "all-gather", rank)
    else:
        check.post_receives()
        head = slices[rank][:1]
        inline = bool(head) and check.carries((head[0][1] - head[0][0]) * flat.element_size())
        check.ring_start(right, flat[slice(*head[0])] if inline else None, rank, "all-gather")
        for a, b in slices[rank][1 if inline else 0 :]:
            comm.isend(flat[a:b], right, step0, "all-gather", rank)
        # a mismatch raises in verify, on every rank
        recvs = _all_gather_receives(comm, flat, slices, step0, 0, check.verify())
    for step in range(size - 1):
        c = (rank - step - 1) % size
        last = step == size - 2
        nxt = [] if last else _all_gather_receives(comm, flat, slices, step0, step + 1)
        for a, b, work in recvs:
            if work is not None:
                work.wait()
            if not last:  # forward the slice as it arrived
                comm.isend(flat[a:b], right, step0 + step + 1, "all-gather", c)
        recvs = nxt
    comm.wait_all()


def sliced_ring_all_reduce(comm: Comm, flat: torch.Tensor, op, wire=None, check=None) -> None:
    """Reduce-scatter, then all-gather: 2(p-1) steps of one chunk each way.

    The schedule (chunks and slices) is worked out once per shape (:func:`ring_schedule`).
    Posting the all-gather's first receives before the reduce-scatter's sends, so that gloo
    (which sends a message's bytes only once the receiver has announced a receive) finds them
    announced, did not pay on balance: at world size 2, posted early against posted when the
    all-gather starts, 64 KiB took 424 and 395 us against 513 and 328; 1 MiB 788 and 907 us
    against 702 and 828 (medians of 41, two launches, on the busy machine).
    """
    chunks, slices = ring_schedule(flat.numel(), comm.size, flat.element_size())
    sliced_ring_reduce_scatter(comm, flat, op, chunks, wire, check, slices)
    # (the all-gather's comm.wait_all() finishes the reduce-scatter's last sends too)
    if wire is None or wire == flat.dtype:
        sliced_ring_all_gather(comm, flat, chunks, comm.size - 1, slices)
        return
    # The reduced chunks go round as they travel: rounded to the wire dtype, the owner's own
    # chunk included, so that every rank ends with the same bits.
    low = flat.to(wire)
    sliced_ring_all_gather(comm, low, chunks, comm.size - 1, slices)
    flat.copy_(low)


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


# ---------------------------------------------------------------- recursive doubling and naive


def recursive_doubling_all_reduce(
    comm: Comm, flat: torch.Tensor, op, check: ShapeCheck | None = None
) -> None:
    """Pairwise exchange of the whole tensor with the rank 2^k away, for k = 0, 1, ...

    With p not a power of two, the first 2r ranks (r = p minus the largest power of two below it)
    pair up: each even one hands its data to the odd one above it, sits out the exchange rounds,
    and receives the result at the end. With ``check`` and p a power of two, the first exchange
    carries the shape check's header (:mod:`dmlbook.comm.shapecheck`); otherwise the header goes
    alone first.
    """
    size, rank = comm.size, comm.rank
    pow2 = 1 << (size.bit_length() - 1)
    extra = size - pow2
    incoming = scratch_buffer(flat.numel(), flat)
    step, mask = 0, 1
    if check is not None and extra == 0:  # round one: header + tensor, one message each way
        partner = rank ^ 1
        check.post_receives()
        inline = check.carries(flat.numel() * flat.element_size())
        check.pair_start(partner, flat if inline else None)
        if not inline:
            comm.isend(flat, partner, 1, "exchange")
        got = check.verify()  # a mismatch raises here, on every rank
        if got is None:
            comm.recv(incoming, partner, 1)
            got = incoming
        else:
            got = got[: flat.numel() * flat.element_size()].view(flat.dtype)
        comm.wait_all()
        combine(flat, got, op)
        mask = 2
    elif check is not None:
        check.exchange()
    if rank < 2 * extra:
        if rank % 2 == 0:  # hand over, wait for the answer
            comm.isend(flat, rank + 1, step, "fold in")
            comm.wait_all()
            comm.recv(flat, rank + 1, step + 1 + pow2.bit_length() - 1)
            return
        comm.recv(incoming, rank - 1, step)
        combine(flat, incoming, op)
        virtual = rank // 2
    else:
        virtual = rank - extra
    step = mask.bit_length()  # 1 for the first exchange round, 2 once round one is done

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    while mask < pow2:
        partner = real(virtual ^ mask)
        work = comm.irecv(incoming, partner, step)
        comm.isend(flat, partner, step, "exchange")
        work.wait()
        comm.wait_all()
        combine(flat, incoming, op)
        mask <<= 1
        step += 1
    if rank < 2 * extra:  # odd partner of an even rank that sat out
        comm.isend(flat, rank - 1, step, "fold out")
        comm.wait_all()


def _naive_all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    """Everyone sends to rank 0, one after another through its link; it sends the result back."""
    if comm.rank == 0:
        incoming = scratch_buffer(flat.numel(), flat)
        for src in range(1, comm.size):
            comm.recv(incoming, src, 0)
            combine(flat, incoming, op)
        for dst in range(1, comm.size):
            comm.isend(flat, dst, 1, "send back")
        comm.wait_all()
    else:
        comm.isend(flat, 0, 0, "send in")
        comm.wait_all()
        comm.recv(flat, 0, 1)


# --------------------------------------------------------------------------- choosing by size


# algorithm="auto" does what NCCL and gloo do: a latency-bound algorithm for small messages, the
# ring (the fewest bytes per rank) for large ones. Measured here with interleaved runs (world
# sizes 2-4, 16 KiB-64 MiB, gloo over loopback on a busy 2-core machine): at 3 and 4 ranks
# recursive doubling beat the ring up to 1 MiB (world 4, 256 KiB: 0.65x gloo's time against
# 1.55x) and lost from 2 MiB on (world 4, 2 MiB: 0.97x against 0.71x; 16 MiB: 1.43x against
# 1.16x), where its log2(p) whole-tensor exchanges send more bytes than the ring's 2(p-1)/p. At
# 2 ranks both send the same bytes, and recursive doubling takes one step instead of two, but each
# rank adds the whole tensor where the ring's adds half of it (and overlaps that with its
# receives). With gloo's threads at nice 19 (runtime/gloo_thread.py) and the ring holding its
# receives to the end (p2p.Comm), two `bench allreduce` runs (medians, ms) put them level at
# 2 MiB (ring 1.52-1.93, recursive doubling 1.58-1.72), and the ring ahead from 4 MiB (2.09-2.51
# against 2.93-3.25; 8 MiB 5.2-6.4 against 6.7; 32 MiB 19.0-19.2 against 20.3-20.9), as in three
# runs at 64 MiB (1.04-1.09x gloo against 1.23-1.26x); below, recursive doubling stays ahead (64
# KiB: 0.71-0.76x gloo against 1.19-1.25x). So the crossing holds for 2 ranks too.
AUTO_RING_FROM_BYTES = 2 << 20


def choose_all_reduce(nbytes: int, world_size: int) -> str:
    """What ``algorithm="auto"`` runs for ``nbytes`` over ``world_size`` ranks (chapter 4).

    Every rank must choose alike, so the choice depends only on what the ranks agree on (the
    tensor's size, checked, and the group's size). On this machine the crossing measured the
    same for 2, 3 and 4 ranks, so only the size decides; NCCL's tuning weighs both."""
    if nbytes < AUTO_RING_FROM_BYTES:
        return "recursive_doubling"
    return "ring"


# Each of ALGORITHMS' all-reduces, by name: what collectives.all_reduce(algorithm=...) runs.
ALL_REDUCE_BY_NAME = {
    "ring": sliced_ring_all_reduce,
    "tree": _tree_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "naive": _naive_all_reduce,
}
