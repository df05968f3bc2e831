"""dmlbook.comm.alltoall: all-to-all from isend/irecv equals torch's ``dist.all_to_all_single``
(equal and uneven splits, empty blocks, a non-contiguous output) at world sizes 1-4; the
differentiable version's gradients equal ``torch.distributed.nn.functional``'s; every message is
traced; ranks that disagree on sizes or row shapes get a ValueError naming the ranks, on every
rank, and stay in step (no hang)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_checks import by_world, caught

from dmlbook.comm import alltoall, collectives
from dmlbook.comm.groups import group_rank_size

pytestmark = pytest.mark.usefixtures("one_thread")


def _splits(src: int, world: int) -> list[int]:
    """How many rows rank ``src`` sends to each rank: uneven, some empty (a closed form)."""
    return [(src + 2 * dst) % 3 for dst in range(world)]


def _checks() -> dict:
    rank, world = group_rank_size()
    out: dict = {}
    # Equal splits, rank-valued input: rank r sends r * 100 + j to rank j.
    x = torch.stack([torch.full((3,), 100.0 * rank + j) for j in range(world)])  # (world, 3)
    ours = torch.empty_like(x)
    with collectives.recording_sends() as sends:
        alltoall.all_to_all_single(ours, x)
    out["equal"] = ours[:, 0].tolist()
    out["sends"] = [(s.collective, s.src, s.dst, s.nbytes) for s in sends if s.phase == "exchange"]
    out["check_sends"] = [s.collective for s in sends if s.phase != "exchange"]
    if world > 1:
        theirs = torch.empty_like(x)
        dist.all_to_all_single(theirs, x)
        out["equal_torch"] = torch.equal(ours, theirs)

    # Uneven splits with empty blocks, 2-D rows, into a non-contiguous output.
    in_splits = _splits(rank, world)
    out_splits = [_splits(src, world)[rank] for src in range(world)]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(in_splits), 2, 4, generator=g, dtype=torch.float64)
    ours = torch.empty(4, 2, sum(out_splits), dtype=torch.float64).permute(2, 1, 0)
    alltoall.all_to_all_single(ours, x, out_splits, in_splits)
    out["uneven_shape"] = tuple(ours.shape)
    if world > 1:
        theirs = torch.empty(sum(out_splits), 2, 4, dtype=torch.float64)
        dist.all_to_all_single(theirs, x, out_splits, in_splits)
        out["uneven_torch"] = torch.equal(ours, theirs)

        # Gradients of the differentiable version against torch.distributed.nn.functional's.
        from torch.distributed.nn.functional import all_to_all_single as torch_a2a

        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo = alltoall.differentiable_all_to_all(xo, out_splits, in_splits)
        yt = torch_a2a(torch.empty_like(theirs), xt, out_splits, in_splits)
        w = torch.randn(yo.shape, generator=g, dtype=torch.float64)
        (yo * w).sum().backward()
        (yt * w).sum().backward()
        out["grad_error"] = (xo.grad - xt.grad).abs().max().item()

        # Disagreements: every rank raises, naming the ranks.
        bad_in = list(in_splits)
        if rank == 0:
            bad_in[1] += 1  # rank 0 sends one more row to rank 1 than rank 1 expects
        xb = torch.zeros(sum(bad_in), 2, 4, dtype=torch.float64)
        yb = torch.zeros(sum(out_splits), 2, 4, dtype=torch.float64)
        out["bad_sizes"] = caught(lambda: alltoall.all_to_all_single(yb, xb, out_splits, bad_in))
        width = 5 if rank == world - 1 else 4  # the last rank's rows are wider
        xw, yw = torch.zeros(world, width), torch.zeros(world, width)
        out["bad_rows"] = caught(lambda: alltoall.all_to_all_single(yw, xw))
        check = torch.ones(1)
        dist.all_reduce(check)
        out["after_errors"] = check.item()
    return out


results = by_world(_checks, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_equal_splits_transpose_the_blocks(world):
    for rank, r in enumerate(results(world)):
        assert r["equal"] == [100.0 * src + rank for src in range(world)]
        if world > 1:
            assert r["equal_torch"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_splits_equal_torch(world):
    for rank, r in enumerate(results(world)):
        rows = sum(_splits(src, world)[rank] for src in range(world))
        assert r["uneven_shape"] == (rows, 2, 4)
        if world > 1:
            assert r["uneven_torch"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradients_go_back_where_they_came_from(world):
    for r in results(world):
        assert r["grad_error"] == 0.0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_message_is_traced(world):
    for rank, r in enumerate(results(world)):
        expected = [("all_to_all", rank, (rank + s) % world, 12) for s in range(1, world)]
        assert r["sends"] == expected  # p - 1 messages of 3 float32, one to each other rank
        # and the check's all-gather of sizes: a ring of p - 1 steps (no shape check of its own)
        assert r["check_sends"] == ["all_gather"] * (world - 1)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_disagreements_raise_on_every_rank_and_the_ranks_stay_in_step(world):
    for r in results(world):
        assert "rank 0 sends" in r["bad_sizes"] and "to rank 1, which expects" in r["bad_sizes"]
        assert f"rank {world - 1}: rows of shape (5,)" in r["bad_rows"]
        assert "rank 0: rows of shape (4,)" in r["bad_rows"]
        assert r["after_errors"] == world


def test_local_argument_errors():
    x = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="add up to 4, but dimension 0 of input has 5 rows"):
        alltoall.all_to_all_single(torch.zeros(5, 2), x, [5], [4])
    with pytest.raises(ValueError, match="same row shape"):
        alltoall.all_to_all_single(torch.zeros(5, 3), x)
    assert alltoall.exchange_sizes([3, 4]) == [[3, 4]]
    assert alltoall.differentiable_all_to_all(x) is x  # one rank: nothing moves
