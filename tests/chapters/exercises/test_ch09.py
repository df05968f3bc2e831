"""Chapter 9's exercise checkers: right answers pass; planted bugs (column and row swapped, the
nn.Linear orientation, interleaved blocks, the next rank's block, a remainder for the last rank
instead of ValueError; a gather that autograd cannot see through, a backward that sums over the
ranks or averages over them, the global rank used for the group rank, pieces for the world
instead of the group, blocks in the wrong order, no gather at all) are caught with a message that
says so, and an answer that calls the library (torch's autograd gathers too) is told it was
switched off."""

import pytest
import torch
import torch.distributed as dist

from dmlbook.comm.groups import even_block
from dmlbook.exercises import ExerciseFailed, ch09


def unanswered(*args):
    raise NotImplementedError


# ---- 1. weight shards -------------------------------------------------------------------------


def shard(W, rank, world_size, split):
    dim = 1 if split == "column" else 0
    if W.shape[dim] % world_size:
        raise ValueError(f"{W.shape[dim]} does not divide by {world_size}")
    return W.chunk(world_size, dim=dim)[rank]


def shard_swapped(W, rank, world_size, split):
    return shard(W, rank, world_size, "row" if split == "column" else "column")


def shard_linear_orientation(W, rank, world_size, split):
    return shard(W.T, rank, world_size, "row" if split == "column" else "column")


def shard_interleaved(W, rank, world_size, split):
    shard(W, rank, world_size, split)  # the divisibility check
    return W[:, rank::world_size] if split == "column" else W[rank::world_size, :]


def shard_remainder_to_last(W, rank, world_size, split):
    dim = 1 if split == "column" else 0
    block = W.shape[dim] // world_size
    stop = W.shape[dim] if rank == world_size - 1 else (rank + 1) * block
    return W.narrow(dim, rank * block, stop - rank * block)


def shard_next_rank(W, rank, world_size, split):  # off by one in the start index
    return shard(W, (rank + 1) % world_size, world_size, split)


def test_weight_shard_passes_the_right_answer():
    assert ch09.check_weight_shard(shard).status == "passed"


def test_weight_shard_not_attempted():
    assert ch09.check_weight_shard(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (shard_swapped, "keeps all of W's"),
        (shard_linear_orientation, "transpose"),
        (shard_interleaved, "interleaved"),
        (shard_next_rank, "that is rank 1's block"),
        (shard_remainder_to_last, "instead of raising ValueError"),
    ],
)
def test_weight_shard_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch09.check_weight_shard(answer)


# ---- 2. the all-gather's conjugate ------------------------------------------------------------


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, group):
        ctx.rank, ctx.width = dist.get_rank(group), block.shape[-1]
        pieces = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, block.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


def gather(block, group):
    return _Gather.apply(block, group)


def gather_by_joining_my_block(block, group):
    pieces = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, block.detach().contiguous(), group=group)
    pieces[dist.get_rank(group)] = block  # autograd reaches my block only
    return torch.cat(pieces, dim=-1)


def gather_without_autograd(block, group):
    pieces = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, block.detach().contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


class _SummingGather(_Gather):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group if hasattr(ctx, "group") else None)
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


def gather_summing_in_backward(block, group):
    return _SummingGather.apply(block, group)


class _AveragingGather(_Gather):  # right numbers, needless communication
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


def gather_averaging_in_backward(block, group):
    return _AveragingGather.apply(block, group)


class _GlobalRankGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, group):
        ctx.rank, ctx.width = dist.get_rank(), block.shape[-1]  # the world's rank, not the group's
        pieces = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, block.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


def gather_with_global_rank(block, group):
    return _GlobalRankGather.apply(block, group)


def gather_world_sized(block, group):
    pieces = [torch.empty_like(block) for _ in range(dist.get_world_size())]  # the world's size
    dist.all_gather(pieces, block.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def gather_functional_autograd(block, group):
    from torch.distributed import _functional_collectives as fc

    size = dist.get_world_size(group)
    whole = fc.all_gather_tensor_autograd(block, gather_dim=block.dim() - 1, group=group)
    return whole / size + (whole - whole / size).detach()  # backward's sum divided by p


def gather_reversed(block, group):
    return torch.flip(gather(block, group).unflatten(-1, (-1, block.shape[-1])), (-2,)).flatten(-2)


def gather_my_block_only(block, group):
    return block * 1


def gather_from_the_library(block, group):
    from dmlbook.advanced.tensor_parallel import comm

    return comm.gather_from_tensor_parallel(block, group)


def gather_through_the_library_class(block, group):
    from dmlbook.advanced import tensor_parallel as tp

    return tp.AllGatherForwardSplitBackward.apply(block, group)


@pytest.mark.parametrize("answer", [gather, gather_by_joining_my_block])
def test_gather_last_dim_passes_right_answers(answer):
    assert ch09.check_gather_last_dim(answer).status == "passed"


def test_gather_last_dim_not_attempted():
    assert ch09.check_gather_last_dim(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (gather_without_autograd, "no gradient reached"),
        (gather_summing_in_backward, "backward called torch.distributed.all_reduce"),
        (gather_averaging_in_backward, "Backward needs no communication"),
        (gather_with_global_rank, "global rank 1 is group rank 0"),
        (gather_world_sized, "dist.get_world_size\\(group\\)"),
        (gather_functional_autograd, "called the library instead"),
        (gather_reversed, "put group rank i's block"),
        (gather_my_block_only, "this rank's block alone"),
        (gather_from_the_library, "called the library instead"),
        (gather_through_the_library_class, "called the library instead"),
    ],
)
def test_gather_last_dim_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch09.check_gather_last_dim(answer)


def test_the_library_works_again_after_a_check():
    from dmlbook.advanced import tensor_parallel as tp

    with pytest.raises(ExerciseFailed):
        ch09.check_gather_last_dim(gather_through_the_library_class)
    x = torch.ones(2, 3, requires_grad=True)
    tp.AllGatherForwardSplitBackward.apply(x, None).sum().backward()  # world size 1: identity
    assert torch.equal(x.grad, torch.ones(2, 3))


def shard_from_the_library(W, rank, world_size, split):
    dim = 1 if split == "column" else 0
    start, stop = even_block(W.shape[dim], rank=rank, world_size=world_size)
    return W.narrow(dim, start, stop - start)


def test_weight_shard_rejects_the_library():
    with pytest.raises(ExerciseFailed, match="called the library instead"):
        ch09.check_weight_shard(shard_from_the_library)


DELEGATING_ANSWERS = {
    "weight_shard": shard_from_the_library,
    "gather_last_dim": gather_from_the_library,
}


def test_checkers_want_a_function():
    with pytest.raises(TypeError, match="your function itself"):
        ch09.check_weight_shard(torch.zeros(2))
