"""Chapter 9b's exercise checkers: right answers pass, an unanswered cell is "not attempted", and
planted bugs (the largest model: stage 2 sharding the parameters, mixed-precision sizes whatever
the precision, the wrong stage, rounding up, not a whole number, billions, a gathered copy at
stage 3, no ValueError; a stage-3 linear that autograd cannot see through, sums instead of
averaging, keeps its own rank's gradient, computes the wrong y, keeps the whole W for backward
(saved or on ctx), all-reduces instead of reduce-scattering, or forgets the padding; stage 3
without the second all-gather, no (N-1)/N, gradients' bytes for the all-gather, stage 0 without
the all-reduce's 2) are caught with a message that says so, and an answer that calls the library
is told it was switched off."""

import math

import pytest
import torch
import torch.distributed as dist

from dmlbook.advanced import zero
from dmlbook.exercises import ExerciseFailed
from dmlbook.exercises import zero as exercises


def unanswered(*args):
    raise NotImplementedError


# ---- 1. the largest model that fits -----------------------------------------------------------


def max_parameters(memory_bytes, world_size, stage, param_bytes, grad_bytes, state_bytes):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"no ZeRO stage {stage}")
    n = world_size
    per_parameter = (
        param_bytes / (n if stage == 3 else 1)
        + grad_bytes / (n if stage >= 2 else 1)
        + state_bytes / (n if stage >= 1 else 1)
    )
    return math.floor(memory_bytes / per_parameter)


def max_params_sharded_at_stage_2(memory, n, stage, p, g, k):
    """Stage 2 shards the parameters instead of the gradients."""
    if stage == 2:
        return math.floor(memory / (p / n + g + k / n))
    return max_parameters(memory, n, stage, p, g, k)


def max_params_ceil(memory, n, stage, p, g, k):
    return math.ceil(_per_parameter_inverse(memory, n, stage, p, g, k))


def _per_parameter_inverse(memory, n, stage, p, g, k):
    per = p / (n if stage == 3 else 1) + g / (n if stage >= 2 else 1) + k / (n if stage >= 1 else 1)
    return memory / per


def max_params_not_floored(memory, n, stage, p, g, k):
    return _per_parameter_inverse(memory, n, stage, p, g, k)


def max_params_mixed_always(memory, n, stage, p, g, k):
    return max_parameters(memory, n, stage, 2, 2, 12)


def max_params_stage_shifted(memory, n, stage, p, g, k):
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    return max_parameters(memory, n, min(stage + 1, 3), p, g, k)


def max_params_in_billions(memory, n, stage, p, g, k):
    return max_parameters(memory, n, stage, p, g, k) / 1e9


def max_params_gathered_copy(memory, n, stage, p, g, k):
    if stage == 3:
        return math.floor(memory / ((p + g + k) / n + p))
    return max_parameters(memory, n, stage, p, g, k)


def max_params_without_valueerror(memory, n, stage, p, g, k):
    return max_parameters(memory, n, min(max(stage, 0), 3), p, g, k)


def max_params_from_the_library(memory, n, stage, p, g, k):
    return math.floor(memory / sum(zero.paper_bytes(1, n, stage, k, p, g).values()))


def test_max_parameters_passes_right_answers():
    assert exercises.check_max_parameters(max_parameters).status == "passed"


def test_the_mixed_precision_cases_are_the_papers_formula():
    fits = [max_parameters(32 * 10**9, 64, s, 2, 2, 12) / 1e9 for s in range(4)]
    assert [round(x, 1) for x in fits] == [2.0, 7.6, 14.4, 128.0]


def test_unanswered_exercises_are_not_attempted():
    for check in (
        exercises.check_max_parameters,
        exercises.check_fsdp_linear,
        exercises.check_comm_bytes,
    ):
        assert check(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (max_params_sharded_at_stage_2, "stage 2 sharding the parameters"),
        (max_params_mixed_always, "the mixed-precision figure"),
        (max_params_stage_shifted, "next stage's figure"),
        (max_params_ceil, "rounded up"),
        (max_params_not_floored, "whole number"),
        (max_params_in_billions, "in billions"),
        (max_params_gathered_copy, "gathered copy"),
        (max_params_without_valueerror, "instead of raising ValueError"),
        (max_params_from_the_library, "called the library instead"),
    ],
)
def test_max_parameters_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_max_parameters(answer)


