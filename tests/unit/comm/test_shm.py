"""The shared-memory transport (:mod:`dmlbook.comm.shm`, chapter 4) against gloo and one process.

Each rank's input is built from its rank, so the result has a closed form (the single-process
reference), and gloo's ``dist`` collective on the same inputs is the production counterpart.
Checks are batched into one launch per world size.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dmlbook.comm import collectives, shm
from dmlbook.launch import RankError, run

# (numel, dtype, op): a length no world size divides, one shorter than the world, an empty one,
# and one of 4 MiB that streams through more blocks than a rank has cells
CASES = [
    ((1 << 20) + 3, torch.float32, ReduceOp.SUM),
    (1001, torch.float32, ReduceOp.SUM),
    (1001, torch.float64, ReduceOp.AVG),
    (3, torch.int64, ReduceOp.MAX),
    (7, torch.float32, ReduceOp.MIN),
    (10, torch.float64, ReduceOp.PRODUCT),
    (1000, torch.bfloat16, ReduceOp.SUM),
    (0, torch.float32, ReduceOp.SUM),
]
# The cases that also go through 64-byte cells (below); the 4 MiB one would be 10^5 blocks of
# Python per rank there, and streams through the default cells
SMALL_CELL_CASES = [i for i, (numel, _, _) in enumerate(CASES) if numel <= 1001]


def _input(numel: int, dtype, rank: int, salt: int = 0) -> torch.Tensor:
    values = torch.arange(numel, dtype=torch.float64) % 7 + rank + 1 + salt
    return values.to(dtype)


def _reference(numel, dtype, op, world_size) -> torch.Tensor:
    """One process, every rank's input in hand."""
    stack = torch.stack([_input(numel, dtype, r).double() for r in range(world_size)])
    reduce = {
        ReduceOp.SUM: lambda s: s.sum(0),
        ReduceOp.AVG: lambda s: s.mean(0),
        ReduceOp.MAX: lambda s: s.max(0).values,
        ReduceOp.MIN: lambda s: s.min(0).values,
        ReduceOp.PRODUCT: lambda s: s.prod(0),
    }[op]
    return reduce(stack)


def _every_collective():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, (numel, dtype, op) in enumerate(CASES):
        ours = _input(numel, dtype, rank)
        shm.shm_all_reduce(ours, op)
        theirs = _input(numel, dtype, rank)
        if op == ReduceOp.AVG:  # gloo has no AVG: sum, then divide, as torch's docs suggest
            dist.all_reduce(theirs)
            theirs /= world
        else:
            dist.all_reduce(theirs, op)
        via_collectives = _input(numel, dtype, rank).reshape(1, -1).t()  # not contiguous
        collectives.all_reduce(via_collectives, op, algorithm="shm")
        out[f"all_reduce {i}"] = (ours, theirs, via_collectives.reshape(-1))
    # many blocks: with cells of 64 bytes, a block holds 2 to 8 elements, so a chunk of 1001
    # goes around the ring of cells dozens of times, in calls that follow each other
    small = shm.SharedMemoryGroup.create(cell_bytes=64, slot_bytes=256)
    for i in SMALL_CELL_CASES:
        numel, dtype, op = CASES[i]
        blocks = _input(numel, dtype, rank)
        small.all_reduce(blocks, op)
        if op == ReduceOp.AVG:
            blocks /= world  # what the public function does after the transport
        out[f"blocks {i}"] = blocks
    # pieces: a slot of 256 bytes carries 1001 float32 in 16 pieces (all_gather) and 301 in
    # 5 to 19 (reduce_scatter: every rank's part of each piece shares the slot)
    mine = _input(1001, torch.float32, rank, salt=rank)
    gathered = torch.empty(world, 1001)
    small.all_gather(gathered, mine)
    expected = [torch.empty(1001) for _ in range(world)]
    dist.all_gather(expected, mine)
    out["pieces all_gather"] = (gathered, torch.stack(expected))
    inputs = torch.stack([_input(301, torch.float32, rank, salt=j) for j in range(world)])
    scattered = torch.empty(301)
    small.reduce_scatter(scattered, inputs, ReduceOp.SUM)
    everything = inputs.clone()
    dist.all_reduce(everything)
    out["pieces reduce_scatter"] = (scattered, everything[rank])
    # all_gather and reduce_scatter, against gloo's
    mine = _input(5, torch.float32, rank, salt=rank)
    gathered = [torch.empty(5) for _ in range(world)]
    shm.shm_all_gather(gathered, mine)
    expected = [torch.empty(5) for _ in range(world)]
    dist.all_gather(expected, mine)
    out["all_gather"] = (torch.stack(gathered), torch.stack(expected))
    inputs = [_input(6, torch.float32, rank, salt=j) for j in range(world)]
    scattered = torch.empty(6)
    shm.shm_reduce_scatter(scattered, inputs, ReduceOp.SUM)
    # gloo has no reduce_scatter: all-reduce everything and keep this rank's block
    everything = torch.stack(inputs)
    dist.all_reduce(everything)
    out["reduce_scatter"] = (scattered, everything[rank])
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equal_to_gloo_and_to_one_process(world_size):
    results = run(_every_collective, world_size, timeout=90)
    for rank, out in enumerate(results):
        for i, (numel, dtype, op) in enumerate(CASES):
            ours, theirs, via_collectives = out[f"all_reduce {i}"]
            expected = _reference(numel, dtype, op, world_size).to(dtype)
            tolerance = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=0)
            torch.testing.assert_close(ours, expected, **tolerance, msg=f"rank {rank} case {i}")
            torch.testing.assert_close(ours, theirs, **tolerance)
            torch.testing.assert_close(via_collectives, ours, atol=0, rtol=0)
            if i in SMALL_CELL_CASES:
                torch.testing.assert_close(out[f"blocks {i}"], ours, atol=0, rtol=0)
        torch.testing.assert_close(*out["pieces all_gather"], atol=0, rtol=0)
        torch.testing.assert_close(*out["pieces reduce_scatter"], atol=0, rtol=0)
        torch.testing.assert_close(*out["all_gather"], atol=0, rtol=0)
        torch.testing.assert_close(*out["reduce_scatter"], atol=0, rtol=0)
    if world_size > 1:  # every rank holds the same bits
        for i in range(len(CASES)):
            assert all(torch.equal(r[f"all_reduce {i}"][0], results[0][f"all_reduce {i}"][0])
                       for r in results)  # fmt: skip


