"""Chapter 11's exercise checkers: right answers pass; planted bugs (ignoring the resume position,
dropping the tail, an off-by-one start, unbalanced parts, local_batch each in turn, the same part
on every rank, padding by repetition, positions for samples, a position counted in batches;
steps counted in the new batch, no epoch wrap, a floor per epoch, the lr unchanged, scaled by the
world ratio, upside down, by the square root or by the local batch, floor or float steps, a whole
epoch left) are caught with a message that names the cause; an answer that calls the library's
own ``rank_batch``, ``balanced_blocks``, ``numpy.array_split``, ``torch.tensor_split``,
``lr_for``, ``linear_scaling`` or ``elastic_batches`` is told to write it
(``DELEGATING_ANSWERS``, run by ``test_back_doors.py``)."""

import math

import numpy as np
import pytest
import torch

from dmlbook.advanced import elastic
from dmlbook.comm.groups import balanced_blocks  # as a notebook imports them: at the top
from dmlbook.data_parallel import linear_scaling
from dmlbook.exercises import ExerciseFailed, ch11


def unanswered(*args):
    raise NotImplementedError


# ---- answers that only call the library: each must be told to write the mechanism ----------------

DELEGATING_ANSWERS = {
    "rank_batch": lambda order, position, local_batch, rank, world_size: elastic.rank_batch(
        order, position, local_batch, rank, world_size
    ),
    "resume_plan": lambda *args: plan_by_walking(*args),  # walks elastic_batches, calls lr_for
}


