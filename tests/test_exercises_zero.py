"""Chapter 9b's exercise checkers: right answers pass, an unanswered cell is "not attempted", and
planted bugs (stage 2 sharding the parameters instead of the gradients, fp32 sizes whatever the
precision, the wrong stage, sizes swapped, no ValueError; a stage-3 linear that autograd cannot
see through, sums instead of averaging, keeps its own rank's gradient, or computes the wrong y;
stage 3 without the second all-gather, no (N-1)/N, gradients' bytes for the all-gather) are
caught with a message that says so, and an answer that calls the library is told it was
switched off."""

import pytest
import torch
import torch.distributed as dist

from dmlbook.advanced import zero
from dmlbook.exercises import ExerciseFailed
from dmlbook.exercises import zero as exercises


def unanswered(*args):
    raise NotImplementedError


# ---- 1. bytes per rank -------------------------------------------------------------------------


def bytes_per_rank(psi, world_size, stage, param_bytes, grad_bytes, state_bytes):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"no ZeRO stage {stage}")
    n = world_size
    return (
        param_bytes * psi / (n if stage == 3 else 1)
        + grad_bytes * psi / (n if stage >= 2 else 1)
        + state_bytes * psi / (n if stage >= 1 else 1)
    )


def bytes_params_sharded_at_stage_2(psi, world_size, stage, p, g, k):
    """The wrong answer fp32 could not tell apart: stage 2 shards the parameters."""
    if stage == 2:
        return p * psi / world_size + g * psi + k * psi / world_size
    return bytes_per_rank(psi, world_size, stage, p, g, k)


def bytes_fp32_always(psi, world_size, stage, p, g, k):
    return bytes_per_rank(psi, world_size, stage, 4, 4, 8)


