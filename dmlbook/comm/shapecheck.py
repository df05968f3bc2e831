"""Did every rank pass the same tensor? Checked inside the first message, at no extra latency
(chapter 2's collectives; chapter 4 measures what a message costs).

Point-to-point code given mismatched tensors waits for messages that never come, or gloo aborts
the process on a message longer than the buffer posted for it. So every collective of
:mod:`dmlbook.comm.collectives` first learns what every other rank passed: a *header* of a few
integers (dims, dtype, wire dtype, numel, shape). A mismatch becomes the same ValueError on every
rank, naming the ranks that disagree.

Where the header travels matters more than its size. On loopback here one more message costs
about as much as a 32 KiB one (0.1-0.2 ms on a busy 2-core machine, mostly the two processes
waking up), so a separate round of header messages cost recursive doubling 1.8x its time at
64 KiB. The ring collectives (all-reduce, all-gather, reduce-scatter) and recursive doubling
therefore send the header *inside their first message*: the ring's first slice (or recursive
doubling's whole tensor, at a power-of-two world size) travels behind the header in one buffer,
and the other ranks get the header alone, in parallel. Every receiver posts a buffer big enough
for any first message (the header plus ``INLINE_BYTES``): gloo accepts a message shorter than
the buffer, and aborts the process on a longer one. Only after the headers agree does a rank
post the receives sized from its own tensor. When they disagree, each rank first receives
("drains") what any peer had already sent it, sized from that peer's header (which also says
how the peer started), so nothing is left on the wire, then raises.

The other collectives (broadcast, reduce, gather, scatter; the tree and naive all-reduces, and
recursive doubling at a world size that is not a power of two) send the header alone first
(:meth:`ShapeCheck.exchange`): one message to every peer at once, one message's latency.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from dmlbook.comm.groups import balanced_blocks, ring_slices
from dmlbook.comm.p2p import DTYPES, Comm

__all__ = ["INLINE_BYTES", "ShapeCheck"]

MAX_DIMS = 8
INLINE_BYTES = 1 << 20  # a ring's first slice up to this size travels behind the header
TAG = 1 << 20  # the first message's tag, clear of the algorithms' step numbers
# dims, dtype, wire dtype, numel, how the ring started (below), then the shape
_WORDS = 5 + MAX_DIMS
# How a rank started, so that a peer can drain what it sent: nothing yet (the header alone), a
# ring's first slice to its right neighbour, or recursive doubling's whole tensor to its partner
# (rank ^ 1), each behind the header (INLINE) or in messages of its own (APART). An all-reduce's
# ring (RING) sends first one of the p chunks it cuts the header's tensor into; an all-gather's
# or a reduce-scatter's (SHARD) sends a chunk of the header's tensor's size (the all-gather's
# own tensor, the reduce-scatter's block of the output's shape).
NONE, RING_INLINE, RING_APART, PAIR_INLINE, PAIR_APART, SHARD_INLINE, SHARD_APART = range(7)
_INLINE = (RING_INLINE, PAIR_INLINE, SHARD_INLINE)
_FORMAT = f"={_WORDS}q"  # the header's words, as native 8-byte integers
HEADER_BYTES = struct.calcsize(_FORMAT)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


class ShapeCheck:
    """Every rank's header, exchanged in the first message of one collective call.

    Headers are lists of Python integers, packed into the message and unpacked from it with
    :mod:`struct`: a torch or numpy operation on a tiny array costs a microsecond or more, and
    this sits on the path of every small collective.
    """

    def __init__(
        self, comm: Comm, tensor: torch.Tensor, what: str, wire=None, shard: bool = False
    ) -> None:
        """``shard``: ``tensor`` is one ring chunk itself (an all-gather's input, a
        reduce-scatter's output), not the tensor an all-reduce's ring cuts into p chunks."""
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"{comm.collective} supports tensors of up to {MAX_DIMS} dimensions")
        self.comm, self.what, self.device, self.shard = comm, what, tensor.device, shard
        wire = wire or tensor.dtype
        # row r: rank r's header (peers' rows are filled in by verify)
        self.rows = [[0] * _WORDS for _ in range(comm.size)]
        self.rows[comm.rank] = list(_header(tuple(tensor.shape), tensor.dtype, wire))
        self.inbox: list[tuple[int, torch.Tensor, object]] = []
        # Only gloo takes a message shorter than the buffer posted for it (NCCL needs equal
        # sizes): on other devices the header always travels alone, in a buffer of its size.
        self.can_inline = tensor.device.type == "cpu"
        # This plumbing speaks to the process group itself, in group ranks: ``dist.isend``'s
        # argument checks cost as much as a small message's copy, on every call.
        self.pg = comm.pg

    # ------------------------------------------------------------------ sending and receiving

    def post_receives(self) -> None:
        """Receive every peer's first message, in a buffer that fits data behind the header
        (whichever way the peer started: on a mismatch, ranks may have started differently)."""
        comm = self.comm
        for peer in range(comm.size):
            if peer != comm.rank:
                extra = INLINE_BYTES if self.can_inline else 0
                buf = _buffer(("in", peer), HEADER_BYTES + extra, self.device)
                self.inbox.append((peer, buf, self.pg.recv([buf], peer, TAG)))

    def send(
        self, peer: int, data: torch.Tensor | None = None, chunk=None, step=0, phase=""
    ) -> None:
        """This rank's header to ``peer``, with ``data`` (a ring's first slice) behind it."""
        header = self.rows[self.comm.rank]
        if data is None:
            message = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            struct.pack_into(_FORMAT, message.numpy(), 0, *header)
            message = message.to(self.device)
        else:  # one buffer on the host: [header | slice]
            raw = data.reshape(-1).view(torch.uint8)
            message = _buffer(("out", peer), HEADER_BYTES + raw.numel(), "cpu")
            struct.pack_into(_FORMAT, message.numpy(), 0, *header)
            message[HEADER_BYTES:].copy_(raw)
            self.comm.record(data, peer, step, phase, chunk)
        self.comm.pending.append(self.pg.send([message], peer, TAG))
        self.comm.in_flight.append(message)

    def ring_start(
        self, right: int, first: torch.Tensor | None, chunk: int, phase: str = "reduce-scatter"
    ) -> None:
        """A ring's first message (step 0): the header with ``first`` (its first slice, already
        in the wire dtype) behind it to ``right``, or alone when ``first`` is None; the header
        alone to every other peer."""
        if self.shard:
            self._start(SHARD_INLINE, SHARD_APART, right, first, chunk, 0, phase)
        else:
            self._start(RING_INLINE, RING_APART, right, first, chunk, 0, phase)

    def pair_start(self, partner: int, data: torch.Tensor | None) -> None:
        """Recursive doubling's first message: the header with the whole tensor behind it to
        ``partner`` (or alone when ``data`` is None); the header alone to the others."""
        self._start(PAIR_INLINE, PAIR_APART, partner, data, None, 1, "exchange")

    def carries(self, nbytes: int) -> bool:
        """Whether a first message of ``nbytes`` travels behind the header: it fits, and the
        device takes a message shorter than its buffer (gloo's CPU tensors). The one place the
        callers and :meth:`ring_start`/:meth:`pair_start` decide it, so that a slice not carried
        is sent on its own."""
        return self.can_inline and fits_inline(nbytes)

    def _start(self, inline, apart, target, data, chunk, step, phase) -> None:
        if data is not None and not self.carries(data.numel() * data.element_size()):
            raise ValueError("a first message too large or on a device that cannot carry it")
        self.rows[self.comm.rank][4] = apart if data is None else inline
        for peer in range(self.comm.size):
            if peer != self.comm.rank:
                self.send(peer, data if peer == target else None, chunk, step, phase)

    def exchange(self) -> None:
        """The header alone, to and from every peer at once; then :meth:`verify`."""
        self.post_receives()
        for peer in range(self.comm.size):
            if peer != self.comm.rank:
                self.send(peer)
        self.verify()

    def verify(self) -> torch.Tensor | None:
        """Wait for every header; raise on a mismatch. Returns the bytes a peer sent this rank
        behind its header (a ring's first slice, a partner's tensor), or None."""
        comm = self.comm
        inline = None
        for peer, buf, work in self.inbox:
            work.wait()
            header = buf[:HEADER_BYTES].cpu().numpy()  # .cpu(): the header is read on the host
            self.rows[peer] = list(struct.unpack(_FORMAT, header))
            if self._target(peer) == comm.rank and self.rows[peer][4] in _INLINE:
                inline = buf[HEADER_BYTES:]
        # dims, dtype, wire, numel and shape agree (word 4 says only how a rank started)
        first = self.rows[0]
        same = all(row[:4] == first[:4] and row[5:] == first[5:] for row in self.rows)
        if not same:
            for peer in range(comm.size):
                if peer != comm.rank and self._target(peer) == comm.rank:
                    self._drain(peer)
            comm.wait_all()  # our own messages have been drained by the peers they went to
            raise ValueError(f"{comm.collective}: ranks passed different {self.what} ({self})")
        return inline

    def _target(self, peer: int) -> int | None:
        """The rank ``peer`` sent data to before the check (None: nobody)."""
        start = self.rows[peer][4]
        if start in (RING_INLINE, RING_APART, SHARD_INLINE, SHARD_APART):
            return (peer + 1) % self.comm.size
        if start in (PAIR_INLINE, PAIR_APART):
            return peer ^ 1
        return None

    def __str__(self) -> str:
        def one(r: int) -> str:
            dims, dtype, wire = self.rows[r][:3]
            shape = tuple(self.rows[r][5 : 5 + dims])
            extra = f" (wire {DTYPES[wire]})" if wire != dtype else ""
            return f"rank {self.comm.global_rank(r)}: {shape} {DTYPES[dtype]}{extra}"

        return ", ".join(one(r) for r in range(self.comm.size))

    # ------------------------------------------------------------------ a mismatch

    def _drain(self, peer: int) -> None:
        """Receive what ``peer`` sent this rank before it knew of the mismatch, sized from its
        header: the rest of a ring's first chunk (the rule :func:`ring_first_slices` applies on
        the sender; for an all-gather or a reduce-scatter, the chunk is the header's tensor),
        or a partner's whole tensor."""
        dims, dtype, wire, numel, start = self.rows[peer][:5]
        itemsize = DTYPES[dtype].itemsize
        if start == PAIR_APART:
            self.comm.recv(torch.empty(numel, dtype=DTYPES[wire], device=self.device), peer, 1)
        elif start in (RING_INLINE, RING_APART, SHARD_INLINE, SHARD_APART):
            if start in (SHARD_INLINE, SHARD_APART):
                sizes = ring_slices(0, numel, itemsize)
            else:
                sizes = ring_first_slices(numel, self.comm.size, peer, itemsize)
            for a, b in sizes[1 if start in _INLINE else 0 :]:  # the inline one has come
                junk = torch.empty(b - a, dtype=DTYPES[wire], device=self.device)
                self.comm.recv(junk, peer, 0)


@functools.lru_cache(maxsize=256)
def _header(shape: tuple[int, ...], dtype: torch.dtype, wire: torch.dtype) -> tuple[int, ...]:
    """A rank's header for a tensor of ``shape`` and ``dtype`` sent as ``wire`` (word 4, how the
    rank started, is NONE here), padded to the fixed length of every header."""
    words = (len(shape), _CODE[dtype], _CODE[wire], math.prod(shape), NONE, *shape)
    return words + (0,) * (_WORDS - len(words))


def ring_first_slices(numel: int, size: int, rank: int, element_size: int):
    """The slices (start, stop) of the chunk ``rank`` sends first in a ring reduce-scatter."""
    a, b = balanced_blocks(numel, size)[(rank - 1) % size]
    return ring_slices(a, b, element_size)  # the ring's own rule, not a copy of it


def fits_inline(nbytes: int) -> bool:
    return 0 < nbytes <= INLINE_BYTES


_BUFFERS: dict[tuple, torch.Tensor] = {}


def _buffer(key: tuple, nbytes: int, device) -> torch.Tensor:
    """A message buffer per (direction, peer), kept from call to call (a fresh one costs page
    faults, and a torch allocation is slow beside a 64 KiB message)."""
    key = (*key, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = _BUFFERS[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]