# ---- 2. a stage-3 linear -----------------------------------------------------------------------


def _gather(shard, out_features, in_features, group):
    full = shard.new_empty(shard.numel() * dist.get_world_size(group))
    dist.all_gather_single(full, shard.detach().contiguous(), group=group)
    return full[: out_features * in_features].view(out_features, in_features)


def _make_fsdp_linear(op=dist.ReduceOp.AVG, local_only=False, keep="shard", all_reduce=False):
    class GatheredLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, out_features, in_features, group):
            W = _gather(shard, out_features, in_features, group)
            if keep == "saved W":
                ctx.save_for_backward(x, shard, W)
            else:
                ctx.save_for_backward(x, shard)  # the shard, not the gathered weight
            if keep == "W on ctx":
                ctx.W = W
            ctx.sizes, ctx.group = (out_features, in_features), group
            return x @ W.T

        @staticmethod
        def backward(ctx, grad_y):
            x, shard, *kept = ctx.saved_tensors
            (out_features, in_features), group = ctx.sizes, ctx.group
            if keep == "shard":
                W = _gather(shard, out_features, in_features, group)  # gathered again
            else:
                W = kept[0] if kept else ctx.W
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            flat = shard.new_zeros(shard.numel() * world)
            flat[: out_features * in_features] = (grad_y.T @ x).reshape(-1)
            mine = slice(rank * shard.numel(), (rank + 1) * shard.numel())
            if local_only:
                grad_shard = flat[mine].clone()
            elif all_reduce:
                dist.all_reduce(flat, op=op, group=group)
                grad_shard = flat[mine].clone()
            else:
                grad_shard = torch.empty_like(shard)
                dist.reduce_scatter_single(grad_shard, flat, op=op, group=group)
            return grad_y @ W, grad_shard, None, None, None

    def fsdp_linear(x, weight_shard, out_features, in_features, group):
        return GatheredLinear.apply(x, weight_shard, out_features, in_features, group)

    return fsdp_linear


fsdp_linear = _make_fsdp_linear()
fsdp_linear_summing = _make_fsdp_linear(op=dist.ReduceOp.SUM)
fsdp_linear_local_gradient = _make_fsdp_linear(local_only=True)
fsdp_linear_saving_W = _make_fsdp_linear(keep="saved W")
fsdp_linear_W_on_ctx = _make_fsdp_linear(keep="W on ctx")
fsdp_linear_all_reduce = _make_fsdp_linear(all_reduce=True)


def fsdp_linear_unpadded(x, weight_shard, out_features, in_features, group):
    """Views the gathered buffer, padding and all, as W."""
    full = weight_shard.new_empty(weight_shard.numel() * dist.get_world_size(group))
    dist.all_gather_single(full, weight_shard.detach(), group=group)
    return x @ full.view(out_features, in_features).T


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
        (fsdp_linear_saving_W, "autograd kept a tensor of shape \\(4, 5\\)"),
        (fsdp_linear_W_on_ctx, "backward gathered nothing"),
        (fsdp_linear_all_reduce, "twice what a reduce-scatter sends"),
        (fsdp_linear_unpadded, "view only its first 20"),
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


def comm_stage0_without_factor_2(psi, world_size, stage, p, g):
    if stage == 0:
        return comm_bytes(psi, world_size, stage, p, g) / 2
    return comm_bytes(psi, world_size, stage, p, g)


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
        (comm_stage0_without_factor_2, "the all-reduce's factor 2"),
        (comm_from_the_library, "called the library instead"),
    ],
)
def test_comm_bytes_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_comm_bytes(answer)


DELEGATING_ANSWERS = {
    "max_parameters": max_params_from_the_library,
    "fsdp_linear": fsdp_linear_from_torch,
    "comm_bytes": comm_from_the_library,
}
