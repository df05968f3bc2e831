"""Chapter 11's exercise checkers: right answers pass; planted bugs (ignoring the resume position,
dropping the tail, an off-by-one start, unbalanced parts, local_batch each in turn, the same part
on every rank; scaling by the world size, square-root scaling, floor instead of ceiling, the base
batch as global batch) are caught with a message that names the cause."""

import math

import pytest

from dmlbook.advanced import elastic
from dmlbook.exercises import ExerciseFailed, ch11


def unanswered(*args):
    raise NotImplementedError


# ---- 1. rank_batch ------------------------------------------------------------------------------


def strided(order, position, local_batch, rank, world):
    return list(order[position : position + local_batch * world][rank::world])


def from_zero(order, position, local_batch, rank, world):  # forgets where the epoch stopped
    return elastic.rank_batch(order, 0, local_batch, rank, world)


def floor_split(order, position, local_batch, rank, world):  # drops the short batch's tail
    batch = order[position : position + local_batch * world]
    size = len(batch) // world
    return list(batch[rank * size : (rank + 1) * size])


def off_by_one(order, position, local_batch, rank, world):
    return elastic.rank_batch(order, min(position + 1, len(order) - 1), local_batch, rank, world)


def lopsided(order, position, local_batch, rank, world):  # the last rank takes the remainder
    batch = order[position : position + local_batch * world]
    size = len(batch) // world
    end = len(batch) if rank == world - 1 else (rank + 1) * size
    return list(batch[rank * size : end])


def in_turn(order, position, local_batch, rank, world):  # local_batch each, even at the end
    start = position + rank * local_batch
    return list(order[start : start + local_batch])


def same_part(order, position, local_batch, rank, world):  # every rank takes rank 0's part
    return elastic.rank_batch(order, position, local_batch, 0, world)


@pytest.mark.parametrize("right", [elastic.rank_batch, strided])
def test_rank_batch_passes_right_answers(right):
    assert ch11.check_rank_batch(right).status == "passed"


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
