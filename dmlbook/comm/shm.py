"""Collectives through shared memory, for ranks on one host (chapter 4: leveraging host resources).

Chapter 2's collectives are schedules of messages, and over gloo every message crosses the
loopback TCP stack: about 1-2 GB/s here, while one core copies memory at about 20 GB/s. Ranks on
one machine can skip the network altogether and meet in memory, which is what NCCL's
shared-memory transport and DeepSpeed's CPU all-reduce do. This module is that transport, small
enough to read:

* **One buffer per group.** Group rank 0 makes an anonymous memory file (``memfd_create``) with a
  header and one *slot* per rank; the others open it through ``/proc/<pid>/fd/<fd>`` and map it.
  It has no name on the machine, so no other run can meet it, and the kernel frees it when the
  last rank that mapped it exits, however it exits: nothing is ever left behind.
* **The ranks' own synchronisation.** A barrier is a counter per rank in the header: a rank
  publishes its count, then waits until every rank's count has reached it. No message, no TCP.
  (This relies on x86-64's store order: data written before a counter is seen before it.)
* **All-reduce = reduce-scatter + all-gather through memory.** Each rank copies its tensor into
  its slot, all but chunk r (the same chunks as chapter 2's ring), which only rank r needs;
  barrier; rank r adds chunk r of every other slot into its own tensor and puts the sum into
  chunk r of its slot; barrier; each rank copies every other chunk of the sum from its owner's
  slot. No byte crosses a socket.
* **Two sets of slots, used in turn**, so that no barrier is needed at the end: a round writes
  the set the round before last read, and no rank starts that round before every rank has
  passed the first barrier of the round between, so every read of the old round is done. Two
  barriers per round, not three (each costs a wake-up when a rank waits for a descheduled peer).

The functions follow ``torch.distributed``'s signatures. ``check`` is free here: each rank writes
its tensor's size and dtype into the header at the first barrier, and every rank compares them,
so a mismatch is the same ValueError on every rank. A rank that never arrives (it died, or never
called) becomes a TimeoutError naming it after ``timeout`` seconds, never a hang.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dmlbook.comm.groups import balanced_blocks
from dmlbook.comm.p2p import _DTYPES, _check_op, _check_tensor, _combine, _finish_avg, _flat

__all__ = ["SLOT_BYTES", "SharedMemoryGroup", "all_gather", "all_reduce", "reduce_scatter"]

SLOT_BYTES = 8 << 20  # each rank's slot; larger tensors go through in pieces of this size
_HEADER_WORDS = 8  # int64 words per rank: 64 bytes, one cache line, so ranks never share one
# Word 0 is the rank's barrier count; words 1-2 or 3-4 (by the round's parity) what the call
# passed, its numel and dtype. Two places, because a rank that has raised on a mismatch may
# publish its next call's while a slower rank still reads this one's.
_COUNT = 0
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass
class SharedMemoryGroup:
    """A group's shared buffer: ``header[r]`` is rank r's line, ``slots[s, r]`` its bytes in
    set s (rounds alternate between the two sets)."""

    rank: int
    size: int
    header: torch.Tensor  # (size, _HEADER_WORDS) int64, in shared memory
    slots: torch.Tensor  # (2, size, slot_bytes) uint8, in shared memory
    timeout: float
    count: int = 0  # barriers this rank has passed
    rounds: int = 0  # rounds (a call's pieces that fit a slot) this rank has started

    @classmethod
    def create(cls, group=None, slot_bytes: int = SLOT_BYTES, timeout: float = 60.0):
        """Collective over ``group``: rank 0 makes the buffer, every rank maps it."""
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise NotImplementedError(
                "the shared-memory transport relies on x86-64's store order; use gloo here"
            )
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        header_bytes = size * _HEADER_WORDS * 8
        total = header_bytes + 2 * size * slot_bytes
        if rank == 0:
            fd = os.memfd_create("dmlbook-shm", os.MFD_CLOEXEC)  # a label, not a name to share
            os.ftruncate(fd, total)
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
        slots = memory[header_bytes:].view(2, size, slot_bytes)
        return cls(rank, size, header, slots, timeout)

    # ------------------------------------------------------------------ synchronisation

    def barrier(self, numel: int = -1, dtype: torch.dtype | None = None) -> None:
        """Wait until every rank has arrived here; optionally publish what this call passed."""
        self.count += 1
        mine = self.header[self.rank]
        if dtype is not None:
            at = self._published()
            mine[at], mine[at + 1] = numel, _DTYPE_CODE[dtype]
        mine[_COUNT] = self.count  # written last: seen only after the words above
        counts = self.header.numpy()[:, _COUNT]  # the same memory, read without torch's overhead
        deadline = time.monotonic() + self.timeout
        spins = 0
        while counts.min() < self.count:
            spins += 1
            if spins > 100:  # about 50 us: the peer is late, likely not even running
                time.sleep(0 if spins < 1000 else 50e-6)  # let a rank sharing our core in
                if time.monotonic() > deadline:
                    late = [r for r in range(self.size) if counts[r] < self.count]
                    raise TimeoutError(
                        f"shared-memory barrier: ranks {late} did not arrive in "
                        f"{self.timeout:.0f} s (did they call the same collective?)"
                    )

    def check_same(self, what: str) -> None:
        """After a publishing barrier: the same numel and dtype on every rank, or ValueError."""
        at = self._published()
        rows = self.header[:, [at, at + 1]].tolist()
        if any(row != rows[0] for row in rows):
            found = ", ".join(
                f"rank {r}: {numel} x {_DTYPES[code]}" for r, (numel, code) in enumerate(rows)
            )
            raise ValueError(f"{what} differ across ranks: {found}")

    def _published(self) -> int:
        return 1 + 2 * (self.rounds % 2)

    def slot(self, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s slot in this round's set."""
        return self.slots[self.rounds % 2, rank].view(dtype)[:numel]

    # ------------------------------------------------------------------ the collectives

    def all_reduce(self, flat: torch.Tensor, op) -> None:
        """``flat`` (1-D, contiguous) reduced in place, in pieces that fit a slot."""
        per_slot = self.slots.shape[2] // flat.element_size()
        for start in range(0, max(1, flat.numel()), per_slot):  # once, even when empty
            self.rounds += 1
            piece = flat[start : start + per_slot]
            blocks = balanced_blocks(piece.numel(), self.size)  # chunk r is rank r's to reduce
            lo, hi = blocks[self.rank]
            mine = self.slot(self.rank, piece.dtype, piece.numel())
            mine[:lo].copy_(piece[:lo])  # 1. my data in, but for my own chunk: nobody else
            mine[hi:].copy_(piece[hi:])  #    needs it, and I keep it where it is
            self.barrier(flat.numel(), piece.dtype)
            self.check_same("all_reduce tensor sizes or dtypes")
            for r in range(self.size):  # 2. my chunk, reduced over every rank's data
                if r != self.rank:
                    _combine(piece[lo:hi], self.slot(r, piece.dtype, piece.numel())[lo:hi], op)
            mine[lo:hi].copy_(piece[lo:hi])  # where the others will read it
            self.barrier()
            for r, (a, b) in enumerate(blocks):  # 3. the other chunks, from their owners' slots
                if r != self.rank:
                    piece[a:b].copy_(self.slot(r, piece.dtype, piece.numel())[a:b])
            # no barrier here: the next round writes the other set of slots

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """``out`` (size x numel, contiguous) gets every rank's ``flat``, in pieces."""
        per_slot = self.slots.shape[2] // flat.element_size()
        for start in range(0, max(1, flat.numel()), per_slot):
            self.rounds += 1
            piece = flat[start : start + per_slot]
            self.slot(self.rank, piece.dtype, piece.numel()).copy_(piece)
            self.barrier(flat.numel(), piece.dtype)
            self.check_same("all_gather tensor sizes or dtypes")
            for r in range(self.size):
                out[r, start : start + len(piece)].copy_(self.slot(r, piece.dtype, len(piece)))

    def reduce_scatter(self, out: torch.Tensor, inputs: torch.Tensor, op) -> None:
        """``out`` (numel) = the reduction over ranks of ``inputs[self.rank]`` (size x numel)."""
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
                _combine(mine, rows[r][self.rank], op)


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


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """``dist.all_reduce`` through shared memory: every rank of ``group`` on this host."""
    _check_tensor(tensor)
    _check_op(op, tensor.dtype)
    if tensor.device.type != "cpu":
        raise ValueError(f"shared memory holds CPU tensors; this one is on {tensor.device}")
    if dist.get_world_size(group) == 1 or dist.get_rank(group) < 0:
        return
    flat = _flat(tensor)
    _shared(group).all_reduce(flat, op)
    _finish_avg(flat, op, dist.get_world_size(group))
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """``dist.all_gather`` through shared memory: ``tensor_list[i]`` gets rank i's ``tensor``."""
    _check_tensor(tensor)
    size = dist.get_world_size(group)
    if len(tensor_list) != size or any(t.shape != tensor.shape for t in tensor_list):
        raise ValueError(f"tensor_list must hold {size} tensors shaped like tensor")
    out = torch.empty(size, tensor.numel(), dtype=tensor.dtype)
    if size == 1:
        out[0] = tensor.reshape(-1)
    else:
        _shared(group).all_gather(out, _flat(tensor))
    for target, row in zip(tensor_list, out, strict=True):
        target.copy_(row.view(tensor.shape))


def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None
) -> None:
    """``dist.reduce_scatter`` through shared memory: rank i's ``output`` is the reduction of
    every rank's ``input_list[i]``."""
    _check_tensor(output, "output")
    _check_op(op, output.dtype)
    size = dist.get_world_size(group)
    if len(input_list) != size or any(t.shape != output.shape for t in input_list):
        raise ValueError(f"input_list must hold {size} tensors shaped like output")
    inputs = torch.stack([t.reshape(-1) for t in input_list])  # (size, numel)
    flat = _flat(output)
    if size == 1:
        flat.copy_(inputs[0])
    else:
        _shared(group).reduce_scatter(flat, inputs, op)
    _finish_avg(flat, op, size)
    if not output.is_contiguous():
        output.copy_(flat.view(output.shape))