def _mismatched_then_recovered():
    rank = dist.get_rank()
    try:
        shm.shm_all_reduce(torch.ones(4 + rank))
    except ValueError as e:
        said = str(e)
    else:
        said = None
    t = torch.ones(3)
    shm.shm_all_reduce(t)  # the group still works after the error
    return said, t.tolist()


def test_mismatched_sizes_are_the_same_value_error_on_every_rank():
    results = run(_mismatched_then_recovered, 3, timeout=60)
    messages = {said for said, _ in results}
    assert len(messages) == 1 and None not in messages
    (message,) = messages
    assert "rank 0: 4 x torch.float32" in message and "rank 2: 6 x torch.float32" in message
    assert all(values == [3.0, 3.0, 3.0] for _, values in results)


def _killed_mid_collective():
    t = torch.ones(1 << 16)
    shm.shm_all_reduce(t)  # the buffer exists on every rank
    if dist.get_rank() == 1:
        os.kill(os.getpid(), 9)
    shm.shm_all_reduce(t)  # rank 0 waits for a rank that is gone


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_a_killed_rank_is_an_error_and_leaves_no_segment():
    before = _dev_shm()
    with pytest.raises(RankError, match="rank 1"):
        run(_killed_mid_collective, 2, timeout=30)
    assert _dev_shm() - before == set()  # the buffer had no name to leave behind


def _lonely_barrier():
    group = shm.SharedMemoryGroup.create(timeout=0.5)
    if dist.get_rank() == 0:
        try:
            group.barrier()
        except TimeoutError as e:
            return str(e)
    return None


def test_a_rank_that_never_arrives_is_a_timeout_naming_it():
    said, _ = run(_lonely_barrier, 2, timeout=30)
    assert "ranks [1] did not arrive" in said


def _as_if_on_another_host():
    if dist.get_rank() == 1:
        shm._boot_id = lambda: torch.tensor([1, 2])  # another machine's boot
    shm.SharedMemoryGroup.create()


def test_ranks_on_two_hosts_are_refused_naming_the_rank():
    with pytest.raises(RankError, match="rank 1 is not on group rank 0's"):
        run(_as_if_on_another_host, 2, timeout=30)


def _stops_after_the_barrier():
    group = shm.SharedMemoryGroup.create(timeout=0.5)
    if dist.get_rank() == 1:
        group.start(1000, torch.float32, "all_reduce")  # the call's barrier, then nothing
        return None
    try:
        group.all_reduce(torch.ones(1000), ReduceOp.SUM)
    except TimeoutError as e:
        return str(e)


def test_a_rank_that_stops_mid_pipeline_is_a_timeout_naming_it():
    said, _ = run(_stops_after_the_barrier, 2, timeout=30)
    assert "all_reduce: ranks [1] did not arrive" in said