def plan_by_walking(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
    """Only library calls: walk elastic_batches for ``step`` steps, rescale with lr_for."""
    batches = elastic.elastic_batches(epoch_size, seed=0, local_batch=local_batch, rank=0,
                                      world_size=old_world, epochs=step + 1)  # fmt: skip
    for _ in range(step):
        batch = next(batches)
    epoch = 0 if step == 0 else batch.epoch + batch.last_in_epoch
    position = 0 if step == 0 else elastic.position_after(batch)
    lr = elastic.lr_for(new_world, base_lr=base_lr, base_batch=base_batch, local_batch=local_batch)
    return epoch, position, lr, math.ceil((epoch_size - position) / (local_batch * new_world))


def test_an_answer_that_splits_with_numpy_or_torch_is_told_to_write_it():
    def with_numpy(order, position, local_batch, rank, world_size):
        batch = order[position : position + local_batch * world_size]
        return [int(i) for i in np.array_split(np.array(batch), world_size)[rank]]

    def with_torch(order, position, local_batch, rank, world_size):
        batch = torch.tensor(order[position : position + local_batch * world_size])
        return torch.tensor_split(batch, world_size)[rank].tolist()

    with pytest.raises(ExerciseFailed, match="called the library instead.*array_split"):
        ch11.check_rank_batch(with_numpy)
    with pytest.raises(ExerciseFailed, match="called the library instead.*tensor_split"):
        ch11.check_rank_batch(with_torch)


def test_an_answer_that_only_splits_with_balanced_blocks_is_told_to_write_it():
    def answer(order, position, local_batch, rank, world_size):
        batch = order[position : position + local_batch * world_size]
        start, stop = balanced_blocks(len(batch), world_size)[rank]
        return list(batch[start:stop])

    with pytest.raises(ExerciseFailed, match="called the library instead.*balanced_blocks"):
        ch11.check_rank_batch(answer)


def test_an_answer_that_scales_with_linear_scaling_is_told_to_write_it():
    def answer(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
        epoch, position, _, steps = resume_plan(*locals().values())
        return epoch, position, linear_scaling(base_lr, base_batch, local_batch * new_world), steps

    with pytest.raises(ExerciseFailed, match="called the library instead.*linear_scaling"):
        ch11.check_resume_plan(answer)


def test_the_walking_answer_is_right_with_the_library_on():
    for case in [(20, 2, 1, 16, 1438, 0.1, 32), (45, 2, 1, 16, 1438, 0.1, 32),
                 (7, 3, 4, 4, 37, 0.05, 12), (9, 4, 2, 5, 60, 0.2, 40)]:  # fmt: skip
        assert plan_by_walking(*case) == pytest.approx(resume_plan(*case))


# ---- 1. rank_batch ------------------------------------------------------------------------------


def strided(order, position, local_batch, rank, world):
    return list(order[position : position + local_batch * world][rank::world])


def blocks(order, position, local_batch, rank, world):  # contiguous parts, the first ones longer
    batch = order[position : position + local_batch * world]
    base, extra = divmod(len(batch), world)
    start = rank * base + min(rank, extra)
    return list(batch[start : start + base + (rank < extra)])


def from_zero(order, position, local_batch, rank, world):  # forgets where the epoch stopped
    return blocks(order, 0, local_batch, rank, world)


def floor_split(order, position, local_batch, rank, world):  # drops the short batch's tail
    batch = order[position : position + local_batch * world]
    size = len(batch) // world
    return list(batch[rank * size : (rank + 1) * size])


def off_by_one(order, position, local_batch, rank, world):
    return blocks(order, min(position + 1, len(order) - 1), local_batch, rank, world)


def lopsided(order, position, local_batch, rank, world):  # the last rank takes the remainder
    batch = order[position : position + local_batch * world]
    size = len(batch) // world
    end = len(batch) if rank == world - 1 else (rank + 1) * size
    return list(batch[rank * size : end])


def in_turn(order, position, local_batch, rank, world):  # local_batch each, even at the end
    start = position + rank * local_batch
    return list(order[start : start + local_batch])


def same_part(order, position, local_batch, rank, world):  # every rank takes rank 0's part
    return blocks(order, position, local_batch, 0, world)


def padded(order, position, local_batch, rank, world):  # DistributedSampler's way: pad, stride
    batch = list(order[position : position + local_batch * world])
    batch += batch[: -len(batch) % world]
    return batch[rank::world]


def positions(order, position, local_batch, rank, world):  # positions, not the samples there
    return blocks(list(range(len(order))), position, local_batch, rank, world)


def in_batches(order, position, local_batch, rank, world):  # position read as a batch count
    span = local_batch * world
    return blocks(order[position * span - position :], position, local_batch, rank, world)


@pytest.mark.parametrize("right", [blocks, strided])
def test_rank_batch_passes_right_answers(right):
    assert ch11.check_rank_batch(right).status == "passed"


def test_the_library_gives_the_answer_the_checker_wants():
    order = elastic.epoch_order(37, seed=3, epoch=1)
    for world in (1, 2, 3, 4):
        for position in (0, 10, 33, 35):
            for rank in range(world):
                got = elastic.rank_batch(order, position, 4, rank, world)
                assert got == blocks(order, position, 4, rank, world)


def test_rank_batch_not_attempted():
    assert ch11.check_rank_batch(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "bug, said",
    [
        (from_zero, "come before position"),
        (floor_split, "no rank took them"),
        (off_by_one, "come after this global batch"),
        (lopsided, "sizes"),
        (in_turn, "local_batch each in turn"),
        (same_part, "each rank's part must depend on rank"),
        (padded, "padding"),
        (positions, "positions in the order, not samples"),
        (in_batches, "position counts samples, not batches"),
    ],
)
def test_rank_batch_catches_bugs(bug, said):
    with pytest.raises(ExerciseFailed, match=said):
        ch11.check_rank_batch(bug)


# ---- 2. resume_plan -----------------------------------------------------------------------------


def resume_plan(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
    old, new = local_batch * old_world, local_batch * new_world
    epoch, done = divmod(step, math.ceil(epoch_size / old))
    position = done * old
    return epoch, position, base_lr * new / base_batch, math.ceil((epoch_size - position) / new)


def changed(index, value_of):
    """``resume_plan`` with its answer's ``index``-th value replaced by ``value_of(args, plan)``."""

    def bug(*args):
        plan = list(resume_plan(*args))
        plan[index] = value_of(args, plan)
        return tuple(plan)

    return bug


def new_world_steps(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
    _, _, lr, _ = resume_plan(step, old_world, new_world, local_batch, epoch_size, base_lr,
                              base_batch)  # fmt: skip
    position = step * local_batch * new_world  # the chapter's "batch 20 would be sample 320"
    return 0, position, lr, math.ceil((epoch_size - position) / (local_batch * new_world))


def no_wrap(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
    plan = resume_plan(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch)
    return 0, step * local_batch * old_world, plan[2], plan[3]


def floor_epoch(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
    old = local_batch * old_world
    epoch, done = divmod(step, epoch_size // old)
    plan = resume_plan(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch)
    return epoch, done * old, plan[2], plan[3]


LR_BUGS = {
    "base_lr unchanged": lambda a, p: a[5],
    "new_world / old_world": lambda a, p: a[5] * a[2] / a[1],
    "upside down": lambda a, p: a[5] * a[6] / (a[3] * a[2]),
    "square-root": lambda a, p: a[5] * math.sqrt(a[3] * a[2] / a[6]),
    "scales by the local batch": lambda a, p: a[5] * a[3] / a[6],
}


def test_resume_plan_passes_and_not_attempted():
    assert ch11.check_resume_plan(resume_plan).status == "passed"
    assert ch11.check_resume_plan(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "bug, said",
    [
        (new_world_steps, "counted the steps in the new world's batches"),
        (no_wrap, "within one epoch"),
        (floor_epoch, "a ceiling, not a floor"),
        (changed(3, lambda a, p: (a[4] - p[1]) // (a[3] * a[2])), "shorter batch is a step"),
        (changed(3, lambda a, p: p[3] * 1.0), "whole number"),
        (changed(3, lambda a, p: math.ceil(a[4] / (a[3] * a[2]))), "a whole epoch"),
        (lambda *a: resume_plan(*a)[:3], "return the tuple"),
        *[(changed(2, f), said) for said, f in LR_BUGS.items()],
    ],
)
def test_resume_plan_catches_bugs(bug, said):
    with pytest.raises(ExerciseFailed, match=said):
        ch11.check_resume_plan(bug)
