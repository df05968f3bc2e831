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
