"""dmlbook.comm.groups: a rank's place in a group, and the three ways a size is cut over ranks."""

import pytest
import torch

from dmlbook.comm.groups import (
    balanced_blocks,
    even_block,
    group_rank_size,
    padded_block,
    padded_size,
)


def test_outside_a_process_group_a_rank_is_alone():
    assert group_rank_size() == (0, 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_balanced_blocks_tile_the_size_in_order(world):
    for size in (0, 1, world - 1, 5, 37, 1000 + world):
        blocks = balanced_blocks(size, world)
        assert len(blocks) == world and blocks[0][0] == 0 and blocks[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        lengths = [b - a for a, b in blocks]
        assert max(lengths) - min(lengths) <= 1
        assert lengths == sorted(lengths, reverse=True)  # the longer ones come first


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_even_blocks_need_exact_division(world):
    size = 12 * world
    blocks = [even_block(size, rank=r, world_size=world) for r in range(world)]
    assert blocks == balanced_blocks(size, world)  # when it divides, the two agree
    if world > 1:
        with pytest.raises(ValueError, match=rf"n_head={size + 1} is not divisible by the {world}"):
            even_block(size + 1, rank=0, world_size=world, what="n_head")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padded_blocks_are_equal_and_cover_the_padding(world):
    for size in (0, 1, 5, 55, 64):
        blocks = [padded_block(size, rank=r, world_size=world) for r in range(world)]
        assert blocks[0][0] == 0 and blocks[-1][1] == padded_size(size, world)
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        assert len({b - a for a, b in blocks}) == 1
        assert padded_size(size, world) - size < world  # never a whole block of padding more
    assert padded_block(55, rank=2, world_size=3) == (38, 57)  # 55 -> 57, two of padding


@pytest.mark.parametrize("fn", [even_block, padded_block])
def test_bad_ranks_and_worlds_are_refused(fn):
    with pytest.raises(ValueError, match="rank 3 is not a rank of a world of 3"):
        fn(6, rank=3, world_size=3)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        fn(6, rank=0, world_size=0)
    with pytest.raises(TypeError):
        fn(6, 0, 3)  # rank and world_size are keyword-only: they cannot be swapped


def _rows_of_rank(_):
    from dmlbook.comm.groups import local_rows
    from dmlbook.models import Batch

    batch = Batch(torch.arange(12).reshape(6, 2), torch.arange(6))
    mine = local_rows(batch)
    return (
        type(mine).__name__,
        mine.inputs.tolist(),
        mine.targets.tolist(),
        local_rows(torch.arange(6)).tolist(),
    )


def test_local_rows_give_each_rank_its_even_block_of_the_batch():
    from dmlbook.comm.groups import local_rows
    from dmlbook.launch import run
    from dmlbook.models import Batch

    whole = torch.arange(6)
    assert torch.equal(local_rows(whole), whole)  # outside a process group: the whole batch
    pair = local_rows((whole, whole + 1))
    assert type(pair) is tuple and torch.equal(pair[1], whole + 1)
    got = run(_rows_of_rank, 3, None)
    assert [g[0] for g in got] == ["Batch"] * 3  # a named tuple keeps its type
    assert [g[2] for g in got] == [[0, 1], [2, 3], [4, 5]]
    assert [g[1] for g in got] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert [g[3] for g in got] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="parts of a batch must have as many rows"):
        local_rows(Batch(whole, whole[:5]))


def _rows_that_do_not_divide(_):
    from dmlbook.comm.groups import local_rows

    return local_rows(torch.arange(7))


def test_local_rows_refuse_a_batch_that_does_not_divide():
    from dmlbook.launch import RankError, run

    with pytest.raises(RankError, match="batch rows=7 is not divisible by the 2 ranks"):
        run(_rows_that_do_not_divide, 2, None)


def test_ring_schedule_is_the_chunks_and_their_slices_and_follows_the_slice_size(monkeypatch):
    from dmlbook.comm import groups

    for numel, parts in ((0, 3), (2, 4), (1001, 3), (3 * groups.RING_SLICE_BYTES // 4 * 2 + 5, 2)):
        chunks, slices = groups.ring_schedule(numel, parts, 4)
        assert list(chunks) == balanced_blocks(numel, parts)
        assert [list(s) for s in slices] == [groups.ring_slices(a, b, 4) for a, b in chunks]
        # the slices of a chunk tile it, in order, none empty
        for (a, b), cut in zip(chunks, slices, strict=True):
            assert [x for s in cut for x in s] == sorted(x for s in cut for x in s)
            assert sum(stop - start for start, stop in cut) == b - a
            assert not cut or (cut[0][0], cut[-1][1]) == (a, b)
            assert all(stop > start for start, stop in cut)
    # kept per shape, yet a changed slice size gives a new schedule
    numel = groups.RING_SLICE_BYTES  # 4 bytes an element: 4 slices of RING_SLICE_BYTES a chunk
    assert [len(s) for s in groups.ring_schedule(numel, 1, 4)[1]] == [4]
    monkeypatch.setattr(groups, "RING_SLICE_BYTES", 2 * groups.RING_SLICE_BYTES)
    assert [len(s) for s in groups.ring_schedule(numel, 1, 4)[1]] == [2]
