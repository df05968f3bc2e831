"""Chapter 9b's exercise checkers: right answers pass, an unanswered cell is "not attempted", and
planted bugs (mixed-precision bytes, one Adam moment, the wrong stage, no ValueError; floor
division that drops elements, a last shard holding the remainder, an off-by-one start,
numel // N + 1 as the ceiling; stage 3 without the second
all-gather, no (N-1)/N, elements instead of bytes) are caught with a message that says so."""

import pytest

from dmlbook.advanced import zero
from dmlbook.comm.groups import padded_block
from dmlbook.exercises import ExerciseFailed
from dmlbook.exercises import zero as exercises


def unanswered(*args):
    raise NotImplementedError


# ---- 1. bytes per rank -------------------------------------------------------------------------


def bytes_per_rank(psi, world_size, stage):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"no ZeRO stage {stage}")
    params = 4 * psi / (world_size if stage == 3 else 1)
    grads = 4 * psi / (world_size if stage >= 2 else 1)
    moments = 8 * psi / (world_size if stage >= 1 else 1)
    return params + grads + moments


def bytes_mixed_precision(psi, world_size, stage):
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    return sum(zero.paper_bytes(psi, world_size, stage).values())


def bytes_one_moment(psi, world_size, stage):
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    n = world_size
    return (
        4 * psi / (n if stage == 3 else 1)
        + 4 * psi / (n if stage >= 2 else 1)
        + 4 * psi / (n if stage >= 1 else 1)
    )


def bytes_stage_shifted(psi, world_size, stage):
    """Stage 1 already shards the gradients: every stage one step ahead."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    return bytes_per_rank(psi, world_size, min(stage + 1, 3))


def bytes_without_valueerror(psi, world_size, stage):
    return bytes_per_rank(psi, world_size, min(max(stage, 0), 3))


def test_bytes_per_rank_passes_right_answers():
    assert exercises.check_bytes_per_rank(bytes_per_rank).status == "passed"


def test_unanswered_exercises_are_not_attempted():
    for check in (
        exercises.check_bytes_per_rank,
        exercises.check_shard_range,
        exercises.check_comm_bytes,
    ):
        assert check(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (bytes_mixed_precision, "mixed-precision"),
        (bytes_one_moment, "one moment"),
        (bytes_stage_shifted, "next stage's figure"),
        (bytes_without_valueerror, "instead of raising ValueError"),
    ],
)
def test_bytes_per_rank_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_bytes_per_rank(answer)


# ---- 2. shard range ----------------------------------------------------------------------------


def shard_range(numel, world_size, rank):
    size = -(-numel // world_size)
    return rank * size, (rank + 1) * size


def shard_range_floor(numel, world_size, rank):
    size = numel // world_size
    return rank * size, (rank + 1) * size


def shard_range_last_takes_the_rest(numel, world_size, rank):
    size = numel // world_size
    return rank * size, numel if rank == world_size - 1 else (rank + 1) * size


def shard_range_off_by_one(numel, world_size, rank):
    size = -(-numel // world_size)
    return rank * size + 1, (rank + 1) * size + 1


def shard_range_plus_one(numel, world_size, rank):  # "ceil" as numel // world_size + 1
    size = numel // world_size + 1
    return rank * size, (rank + 1) * size


def test_shard_range_passes_right_answers():
    assert exercises.check_shard_range(shard_range).status == "passed"
    assert (
        exercises.check_shard_range(
            lambda numel, world_size, rank: padded_block(numel, rank=rank, world_size=world_size)
        ).status
        == "passed"
    )


@pytest.mark.parametrize(
    "answer, message",
    [
        (shard_range_floor, "belong to no rank"),
        (shard_range_last_takes_the_rest, "need equal shards"),
        (shard_range_off_by_one, "rank 0's shard starts at 1"),
        (shard_range_plus_one, "numel // world_size \\+ 1 is not the ceiling"),
    ],
)
def test_shard_range_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_shard_range(answer)


# ---- 3. communication bytes --------------------------------------------------------------------


def comm_bytes(psi, world_size, stage):
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * 4 * psi


def comm_stage3_like_the_others(psi, world_size, stage):
    return 2 * (world_size - 1) / world_size * 4 * psi


def comm_without_ring_factor(psi, world_size, stage):
    return (3 if stage == 3 else 2) * 4 * psi


def comm_elements(psi, world_size, stage):
    return comm_bytes(psi, world_size, stage) / 4


def test_comm_bytes_passes_right_answers():
    assert exercises.check_comm_bytes(comm_bytes).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (comm_stage3_like_the_others, "gathers each layer twice"),
        (comm_without_ring_factor, r"without the ring's \(N-1\)/N"),
        (comm_elements, "not bytes"),
    ],
)
def test_comm_bytes_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_comm_bytes(answer)
