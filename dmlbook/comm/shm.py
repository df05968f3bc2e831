"""Collectives through shared memory, for ranks on one host (chapter 4: leveraging host resources).

Chapter 2's collectives are schedules of messages, and over gloo every message crosses the
loopback TCP stack: about 1-2 GB/s here, while one core copies memory at about 20 GB/s. Ranks on
one machine can skip the network altogether and meet in memory, which is what NCCL's
shared-memory transport and DeepSpeed's CPU all-reduce do. This module is that transport, small
enough to read:

* **One buffer per group.** Group rank 0 makes an anonymous memory file (``memfd_create``) with a
  header, then ``CELLS`` *cells* and a *slot* per rank; the others open it through
  ``/proc/<pid>/fd/<fd>`` and map it. It has no name on the machine, so no other run can meet
  it, and the kernel frees it when the last rank that mapped it exits, however it exits: nothing
  is ever left behind.
* **The ranks' own synchronisation: counters that only grow.** Each rank owns one cache line of
  the header and is its only writer. To say "I have done k things" it writes k there; to wait,
  it reads every rank's line until all have reached the value it needs. A barrier is one such
  counter. No message, no TCP. This relies on x86-64's memory order: a core's stores are seen
  by the others in the order it made them, and its loads are not moved after its later stores,
  so a counter is seen only after the data written before it, and a rank that has announced
  "done reading" has really finished reading.
* **Waiting without stealing the core.** A rank spins for a few microseconds (a peer that keeps
  pace arrives by then), then sleeps in the kernel on the late rank's counter (a *futex*, the
  call under every Linux mutex) until that rank publishes, which wakes it at once, as a socket
  wakes a rank blocked on gloo. On a busy machine a spinning rank would hold the core its peer
  needs.
* **All-reduce = reduce-scatter + all-gather, streamed a block at a time.** The tensor is cut
  into one chunk per rank (chunk r is rank r's to reduce, as in chapter 2's ring), and each
  chunk into blocks. Block k of every chunk travels through one cell, in three stages, each
  announced by a counter of its own:

  1. *copy in*: rank r copies block k of every other chunk into its cell (``copied``);
  2. *reduce*: once every rank has copied block k, rank r combines block k of its own chunk
     from every rank's cell with its own, into its cell and its tensor (``reduced``);
  3. *copy out*: once every rank has reduced block k, rank r copies block k of every other
     chunk from its owner's cell (``done``).

  A rank runs the stages as a pipeline (chapter 6's idea): in one step it copies in block
  k + 2, reduces block k + 1 and copies out block k, so that ranks running side by side find
  what they need already published, and can find a block still in the cache the cores share.
  Block k uses cell k % CELLS, once every rank is done with block k - CELLS. Each rank still
  reads and writes every byte of its tensor about 4.5 times at world size 2 (a copy: 2 times);
  when the ranks run side by side, that, not the waiting, is where the time goes.
* **One barrier per call**, at the start. Each rank publishes its tensor's size and dtype there,
  and every rank compares them, so a mismatch is the same ValueError on every rank, before any
  rank has touched a cell; and no rank starts a call before every rank has finished the last.
  A rank that never arrives (it died, or never called) becomes a TimeoutError naming it after
  ``timeout`` seconds, never a hang.

All-gather and reduce-scatter are simpler: each rank copies its data into its slot, barrier, each
rank reads what it needs from every slot, in pieces of a slot's size; two sets of slots, used in
turn, spare a barrier at the end of each piece. The functions follow ``torch.distributed``'s
signatures.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dmlbook.comm.groups import balanced_blocks
from dmlbook.comm.p2p import DTYPES, check_op, check_tensor, combine, finish_avg, flat_view

__all__ = ["CELLS", "SharedMemoryGroup", "shm_all_gather", "shm_all_reduce", "shm_reduce_scatter"]

CELL_BYTES = 1 << 20  # one cell: block k of every chunk (512 KiB of each at 2 ranks)
CELLS = 4  # cells per rank, used in turn (at least 3: a pipeline of three stages)
# Few, small cells, so that the blocks in flight (2 ranks x 4 x 1 MiB) stay in the cache the cores
# share: at 16 MiB, world size 2, on the reference machine (32 MiB of L3), 3.3-3.5 ms a call,
# where 8 cells of 2 MiB took 4.2-7.5 ms, their 32 MiB of cells pushing each other out.
SPIN_S, NAP_S = 5e-6, 0.01  # a late peer: spin this long, then sleep, rechecking this often
SLOT_BYTES = 8 << 20  # all_gather/reduce_scatter: each rank's slot; larger tensors go in pieces
_HEADER_WORDS = 8  # int64 words per rank: 64 bytes, one cache line, so ranks never share one
# The words of a rank's line. Words 1-2 or 3-4 (by the call's parity) hold what the call passed,
# its numel and dtype: two places, because a rank that has raised on a mismatch may publish its
# next call's while a slower rank still reads this one's.
_BARRIER, _COPIED, _REDUCED, _DONE = 0, 5, 6, 7
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


@dataclass
class SharedMemoryGroup:
    """A group's shared buffer: ``header[r]`` is rank r's line, ``cells[r]`` its ring of cells
    (all_reduce) and ``slots[s, r]`` its slot in set s (all_gather, reduce_scatter)."""

    rank: int
    size: int
    header: torch.Tensor  # (size, _HEADER_WORDS) int64, in shared memory
    cells: torch.Tensor  # (size, CELLS, cell_bytes) uint8, in shared memory
    slots: torch.Tensor  # (2, size, slot_bytes) uint8, in shared memory
    timeout: float
    calls: int = 0  # collectives this rank has started
    count: int = 0  # barriers this rank has passed
    blocks: int = 0  # all_reduce blocks this rank has taken through its cells
    rounds: int = 0  # all_gather/reduce_scatter pieces this rank has started
    lines: np.ndarray = field(init=False, repr=False)  # the header, as numpy: cheaper to poll
    views: dict = field(default_factory=dict, repr=False)  # dtype -> the cells' views (_cells)

    def __post_init__(self) -> None:
        self.lines = self.header.numpy()  # the same memory

    @classmethod
    def create(
        cls,
        group=None,
        cell_bytes: int = CELL_BYTES,
        slot_bytes: int = SLOT_BYTES,
        timeout: float = 60.0,
    ):
        """Collective over ``group``: rank 0 makes the buffer, every rank maps it."""
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise NotImplementedError(
                "the shared-memory transport relies on x86-64's memory order; use gloo here"
            )
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if cell_bytes < 8 * size or cell_bytes % 8 or slot_bytes < 8 * size or slot_bytes % 8:
            raise ValueError(
                f"cell_bytes and slot_bytes must be multiples of 8, at least 8 x {size} ranks"
            )
        header_bytes = size * _HEADER_WORDS * 8
        cell_total = size * CELLS * cell_bytes
        total = header_bytes + cell_total + 2 * size * slot_bytes
        if rank == 0:
            fd = os.memfd_create("dmlbook-shm", os.MFD_CLOEXEC)  # a label, not a name to share
            os.ftruncate(fd, total)  # pages are made when first touched
            where = _where(fd)
        else:
            where = torch.zeros(6, dtype=torch.int64)
        # The only message, a tensor (nothing to unpickle): where the buffer is, and the boot
        # it is on. broadcast wants the global rank of the group's rank 0.
        dist.broadcast(
            where, src=0 if group is None else dist.get_global_rank(group, 0), group=group
        )
        if rank != 0:
            pid, their_fd = int(where[0]), int(where[1])
            if not torch.equal(where[4:], _boot_id()):
                raise ValueError(
                    "the shared-memory transport needs every rank of the group on one host; "
                    f"rank {rank} is not on group rank 0's (use gloo or NCCL across hosts)"
                )
            fd = os.open(f"/proc/{pid}/fd/{their_fd}", os.O_RDWR | os.O_CLOEXEC)
            if not torch.equal(_where(fd, pid, their_fd), where):  # the very same file
                os.close(fd)
                raise RuntimeError(f"rank {rank} opened another file than group rank 0's buffer")
        memory = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=total, dtype=torch.uint8)
        dist.barrier(group=group)  # every rank has mapped it: the file itself may go
        os.close(fd)  # the mappings keep the memory; the last one gone frees it
        header = memory[:header_bytes].view(torch.int64).view(size, _HEADER_WORDS)
        cells = memory[header_bytes : header_bytes + cell_total].view(size, CELLS, cell_bytes)
        slots = memory[header_bytes + cell_total :].view(2, size, slot_bytes)
        return cls(rank, size, header, cells, slots, timeout)

    # ------------------------------------------------------------------ synchronisation

    def publish(self, word: int, value: int) -> None:
        """Tell every rank: my counter ``word`` has reached ``value`` (after what it counts)."""
        self.lines[self.rank, word] = value
        _futex_wake(self._address(self.rank, word))  # ranks asleep on it, if any, wake up

    def wait(self, word: int, value: int, what: str) -> None:
        """Until every rank's counter ``word`` has reached ``value``; TimeoutError naming the
        late ranks after ``timeout`` seconds."""
        counts = self.lines[:, word]  # a view: each read sees the memory as it is now
        spin_until = time.perf_counter() + SPIN_S
        while min(counts.tolist()) < value:  # ranks that keep pace meet here within SPIN_S
            if time.perf_counter() > spin_until:
                break
        else:
            return
        # A rank is late, likely not even running: sleep in the kernel until its counter
        # changes (a futex), leaving our core to it or to others, and wake as soon as it
        # publishes, as a rank blocked on a socket does. Waking every NAP_S keeps the deadline.
        deadline = time.monotonic() + self.timeout
        while min(seen := counts.tolist()) < value:
            late = seen.index(min(seen))
            _futex_wait(self._address(late, word), seen[late], NAP_S)
            if time.monotonic() > deadline:
                late = [r for r in range(self.size) if counts[r] < value]
                raise TimeoutError(
                    f"shared memory, {what}: ranks {late} did not arrive in "
                    f"{self.timeout:g} s (did they call the same collective?)"
                )

    def _address(self, rank: int, word: int) -> int:
        """Where rank ``rank``'s counter ``word`` is, in this process's memory."""
        return self.header.data_ptr() + (rank * _HEADER_WORDS + word) * 8

    def barrier(self, numel: int = -1, dtype: torch.dtype | None = None) -> None:
        """Wait until every rank has arrived here; optionally publish what this call passed."""
        if dtype is not None:
            at = self._published()
            self.lines[self.rank, at : at + 2] = numel, _DTYPE_CODE[dtype]
        self.count += 1
        self.publish(_BARRIER, self.count)  # written last: seen only after the words above
        self.wait(_BARRIER, self.count, "barrier")

    def check_same(self, what: str) -> None:
        """After a publishing barrier: the same numel and dtype on every rank, or ValueError."""
        at = self._published()
        rows = self.lines[:, at : at + 2].tolist()
        if any(row != rows[0] for row in rows):
            found = ", ".join(
                f"rank {r}: {numel} x {DTYPES[code]}" for r, (numel, code) in enumerate(rows)
            )
            raise ValueError(f"{what} differ across ranks: {found}")

    def _published(self) -> int:
        return 1 + 2 * (self.calls % 2)

    def start(self, numel: int, dtype: torch.dtype, what: str) -> None:
        """Every collective begins here: one barrier, and the same sizes everywhere."""
        self.calls += 1
        self.barrier(numel, dtype)
        self.check_same(f"{what} tensor sizes or dtypes")

    # ------------------------------------------------------------------ all_reduce

    def all_reduce(self, flat: torch.Tensor, op) -> None:
        """``flat`` (1-D, contiguous) reduced in place, a block at a time through the cells."""
        self.start(flat.numel(), flat.dtype, "all_reduce")
        if self.size == 1:
            return
        cells = self._cells(flat.dtype)  # cells[q][i][c]: rank q's cell i, room for chunk c
        block = len(cells[0][0][0])  # elements in a block
        # parts[c][k]: block k of chunk c, a view of flat; chunk r is rank r's to reduce
        parts = [flat[lo:hi].split(block) for lo, hi in balanced_blocks(len(flat), self.size)]
        count = len(parts[0])  # blocks in a chunk (chunk 0 is the longest)
        for step in range(count + 2):  # a pipeline of three stages, one block apart
            if step < count:
                self.copy_in_block(step, parts, cells)
            if 0 <= step - 1 < count:
                self.reduce_block(step - 1, parts, cells, op)
            if 0 <= step - 2 < count:
                self.copy_out_block(step - 2, parts, cells)
        self.blocks += count

    def copy_in_block(self, k: int, parts, cells) -> None:
        """1. Block k of every chunk but mine into my cell."""
        n = self.blocks + k  # blocks are counted across calls: counters only grow
        # Block k goes through cell k % CELLS, last used by block k - CELLS of this call (or by
        # an earlier call, which every rank finished before the call's barrier)
        self.wait(_DONE, n - CELLS + 1, "all_reduce")  # every rank is done with this cell
        cell = cells[self.rank][k % CELLS]
        for c, part in _block(parts, k):
            if c != self.rank:
                _fit(cell[c], part).copy_(part)
        self.publish(_COPIED, n + 1)

    def reduce_block(self, k: int, parts, cells, op) -> None:
        """2. Block k of my chunk, combined over every rank, into my cell and my tensor."""
        n = self.blocks + k
        self.wait(_COPIED, n + 1, "all_reduce")
        for _, mine in _block(parts, k, only=self.rank):
            out = _fit(cells[self.rank][k % CELLS][self.rank], mine)
            peers = [cells[q][k % CELLS][self.rank] for q in range(self.size) if q != self.rank]
            combine(mine, _fit(peers[0], mine), op, out=out)  # mine first, then in rank order
            for theirs in peers[1:]:
                combine(out, _fit(theirs, mine), op)
            mine.copy_(out)
        self.publish(_REDUCED, n + 1)

    def copy_out_block(self, k: int, parts, cells) -> None:
        """3. Block k of every other chunk, reduced, from its owner's cell."""
        n = self.blocks + k
        self.wait(_REDUCED, n + 1, "all_reduce")
        for c, part in _block(parts, k):
            if c != self.rank:
                part.copy_(_fit(cells[c][k % CELLS][c], part))
        self.publish(_DONE, n + 1)  # my reads of this block, in every rank's cell, are over

    def _cells(self, dtype: torch.dtype) -> list[list[list[torch.Tensor]]]:
        """Views of the cells as ``dtype``, made once: indexing tensors costs microseconds."""
        if dtype not in self.views:
            block = self.cells.shape[2] // (self.size * dtype.itemsize)
            used = self.size * block * dtype.itemsize
            self.views[dtype] = [
                [list(cell[:used].view(dtype).view(self.size, block)) for cell in ring]
                for ring in self.cells
            ]
        return self.views[dtype]

    # ------------------------------------------------------------------ the others

    def slot(self, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s slot in this round's set."""
        return self.slots[self.rounds % 2, rank].view(dtype)[:numel]

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """``out`` (size x numel, contiguous) gets every rank's ``flat``, in pieces."""
        self.calls += 1
        per_slot = self.slots.shape[2] // flat.element_size()
        for start in range(0, max(1, flat.numel()), per_slot):
            self.rounds += 1
            piece = flat[start : start + per_slot]
            self.slot(self.rank, piece.dtype, piece.numel()).copy_(piece)
            self.barrier(flat.numel(), piece.dtype)  # no rank reads a slot before all are in
            self.check_same("all_gather tensor sizes or dtypes")
            for r in range(self.size):
                out[r, start : start + len(piece)].copy_(self.slot(r, piece.dtype, len(piece)))
            # no barrier here: the next piece writes the other set of slots

    def reduce_scatter(self, out: torch.Tensor, inputs: torch.Tensor, op) -> None:
        """``out`` (numel) = the reduction over ranks of ``inputs[self.rank]`` (size x numel)."""
        self.calls += 1
        per_slot = self.slots.shape[2] // (inputs.element_size() * self.size)
        numel = inputs.shape[1]
        for start in range(0, max(1, numel), per_slot):
            self.rounds += 1
            part = inputs[:, start : start + per_slot]  # (size, n): my contribution to each rank
            n = part.shape[1]
            self.slot(self.rank, part.dtype, self.size * n).view(self.size, n).copy_(part)
            self.barrier(numel, inputs.dtype)
            self.check_same("reduce_scatter tensor sizes or dtypes")
            mine = out[start : start + n]
            rows = [
                self.slot(r, part.dtype, self.size * n).view(self.size, n) for r in range(self.size)
            ]
            mine.copy_(rows[0][self.rank])
            for r in range(1, self.size):
                combine(mine, rows[r][self.rank], op)


def _block(parts: list[tuple[torch.Tensor, ...]], k: int, only: int | None = None):
    """(chunk, block k of it) for every chunk that has a block k (a chunk may have one less)."""
    for c, blocks in enumerate(parts):
        if k < len(blocks) and only in (None, c):
            yield c, blocks[k]


def _fit(room: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """The first ``len(part)`` elements of a cell's ``room`` (a chunk's last block is short)."""
    return room if len(room) == len(part) else room[: len(part)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # Linux on x86-64


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(address: int, seen: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``address`` (a counter's low half) still holds ``seen``,
    for at most ``seconds``. The kernel compares and sleeps in one step, so a wake-up between
    our last look and the sleep is never lost."""
    timeout = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    low = ctypes.c_uint32(seen & 0xFFFFFFFF)
    _LIBC.syscall(
        _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, low, ctypes.byref(timeout), None, 0
    )


def _futex_wake(address: int) -> None:
    """Wake every process asleep on the word at ``address`` (a shared mapping: any process)."""
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 1 << 30, None, None, 0)


def _boot_id() -> torch.Tensor:
    """This boot of this machine, as two int64: equal on two ranks only on the same host."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        raw = bytes.fromhex(f.read().strip().replace("-", ""))
    return torch.tensor([int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)])


def _where(fd: int, pid: int | None = None, number: int | None = None) -> torch.Tensor:
    """[pid, fd number, inode, device, boot id (2 words)] of the buffer file ``fd``."""
    info = os.fstat(fd)
    pid, number = (os.getpid(), fd) if pid is None else (pid, number)
    return torch.cat([torch.tensor([pid, number, info.st_ino, info.st_dev]), _boot_id()])


_GROUPS: dict[object, SharedMemoryGroup] = {}


def _shared(group) -> SharedMemoryGroup:
    """This process's buffer for ``group``, made on first use (a collective call, like the first
    ``dist.all_reduce`` of a new group); kept until the process group is destroyed."""
    key = dist.group.WORLD if group is None else group
    found = _GROUPS.get(key)
    if found is None or found.size != dist.get_world_size(group):
        found = _GROUPS[key] = SharedMemoryGroup.create(group)
    return found


def shm_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """``dist.all_reduce`` through shared memory: every rank of ``group`` on this host."""
    check_tensor(tensor)
    check_op(op, tensor.dtype)
    if tensor.device.type != "cpu":
        raise ValueError(f"shared memory holds CPU tensors; this one is on {tensor.device}")
    if dist.get_world_size(group) == 1 or dist.get_rank(group) < 0:
        return
    flat = flat_view(tensor)
    _shared(group).all_reduce(flat, op)
    finish_avg(flat, op, dist.get_world_size(group))
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def shm_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """``dist.all_gather`` through shared memory: ``tensor_list[i]`` gets rank i's ``tensor``."""
    check_tensor(tensor)
    size = dist.get_world_size(group)
    if len(tensor_list) != size or any(t.shape != tensor.shape for t in tensor_list):
        raise ValueError(f"tensor_list must hold {size} tensors shaped like tensor")
    out = torch.empty(size, tensor.numel(), dtype=tensor.dtype)
    if size == 1:
        out[0] = tensor.reshape(-1)
    else:
        _shared(group).all_gather(out, flat_view(tensor))
    for target, row in zip(tensor_list, out, strict=True):
        target.copy_(row.view(tensor.shape))


def shm_reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None
) -> None:
    """``dist.reduce_scatter`` through shared memory: rank i's ``output`` is the reduction of
    every rank's ``input_list[i]``."""
    check_tensor(output, "output")
    check_op(op, output.dtype)
    size = dist.get_world_size(group)
    if len(input_list) != size or any(t.shape != output.shape for t in input_list):
        raise ValueError(f"input_list must hold {size} tensors shaped like output")
    inputs = torch.stack([t.reshape(-1) for t in input_list])  # (size, numel)
    flat = flat_view(output)
    if size == 1:
        flat.copy_(inputs[0])
    else:
        _shared(group).reduce_scatter(flat, inputs, op)
    finish_avg(flat, op, size)
    if not output.is_contiguous():
        output.copy_(flat.view(output.shape))
