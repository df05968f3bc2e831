"""Chapter 11's exercise checkers: right answers pass; planted bugs (ignoring the resume position,
dropping the tail, an off-by-one start, unbalanced parts, local_batch each in turn, the same part
on every rank; scaling by the world size, square-root scaling, floor instead of ceiling, the base
batch as global batch) are caught with a message that names the cause; an answer that calls the
library's own ``rank_batch``, ``balanced_blocks``, ``lr_for`` or ``linear_scaling`` is told to
write it (``DELEGATING_ANSWERS``, run by ``tests/test_exercise_back_doors.py``)."""

import math

import pytest

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
    "rescale": lambda base_lr, base_batch, local_batch, world_size, samples_left: (
        elastic.lr_for(world_size, base_lr=base_lr, base_batch=base_batch, local_batch=local_batch),
        local_batch * world_size,
        math.ceil(samples_left / (local_batch * world_size)),
    ),
}


def test_an_answer_that_only_splits_with_balanced_blocks_is_told_to_write_it():
    def answer(order, position, local_batch, rank, world_size):
        batch = order[position : position + local_batch * world_size]
        start, stop = balanced_blocks(len(batch), world_size)[rank]
        return list(batch[start:stop])

    with pytest.raises(ExerciseFailed, match="called the library instead.*balanced_blocks"):
        ch11.check_rank_batch(answer)


def test_an_answer_that_scales_with_linear_scaling_is_told_to_write_it():
    def answer(base_lr, base_batch, local_batch, world_size, samples_left):
        batch = local_batch * world_size
        return linear_scaling(base_lr, base_batch, batch), batch, math.ceil(samples_left / batch)

    with pytest.raises(ExerciseFailed, match="called the library instead.*linear_scaling"):
        ch11.check_rescale(answer)


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
    ],
)
def test_rank_batch_catches_bugs(bug, said):
    with pytest.raises(ExerciseFailed, match=said):
        ch11.check_rank_batch(bug)


# ---- 2. rescale ---------------------------------------------------------------------------------


def rescale(base_lr, base_batch, local_batch, world, left):
    global_batch = local_batch * world
    return base_lr * global_batch / base_batch, global_batch, math.ceil(left / global_batch)


def by_world(base_lr, base_batch, local_batch, world, left):
    lr, g, s = rescale(base_lr, base_batch, local_batch, world, left)
    return base_lr * world, g, s


def square_root(base_lr, base_batch, local_batch, world, left):
    lr, g, s = rescale(base_lr, base_batch, local_batch, world, left)
    return base_lr * math.sqrt(g / base_batch), g, s


def floor_steps(base_lr, base_batch, local_batch, world, left):
    lr, g, s = rescale(base_lr, base_batch, local_batch, world, left)
    return lr, g, left // g


def base_as_global(base_lr, base_batch, local_batch, world, left):
    return base_lr, base_batch, math.ceil(left / base_batch)


def test_rescale_passes_and_not_attempted():
    assert ch11.check_rescale(rescale).status == "passed"
    assert ch11.check_rescale(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "bug, said",
    [
        (by_world, "scales by the world size"),
        (square_root, "square-root"),
        (floor_steps, "shorter batch is a step"),
        (base_as_global, "global batch"),
    ],
)
def test_rescale_catches_bugs(bug, said):
    with pytest.raises(ExerciseFailed, match=said):
        ch11.check_rescale(bug)
