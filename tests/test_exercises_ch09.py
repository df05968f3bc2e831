"""Chapter 9's exercise checkers: right answers pass; planted bugs (column and row swapped, the
nn.Linear orientation, interleaved blocks, the next rank's block, a remainder for the last rank
instead of ValueError; forward-only counts, one all-reduce per linear, talking at TP = 1, the
tensor size instead of the ring's 2 (p - 1) / p, twice the tensor, half a ring, elements instead
of bytes) are caught with a message that says so."""

import pytest
import torch

from dmlbook.exercises import ExerciseFailed, ch09


def unanswered(*args):
    raise NotImplementedError


# ---- 1. weight shards -------------------------------------------------------------------------


def shard(W, rank, world_size, split):
    dim = 1 if split == "column" else 0
    if W.shape[dim] % world_size:
        raise ValueError(f"{W.shape[dim]} does not divide by {world_size}")
    return W.chunk(world_size, dim=dim)[rank]


def shard_swapped(W, rank, world_size, split):
    return shard(W, rank, world_size, "row" if split == "column" else "column")


def shard_linear_orientation(W, rank, world_size, split):
    return shard(W.T, rank, world_size, "row" if split == "column" else "column")


def shard_interleaved(W, rank, world_size, split):
    shard(W, rank, world_size, split)  # the divisibility check
    return W[:, rank::world_size] if split == "column" else W[rank::world_size, :]


def shard_remainder_to_last(W, rank, world_size, split):
    dim = 1 if split == "column" else 0
    block = W.shape[dim] // world_size
    stop = W.shape[dim] if rank == world_size - 1 else (rank + 1) * block
    return W.narrow(dim, rank * block, stop - rank * block)


def shard_next_rank(W, rank, world_size, split):  # off by one in the start index
    return shard(W, (rank + 1) % world_size, world_size, split)


def test_weight_shard_passes_the_right_answer():
    assert ch09.check_weight_shard(shard).status == "passed"


def test_weight_shard_not_attempted():
    assert ch09.check_weight_shard(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (shard_swapped, "keeps all of W's"),
        (shard_linear_orientation, "transpose"),
        (shard_interleaved, "interleaved"),
        (shard_next_rank, "that is rank 1's block"),
        (shard_remainder_to_last, "instead of raising ValueError"),
    ],
)
def test_weight_shard_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch09.check_weight_shard(answer)


# ---- 2. communication per step ----------------------------------------------------------------


def traffic(n_layer, batch, seq, n_embd, tp, element_size):
    count = 4 * n_layer if tp > 1 else 0
    return count, count * 2 * (tp - 1) / tp * batch * seq * n_embd * element_size


def traffic_forward_only(n_layer, batch, seq, n_embd, tp, element_size):
    count = 2 * n_layer if tp > 1 else 0
    return count, count * 2 * (tp - 1) / tp * batch * seq * n_embd * element_size


def traffic_per_linear(n_layer, batch, seq, n_embd, tp, element_size):
    count = 8 * n_layer if tp > 1 else 0
    return count, count * 2 * (tp - 1) / tp * batch * seq * n_embd * element_size


def traffic_at_tp_one(n_layer, batch, seq, n_embd, tp, element_size):
    count = 4 * n_layer
    return count, count * 2 * (tp - 1) / tp * batch * seq * n_embd * element_size


def traffic_tensor_size(n_layer, batch, seq, n_embd, tp, element_size):
    count = traffic(n_layer, batch, seq, n_embd, tp, element_size)[0]
    return count, count * batch * seq * n_embd * element_size


def traffic_half_ring(n_layer, batch, seq, n_embd, tp, element_size):
    count, nbytes = traffic(n_layer, batch, seq, n_embd, tp, element_size)
    return count, nbytes / 2


def traffic_elements(n_layer, batch, seq, n_embd, tp, element_size):
    count, nbytes = traffic(n_layer, batch, seq, n_embd, tp, element_size)
    return count, nbytes / element_size


def traffic_twice_the_tensor(n_layer, batch, seq, n_embd, tp, element_size):
    count = traffic(n_layer, batch, seq, n_embd, tp, element_size)[0]
    return count, count * 2 * batch * seq * n_embd * element_size


def test_tp_communication_passes_the_right_answer():
    assert ch09.check_tp_communication(traffic).status == "passed"


def test_tp_communication_not_attempted():
    assert ch09.check_tp_communication(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (traffic_forward_only, "forward pass only"),
        (traffic_per_linear, "one all-reduce per linear"),
        (traffic_at_tp_one, "no other rank"),
        (traffic_tensor_size, r"2 \(p - 1\) / p"),
        (traffic_half_ring, "half of a ring"),
        (traffic_twice_the_tensor, "the ring's limit for many ranks"),
        (traffic_elements, "counts elements"),
        (lambda *args: "lots", "return \\(all_reduces, bytes\\)"),
    ],
)
def test_tp_communication_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch09.check_tp_communication(answer)


def test_checkers_want_a_function():
    with pytest.raises(TypeError, match="your function itself"):
        ch09.check_weight_shard(torch.zeros(2))
