"""Chapter 2's exercise checkers: a ring all-gather and binomial-tree broadcasts pass; planted bugs
(an off-by-one chunk index, a missing step, the own entry never filled, blocking sends first, a
non-ring pattern, entries replaced instead of filled, a forged result, a broadcast from the root
alone or down a chain, a tree rooted at rank 0 or sending past the last rank, a built-in
collective or another one standing in for it) fail with a message that names the cause."""

import pytest
import torch
import torch.distributed as dist

from dmlbook.comm import collectives
from dmlbook.exercises import ExerciseFailed, ch02


def unanswered(*args):
    raise NotImplementedError


# Answers that only call the library (test_back_doors.py): each must be refused.
DELEGATING_ANSWERS = {
    "ring_all_gather": lambda tensor_list, tensor: collectives.all_gather(tensor_list, tensor),
    "tree_broadcast": lambda tensor, src: collectives.broadcast(tensor, src),
}


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


def all_gather_without_own_entry(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    # planted: tensor_list[rank] is never filled with tensor
    for step in range(world - 1):
        request = dist.isend(tensor_list[(rank - step) % world], (rank + 1) % world)
        dist.recv(tensor_list[(rank - step - 1) % world], (rank - 1) % world)
        request.wait()


def all_gather_blocking_send_first(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        dist.send(tensor_list[(rank - step) % world], (rank + 1) % world)  # planted: blocks
        dist.recv(tensor_list[(rank - step - 1) % world], (rank - 1) % world)


def all_gather_replacing_entries(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank] = tensor.clone()  # planted: a new tensor, not the one given
    for step in range(world - 1):
        incoming = torch.empty_like(tensor)
        request = dist.isend(tensor_list[(rank - step) % world], (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        tensor_list[(rank - step - 1) % world] = incoming


def all_gather_not_stored(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    incoming = torch.empty_like(tensor)
    outgoing = tensor.clone()
    for _ in range(world - 1):
        request = dist.isend(outgoing, (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        outgoing = incoming.clone()  # planted: never copied into tensor_list


def all_gather_forged(tensor_list, tensor):
    """The forgery a learner found when the inputs were fixed: the values written from a
    formula, and p - 1 messages of zeros to the right for the pattern."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for j, out in enumerate(tensor_list):
        out.copy_(j + 0.5 + 0.0 * tensor)
    zeros = torch.zeros_like(tensor)
    for _ in range(world - 1):
        request = dist.isend(zeros, (rank + 1) % world)
        dist.recv(torch.empty_like(tensor), (rank - 1) % world)
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


def all_gather_by_all_reduce(tensor_list, tensor):
    """A back door through another collective: each rank fills its own slot, the rest zeros."""
    rank = dist.get_rank()
    flat = torch.zeros(len(tensor_list), *tensor.shape)
    flat[rank] = tensor
    dist.all_reduce(flat)
    for out, got in zip(tensor_list, flat, strict=True):
        out.copy_(got)


def test_a_deadlock_is_reported_soon():
    """A right answer finishes in about a second: the checks wait 8 s, not the launcher's 60."""
    assert ch02.TIMEOUT <= 10


def test_ring_all_gather_passes_the_ring(capsys):
    assert ch02.check_ring_all_gather(ring_all_gather).status == "passed"
    assert "Exercise 'ring_all_gather' passed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "answer, message",
    [
        (
            all_gather_off_by_one,
            r"tensor_list\[0\] should hold rank 0's(.|\n)*"
            r"rank 1's tensor(.|\n)*landed in the wrong entry: an index is off by one",
        ),
        (all_gather_missing_step, "does the loop run world_size - 1 steps \\(1 here\\)"),
        (
            all_gather_without_own_entry,
            r"tensor_list\[0\](.|\n)*own entry tensor_list\[rank\] was never filled",
        ),
        (all_gather_blocking_send_first, r"ranks \[0, 1\] all wait in a blocking dist.send"),
        (all_gather_replacing_entries, "holds other tensors than the ones it was given"),
        (all_gather_not_stored, r"tensor did arrive, at step 0, but never reached tensor_list"),
        (
            all_gather_forged,
            r"should hold rank 0's tensor .* but holds \[0.5(.|\n)*holds something else",
        ),
        (all_gather_everyone_to_everyone, "not a ring: at world size 3 rank 0 sent to ranks"),
        (all_gather_builtin, "called the library instead: torch.distributed.all_gather is"),
        (all_gather_by_all_reduce, "called the library instead: .*all_reduce is switched off"),
    ],
)
def test_ring_all_gather_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch02.check_ring_all_gather(answer)


# --------------------------------------------------------------------------- broadcast answers


def tree_broadcast(tensor, src):
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank - src) % world  # rank relative to the root
    mask = 1
    while mask < world:  # receive once, from the rank `mask` below
        if me & mask:
            dist.recv(tensor, (me - mask + src) % world)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # then send on, farthest first
        if me + mask < world:
            dist.send(tensor, (me + mask + src) % world)
        mask >>= 1


def doubling_broadcast(tensor, src):
    """Another binomial tree: in round k the first 2^k relative ranks send to those 2^k above."""
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank - src) % world
    span = 1
    while span < world:
        if me < span and me + span < world:
            dist.send(tensor, (me + span + src) % world)
        elif span <= me < 2 * span:
            dist.recv(tensor, (me - span + src) % world)
        span *= 2


def broadcast_from_the_root(tensor, src):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == src:
        for r in range(world):
            if r != src:
                dist.send(tensor, r)
    else:
        dist.recv(tensor, src)


def broadcast_chain(tensor, src):
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank - src) % world
    if me > 0:
        dist.recv(tensor, (rank - 1) % world)
    if me < world - 1:
        dist.send(tensor, (rank + 1) % world)


def broadcast_rooted_at_zero(tensor, src):
    """Planted: the tree hangs from rank 0 whatever src is."""
    tree_broadcast(tensor, 0)


def broadcast_past_the_last_rank(tensor, src):
    """Planted: no me + mask < world guard, so a send wraps round to a rank that is done."""
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (rank - src) % world
    mask = 1
    while mask < world:
        if me & mask:
            dist.recv(tensor, (me - mask + src) % world)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        dist.send(tensor, (me + mask + src) % world)
        mask >>= 1


def broadcast_builtin(tensor, src):
    dist.broadcast(tensor, src)


def broadcast_by_all_reduce(tensor, src):
    """A back door through another collective: everyone but the root adds zeros."""
    if dist.get_rank() != src:
        tensor.zero_()
    collectives.all_reduce(tensor)


def test_tree_broadcast_passes_both_binomial_trees():
    assert ch02.check_tree_broadcast(tree_broadcast).status == "passed"
    assert ch02.check_tree_broadcast(doubling_broadcast).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (broadcast_from_the_root, "not a tree: .*round 3.*the root sends to every rank itself"),
        (broadcast_chain, "not a tree: .*round 3.*a chain"),
        (broadcast_rooted_at_zero, "holds .*rank 0's.*Your tree is rooted at rank 0"),
        (
            broadcast_past_the_last_rank,
            r"on 3 ranks .* after \d+ s: rank 2 waits in dist.send to rank 0, which never "
            r"receives from it \(rank 0 has returned\)(.|\n)*can be world_size or more",
        ),
        (broadcast_builtin, "called the library instead: torch.distributed.broadcast is switched"),
        (broadcast_by_all_reduce, "called the library instead: .*all_reduce is switched off"),
    ],
)
def test_tree_broadcast_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch02.check_tree_broadcast(answer)


def test_unanswered_exercises_are_not_attempted(capsys):
    assert ch02.check_ring_all_gather(unanswered).status == "not attempted"
    assert ch02.check_tree_broadcast(unanswered).status == "not attempted"
    assert capsys.readouterr().out.count("not attempted yet") == 2
