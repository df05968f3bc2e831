"""Chapter 2's exercise checkers: ring answers pass; planted bugs (an off-by-one chunk index, a
missing step, a non-ring pattern, a built-in collective) fail with a message that says so."""

import functools

import pytest
import torch
import torch.distributed as dist

from dmlbook.comm import collectives
from dmlbook.exercises import ExerciseFailed, ch02


def unanswered(*args):
    raise NotImplementedError


def without_shape_check(collective):
    """dmlbook's own collective, minus its shape check (an extra round the checker would count)."""
    return functools.partial(collective, check=False)


# --------------------------------------------------------------------------- all-gather answers


def ring_all_gather(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        send = tensor_list[(rank - step) % world]
        recv = tensor_list[(rank - step - 1) % world]
        request = dist.isend(send, (rank + 1) % world)
        dist.recv(recv, (rank - 1) % world)
        request.wait()


def all_gather_off_by_one(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        send = tensor_list[(rank - step) % world]
        recv = tensor_list[(rank - step) % world]  # planted: should be rank - step - 1
        request = dist.isend(send.clone(), (rank + 1) % world)
        dist.recv(recv, (rank - 1) % world)
        request.wait()


def all_gather_missing_step(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    for step in range(world - 2):  # planted: one step short
        request = dist.isend(tensor_list[(rank - step) % world], (rank + 1) % world)
        dist.recv(tensor_list[(rank - step - 1) % world], (rank - 1) % world)
        request.wait()


def all_gather_everyone_to_everyone(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    requests = [dist.isend(tensor, r) for r in range(world) if r != rank]
    for r in range(world):
        if r != rank:
            dist.recv(tensor_list[r], r)
    for request in requests:
        request.wait()


def all_gather_builtin(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)


def test_ring_all_gather_passes_the_ring_and_dmlbook_own(capsys):
    assert ch02.check_ring_all_gather(ring_all_gather).status == "passed"
    assert (
        ch02.check_ring_all_gather(without_shape_check(collectives.all_gather)).status == "passed"
    )
    assert "Exercise 'ring_all_gather' passed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "answer, message",
    [
        (
            all_gather_off_by_one,
            r"tensor_list\[0\] should hold rank 0's(.|\n)*"
            r"ran world_size - 1 = 1 steps, so none is missing(.|\n)*off by one",
        ),
        (all_gather_missing_step, "does the loop run world_size - 1 steps \\(1 here\\)"),
        (all_gather_everyone_to_everyone, "not a ring: at world size 3 rank 0 sent to ranks"),
        (all_gather_builtin, "dist.all_gather is switched off"),
    ],
)
def test_ring_all_gather_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch02.check_ring_all_gather(answer)


# --------------------------------------------------------------------------- reduce-scatter answers


def ring_reduce_scatter(output, input_list):
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(output)
    for step in range(world - 1):
        chunk = (rank - step - 1) % world
        request = dist.isend(input_list[chunk], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        input_list[(rank - step - 2) % world] += incoming
    output.copy_(input_list[rank])


def reduce_scatter_off_by_one(output, input_list):
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(output)
    for step in range(world - 1):
        chunk = (rank - step) % world  # planted: should be rank - step - 1
        request = dist.isend(input_list[chunk], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        input_list[(rank - step - 1) % world] += incoming
    output.copy_(input_list[(rank + 1) % world])


def reduce_scatter_missing_step(output, input_list):
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(output)
    for step in range(world - 2):  # planted: one step short
        request = dist.isend(input_list[(rank - step - 1) % world], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        input_list[(rank - step - 2) % world] += incoming
    output.copy_(input_list[rank])


def reduce_scatter_adds_into_sent_chunk(output, input_list):
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(output)
    for step in range(world - 1):
        request = dist.isend(input_list[(rank - step - 1) % world].clone(), (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        input_list[(rank - step - 1) % world] += incoming  # planted: should be rank - step - 2
    output.copy_(input_list[rank])


def test_ring_reduce_scatter_passes_the_ring_and_dmlbook_own():
    assert ch02.check_ring_reduce_scatter(ring_reduce_scatter).status == "passed"
    assert (
        ch02.check_ring_reduce_scatter(without_shape_check(collectives.reduce_scatter)).status
        == "passed"
    )


@pytest.mark.parametrize(
    "answer, message",
    [
        (
            reduce_scatter_off_by_one,
            "full sum of chunk 1. Rank r should end with chunk r; a chunk index is off by one",
        ),
        (
            reduce_scatter_adds_into_sent_chunk,
            "although your loop ran world_size - 1 = 1 steps. A chunk index is off by one",
        ),
        (reduce_scatter_missing_step, "sums only 1 of the 2 ranks' chunks"),
    ],
)
def test_ring_reduce_scatter_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch02.check_ring_reduce_scatter(answer)


def test_unanswered_exercises_are_not_attempted(capsys):
    assert ch02.check_ring_all_gather(unanswered).status == "not attempted"
    assert ch02.check_ring_reduce_scatter(unanswered).status == "not attempted"
    assert capsys.readouterr().out.count("not attempted yet") == 2
