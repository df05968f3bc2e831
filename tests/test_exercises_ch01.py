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


# An answer for each exercise that only calls the library: tests/test_exercise_back_doors.py
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
        return base_lr * global_batch / base_batch * min(1.0, (step + 1) / warmup_steps)

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
