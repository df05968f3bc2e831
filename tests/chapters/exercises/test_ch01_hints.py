"""Chapter 1's exercise hints name the cause: each planted bug gets the hint that fits it."""

import math

import pytest

from dmlbook.exercises import ExerciseFailed, ch01


def shard_blocks(length, rank, world_size):
    per_rank = -(-length // world_size)
    padded = [i % length for i in range(per_rank * world_size)]
    return padded[rank * per_rank : (rank + 1) * per_rank]  # planted: a block, not a stride


def shard_unpadded(length, rank, world_size):
    return list(range(length))[rank::world_size]  # planted: no padding


def shard_repeats_last(length, rank, world_size):
    per_rank = -(-length // world_size)
    padded = list(range(length)) + [length - 1] * (per_rank * world_size - length)  # planted
    return padded[rank::world_size]


@pytest.mark.parametrize(
    "answer, hint",
    [
        (shard_blocks, "That is a contiguous block. DistributedSampler deals the indices"),
        (shard_unpadded, r"Every rank must get ceil\(length / world_size\) = 1 indices: pad"),
        (shard_repeats_last, "not by repeating the last index"),
    ],
)
def test_shard_hints_name_the_cause(answer, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        ch01.check_shard(answer)


def lr_late(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * global_batch / base_batch * min(1.0, step / warmup_steps)  # planted: step


def lr_no_warmup(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * global_batch / base_batch  # planted: no ramp


def lr_unscaled(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * min(1.0, (step + 1) / warmup_steps)  # planted: no linear scaling


def lr_sqrt(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * math.sqrt(global_batch / base_batch) * min(1.0, (step + 1) / warmup_steps)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lr_late, "Your warm-up is one step late"),
        (lr_no_warmup, "That is the peak rate already"),
        (lr_unscaled, "That ramps up to base_lr; the peak is base_lr x global_batch / base_batch"),
        (lr_sqrt, "That scales by the square root of the batch ratio"),
    ],
)
def test_lr_schedule_hints_name_the_cause(answer, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        ch01.check_lr_schedule(answer)


# An answer for each exercise that only calls the library: test_back_doors.py
# checks that each is rejected, because the functions that do the job are switched off.
def _delegate_shard(length, rank, world_size):
    from dmlbook.datasets import shard_indices

    return shard_indices(length, rank, world_size, shuffle=False)


def _delegate_lr(step, base_lr, base_batch, global_batch, warmup_steps):
    from dmlbook import data_parallel as dp

    return dp.warmup(dp.linear_scaling(base_lr, base_batch, global_batch), warmup_steps)(step)


def _delegate_average_gradients(model):
    from dmlbook import data_parallel as dp

    dp.average_gradients(model)


DELEGATING_ANSWERS = {
    "shard": _delegate_shard,
    "lr_schedule": _delegate_lr,
    "average_gradients": _delegate_average_gradients,
}


def _lr_by_torch_scheduler(step, base_lr, base_batch, global_batch, warmup_steps):
    import torch

    opt = torch.optim.SGD(
        [torch.zeros(1, requires_grad=True)], lr=base_lr * global_batch / base_batch
    )
    ramp = torch.optim.lr_scheduler.LinearLR(opt, 1 / warmup_steps, 1.0, max(1, warmup_steps - 1))
    for _ in range(step):
        ramp.step()
    return opt.param_groups[0]["lr"]


def _average_per_parameter(model):
    from dmlbook import data_parallel as dp

    dp.average_gradients_per_parameter(model)


@pytest.mark.parametrize(
    "check, answer",
    [
        (ch01.check_lr_schedule, _lr_by_torch_scheduler),
        (ch01.check_average_gradients, _average_per_parameter),
    ],
)
def test_other_library_answers_are_rejected_too(check, answer):
    with pytest.raises(ExerciseFailed, match="called the library instead.*switched off"):
        check(answer)


def test_the_right_answers_pass_with_the_library_switched_off():
    def shard(length, rank, world_size):
        per_rank = -(-length // world_size)
        return [i % length for i in range(per_rank * world_size)][rank::world_size]

    def lr(step, base_lr, base_batch, global_batch, warmup_steps):
        ramp = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        return base_lr * global_batch / base_batch * ramp

    assert ch01.check_shard(shard).status == "passed"
    assert ch01.check_lr_schedule(lr).status == "passed"


def test_train_config_asks_for_the_rule_that_exercise_2_writes():
    """Chapter 1's sweep asks dp.train for the linear rule and warm-up through TrainConfig (so
    that no cell before exercise 2 calls the answer): the rates it used are the rule's."""
    import torch

    from dmlbook import data_parallel as dp
    from dmlbook import models

    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    config = dp.TrainConfig(global_batch=32, lr=0.1, base_batch=16, warmup_steps=3, epochs=2)
    history = dp.train(models.mlp(seed=0), x, y, config)
    rule = dp.warmup(dp.linear_scaling(0.1, 16, 32), 3)
    assert history.lr == [rule(step) for step in range(len(history.lr))]
    scaled_only = dp.TrainConfig(global_batch=32, lr=0.1, base_batch=16)
    assert dp.train(models.mlp(seed=0), x, y, scaled_only).lr == [0.2] * 4
    with pytest.raises(ValueError, match="scale a number lr"):
        dp.train(models.mlp(seed=0), x, y, dp.TrainConfig(32, lr=rule, base_batch=16))


def shard_shifted(length, rank, world_size):
    per_rank = -(-length // world_size)
    padded = [i % length for i in range((per_rank + 1) * world_size)]
    return padded[rank + 1 :: world_size][:per_rank]  # planted: ranks counted from 1


def test_shard_shifted_start_is_named():
    with pytest.raises(ExerciseFailed, match="right stride from the wrong start"):
        ch01.check_shard(shard_shifted)


def _ramp(step, warmup_steps):
    return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)


def lr_right(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * global_batch / base_batch * _ramp(step, warmup_steps)


def lr_divides_by_zero(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * global_batch / base_batch * min(1.0, (step + 1) / warmup_steps)


def lr_goyal(step, base_lr, base_batch, global_batch, warmup_steps):
    peak = base_lr * global_batch / base_batch
    return base_lr + (peak - base_lr) * _ramp(step, warmup_steps)  # planted: from base_lr


def lr_inverted(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * base_batch / global_batch * _ramp(step, warmup_steps)


def lr_past_peak(step, base_lr, base_batch, global_batch, warmup_steps):
    ramp = 1.0 if warmup_steps == 0 else (step + 1) / warmup_steps  # planted: no min(1, ...)
    return base_lr * global_batch / base_batch * ramp


def lr_integer_ratio(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * (global_batch // base_batch) * _ramp(step, warmup_steps)


def lr_zero_without_warmup(step, base_lr, base_batch, global_batch, warmup_steps):
    return (
        0.0
        if warmup_steps == 0
        else lr_right(step, base_lr, base_batch, global_batch, warmup_steps)
    )


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lr_divides_by_zero, "warmup_steps=0 means no warm-up"),
        (lr_goyal, "Goyal et al.'s warm-up, which ramps from base_lr"),
        (lr_inverted, "The batch ratio is upside down"),
        (lr_past_peak, "Your ramp goes on past the peak"),
        (lr_integer_ratio, "You used integer division"),
        (lr_zero_without_warmup, "Right with warm-up, wrong without"),
    ],
)
def test_more_lr_schedule_hints_name_the_cause(answer, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        ch01.check_lr_schedule(answer)


def test_the_right_lr_passes_with_no_warmup_too():
    result = ch01.check_lr_schedule(lr_right)
    assert result.status == "passed" and "warmup_steps=0" in result.message


def grads_right(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def grads_of_parameters(model):
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():  # planted: the parameters, not the gradients
            dist.all_reduce(p)
            p /= dist.get_world_size()


def grads_of_a_copy(model):
    import torch.distributed as dist

    for p in model.parameters():
        g = p.grad.clone()  # planted: all-reduce works in place, on the copy
        dist.all_reduce(g)
        g /= dist.get_world_size()


def grads_max(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)  # planted
        p.grad /= dist.get_world_size()


def grads_reduce(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.reduce(p.grad, dst=0)  # planted: only rank 0 gets the sum
        p.grad /= dist.get_world_size()


def grads_rank0_only(model):
    import torch.distributed as dist

    if dist.get_rank() == 0:  # planted: the other ranks never join the collective
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@pytest.mark.parametrize(
    "answer, hint",
    [
        (grads_of_parameters, r"all-reduced the parameters \(p\), not their gradients"),
        (grads_of_a_copy, "works in place on the very tensor you pass"),
        (grads_max, "op=MAX, which does not add the tensors up"),
        (grads_reduce, "dist.reduce, which leaves the sum on one rank"),
        (grads_rank0_only, "Every rank must make the collective call|still running on ranks"),
    ],
)
def test_average_gradients_hints_name_the_cause(answer, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        ch01.check_average_gradients(answer, timeout=30)


def test_the_right_average_passes():
    assert ch01.check_average_gradients(grads_right).status == "passed"