def bytes_stage_shifted(psi, world_size, stage, p, g, k):
    """Stage 1 already shards the gradients: every stage one step ahead."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    return bytes_per_rank(psi, world_size, min(stage + 1, 3), p, g, k)


def bytes_swapped(psi, world_size, stage, p, g, k):
    return bytes_per_rank(psi, world_size, stage, g, p, k)


def bytes_without_valueerror(psi, world_size, stage, p, g, k):
    return bytes_per_rank(psi, world_size, min(max(stage, 0), 3), p, g, k)


def bytes_from_the_library(psi, world_size, stage, p, g, k):
    return sum(zero.paper_bytes(psi, world_size, stage, k, p, g).values())


def test_bytes_per_rank_passes_right_answers():
    assert exercises.check_bytes_per_rank(bytes_per_rank).status == "passed"


def test_the_paper_figure_is_among_the_cases():
    gb = [bytes_per_rank(7.5e9, 64, s, 2, 2, 12) / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]
    assert any(case[:2] == (7_500_000_000, 64) for case in exercises._CASES)


def test_unanswered_exercises_are_not_attempted():
    for check in (
        exercises.check_bytes_per_rank,
        exercises.check_fsdp_linear,
        exercises.check_comm_bytes,
    ):
        assert check(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (bytes_params_sharded_at_stage_2, "divided the parameters by N and kept the gradients"),
        (bytes_fp32_always, "the fp32 figure"),
        (bytes_stage_shifted, "next stage's figure"),
        (bytes_swapped, "swapped"),
        (bytes_without_valueerror, "instead of raising ValueError"),
        (bytes_from_the_library, "called the library instead"),
    ],
)
def test_bytes_per_rank_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_bytes_per_rank(answer)


# ---- 2. a stage-3 linear -----------------------------------------------------------------------


def _gather(shard, out_features, in_features, group):
    full = shard.new_empty(shard.numel() * dist.get_world_size(group))
    dist.all_gather_into_tensor(full, shard.detach().contiguous(), group=group)
    return full[: out_features * in_features].view(out_features, in_features)


def _make_fsdp_linear(op=dist.ReduceOp.AVG, local_only=False):
    class GatheredLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, out_features, in_features, group):
            ctx.save_for_backward(x, shard)  # the shard, not the gathered weight
            ctx.sizes, ctx.group = (out_features, in_features), group
            return x @ _gather(shard, out_features, in_features, group).T

        @staticmethod
        def backward(ctx, grad_y):
            x, shard = ctx.saved_tensors
            (out_features, in_features), group = ctx.sizes, ctx.group
            W = _gather(shard, out_features, in_features, group)  # gathered again
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            flat = shard.new_zeros(shard.numel() * world)
            flat[: out_features * in_features] = (grad_y.T @ x).reshape(-1)
            if local_only:
                grad_shard = flat[rank * shard.numel() : (rank + 1) * shard.numel()].clone()
            else:
                grad_shard = torch.empty_like(shard)
                dist.reduce_scatter_tensor(grad_shard, flat, op=op, group=group)
            return grad_y @ W, grad_shard, None, None, None

    def fsdp_linear(x, weight_shard, out_features, in_features, group):
        return GatheredLinear.apply(x, weight_shard, out_features, in_features, group)

    return fsdp_linear


fsdp_linear = _make_fsdp_linear()
fsdp_linear_summing = _make_fsdp_linear(op=dist.ReduceOp.SUM)
fsdp_linear_local_gradient = _make_fsdp_linear(local_only=True)


def fsdp_linear_without_autograd(x, weight_shard, out_features, in_features, group):
    return x @ _gather(weight_shard, out_features, in_features, group).T


def fsdp_linear_transposed(x, weight_shard, out_features, in_features, group):
    return fsdp_linear(x, weight_shard, out_features, in_features, group) * 1.5


def fsdp_linear_from_torch(x, weight_shard, out_features, in_features, group):
    from torch.distributed.nn.functional import all_gather

    full = torch.cat(all_gather(weight_shard, group=group))
    return x @ full[: out_features * in_features].view(out_features, in_features).T


def test_fsdp_linear_passes_the_right_answer():
    assert exercises.check_fsdp_linear(fsdp_linear).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (fsdp_linear_without_autograd, "no gradient reached weight_shard"),
        (fsdp_linear_summing, "the sum over the 3 ranks"),
        (fsdp_linear_local_gradient, "your own rank's gradient"),
        (fsdp_linear_transposed, r"y = x @ W.T"),
        (fsdp_linear_from_torch, "called the library instead"),
    ],
)
def test_fsdp_linear_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_fsdp_linear(answer)


# ---- 3. communication bytes --------------------------------------------------------------------


def comm_bytes(psi, world_size, stage, param_bytes, grad_bytes):
    ring = (world_size - 1) / world_size
    if stage == 0:
        return 2 * ring * grad_bytes * psi
    gathers = 2 if stage == 3 else 1
    return ring * (grad_bytes + gathers * param_bytes) * psi


def comm_stage3_like_the_others(psi, world_size, stage, p, g):
    return comm_bytes(psi, world_size, min(stage, 2), p, g)


def comm_without_ring_factor(psi, world_size, stage, p, g):
    return comm_bytes(psi, world_size, stage, p, g) * world_size / (world_size - 1)


def comm_gathers_gradients(psi, world_size, stage, p, g):
    return comm_bytes(psi, world_size, stage, g, g)


def comm_from_the_library(psi, world_size, stage, p, g):
    return zero.comm_bytes_per_step(psi, world_size, stage, p)


def test_comm_bytes_passes_right_answers():
    assert exercises.check_comm_bytes(comm_bytes).status == "passed"
    for stage in range(4):  # in fp32 it is the library's count
        assert comm_bytes(1000, 4, stage, 4, 4) == zero.comm_bytes_per_step(1000, 4, stage)


@pytest.mark.parametrize(
    "answer, message",
    [
        (comm_stage3_like_the_others, "gathers each unit twice"),
        (comm_without_ring_factor, r"without the ring's \(N-1\)/N"),
        (comm_gathers_gradients, "the all-gather moving gradients"),
        (comm_from_the_library, "called the library instead"),
    ],
)
def test_comm_bytes_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_comm_bytes(answer)


DELEGATING_ANSWERS = {
    "bytes_per_rank": bytes_from_the_library,
    "fsdp_linear": fsdp_linear_from_torch,
    "comm_bytes": comm_from_the_library,
}
