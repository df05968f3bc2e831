"""Checkers for chapter 9's exercises ("Hybrid data and model parallelism").

1. ``check_weight_shard``: write ``shard(W, rank, world_size, split) -> tensor``, the block of
   ``W`` (in ``Y = X W``, W of shape ``(in, out)``) that rank holds when ``split`` is
   ``"column"`` (a contiguous block of W's columns, Megatron's ColumnParallelLinear) or ``"row"``
   (a contiguous block of W's rows, RowParallelLinear); ValueError when the split dimension does
   not divide by the world size.
2. ``check_tp_communication``: write ``traffic(n_layer, batch, seq, n_embd, tp, element_size) ->
   (all_reduces, bytes_sent_per_rank)`` for one training step of the ``n_layer`` transformer
   blocks of a Megatron model: how many all-reduces, and how many bytes each rank sends if every
   one is a ring all-reduce of the ``batch x seq x n_embd`` activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmlbook.advanced import tensor_parallel
from dmlbook.comm.groups import even_block
from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code

__all__ = ["check_tp_communication", "check_weight_shard"]


# --------------------------------------------------------------------------- 1. weight shards


def _expected_shard(W: torch.Tensor, rank: int, world: int, split: str) -> torch.Tensor:
    dim = 1 if split == "column" else 0
    start, stop = even_block(W.shape[dim], rank=rank, world_size=world)
    return W[:, start:stop] if split == "column" else W[start:stop, :]


def _shard_cases() -> list[tuple[tuple[int, int], int]]:
    return [((4, 4), 2), ((3, 6), 3), ((6, 4), 2), ((8, 12), 4), ((3, 5), 1), ((6, 6), 3)]


@checker("weight_shard")
def check_weight_shard(fn: Callable[[torch.Tensor, int, int, str], torch.Tensor]) -> str:
    """Check ``fn(W, rank, world_size, split)`` returns rank's contiguous block of W's columns
    (``"column"``) or rows (``"row"``), and that a size that does not divide raises ValueError."""
    for (n_in, n_out), world in _shard_cases():
        W = torch.arange(n_in * n_out, dtype=torch.float64).view(n_in, n_out)
        for split in ("column", "row"):
            for rank in range(world):
                call = (
                    f"your shard(W of shape {(n_in, n_out)}, rank={rank}, "
                    f"world_size={world}, {split!r})"
                )
                with learner_code(call):
                    got = fn(W.clone(), rank, world, split)
                want = _expected_shard(W, rank, world, split)
                if not isinstance(got, torch.Tensor):
                    raise ExerciseFailed(f"{call} returned {type(got).__name__}, not a tensor")
                if got.shape != want.shape:
                    hint = ""
                    if got.shape == want.T.shape and torch.equal(got, want.T):
                        hint = (
                            ": that is the transpose of the block; in Y = X W, W is (in, out), "
                            "the transpose of nn.Linear's weight (out, in)"
                        )
                    elif got.shape == _other(W, rank, world, split).shape:
                        hint = f". A {split} split of W (in, out) keeps all of W's " + (
                            "rows and some columns"
                            if split == "column"
                            else "columns and some rows"
                        )
                    raise ExerciseFailed(
                        f"{call} returned shape {tuple(got.shape)}, "
                        f"expected {tuple(want.shape)}{hint}"
                    )
                if not torch.equal(got, want):
                    dim = 1 if split == "column" else 0
                    strided = W[:, rank::world] if dim else W[rank::world, :]
                    others = [r for r in range(world) if r != rank]
                    took = next(
                        (
                            r
                            for r in others
                            if torch.equal(got, _expected_shard(W, r, world, split))
                        ),
                        None,
                    )
                    if got.shape == strided.shape and torch.equal(got, strided):
                        hint = (
                            ": that is every world_size-th one (interleaved); each rank holds one "
                            "contiguous block"
                        )
                    elif took is not None:
                        hint = (
                            f": that is rank {took}'s block; rank r's block starts at "
                            f"r * block (an off-by-one in the start index?)"
                        )
                    else:
                        hint = (
                            f"; W[i, j] = {n_out} * i + j, so the values say which block you took"
                        )
                    raise ExerciseFailed(f"{call} returned\n{got}\nexpected\n{want}{hint}")
    for W, world, split in ((torch.zeros(4, 5), 2, "column"), (torch.zeros(5, 4), 2, "row")):
        expect_value_error(
            f"your shard(W of shape {tuple(W.shape)}, 0, {world}, {split!r})",
            lambda W=W, world=world, split=split: fn(W, 0, world, split),
            f"the split dimension does not divide by {world}, so the ranks' blocks cannot be "
            "equal (Megatron pads instead)",
        )
    return (
        f"right blocks for {len(_shard_cases())} shapes x 2 splits; "
        "ValueError when sizes do not divide"
    )


def _other(W: torch.Tensor, rank: int, world: int, split: str) -> torch.Tensor:
    other = "row" if split == "column" else "column"
    try:
        return _expected_shard(W, rank, world, other)
    except ValueError:
        return torch.empty(0)


# --------------------------------------------------------------------------- 2. communication


def _traffic_cases() -> list[tuple[int, int, int, int, int, int]]:
    return [
        (2, 8, 64, 128, 2, 4),
        (24, 8, 1024, 1024, 8, 2),  # a BERT-large-like stack at TP = 8 in fp16
        (4, 2, 16, 48, 3, 4),  # a non-power of two
        (6, 4, 32, 64, 1, 4),  # TP = 1: nothing to communicate
        (1, 1, 1, 8, 4, 8),
    ]


@checker("tp_communication")
def check_tp_communication(fn: Callable[[int, int, int, int, int, int], tuple[int, float]]) -> str:
    """Check ``fn(n_layer, batch, seq, n_embd, tp, element_size)`` returns (all-reduces per
    training step, bytes each rank sends) for Megatron's transformer blocks: 2 all-reduces forward
    and 2 backward per block, each a ring all-reduce of batch x seq x n_embd elements."""
    for case in _traffic_cases():
        n_layer, batch, seq, n_embd, world, size = case
        call = (
            f"your traffic(n_layer={n_layer}, batch={batch}, seq={seq}, n_embd={n_embd}, "
            f"tp={world}, element_size={size})"
        )
        with learner_code(call):
            got = fn(*case)
        try:
            count, nbytes = got
            count, nbytes = int(count), float(nbytes)
        except (TypeError, ValueError):
            raise ExerciseFailed(f"{call} returned {got!r}; return (all_reduces, bytes)") from None
        want = tensor_parallel.communication_per_step(*case)
        want_count, want_bytes = want["all_reduces"], want["bytes_sent_per_rank"]
        activation = batch * seq * n_embd * size
        if count != want_count:
            hints = {
                2 * n_layer: "that counts the forward pass only; backward all-reduces the input "
                "gradient of each column-parallel layer (the conjugate of g is f)",
                4 * n_layer * 2: "that is one all-reduce per linear layer; a column-parallel layer "
                "followed by a row-parallel one shares a single all-reduce",
                4 * n_layer: "at TP = 1 there is no other rank to talk to",
            }
            hint = hints.get(count, "count per block: attention and MLP, forward and backward")
            raise ExerciseFailed(f"{call} gave {count} all-reduces, expected {want_count}: {hint}")
        if abs(nbytes - want_bytes) > 1e-6 * max(want_bytes, 1):
            hints = {
                count * activation: "that is the tensor size; a ring all-reduce makes each rank "
                "send 2 (p - 1) / p of it (reduce-scatter, then all-gather)",
                count * activation * (world - 1) / world: "that is half of a ring all-reduce: "
                "the reduce-scatter; the all-gather sends as much again",
                count
                * activation
                * 2: "that is 2x the tensor per all-reduce, the ring's limit for "
                "many ranks; with p ranks each sends 2 (p - 1) / p of it",
                count * batch * seq * n_embd * 2 * (world - 1) / world: "that counts elements; "
                "multiply by element_size for bytes",
            }
            hint = next(
                (
                    why
                    for value, why in hints.items()
                    if abs(nbytes - value) <= 1e-6 * max(value, 1)
                ),
                "each all-reduce is a ring over tp ranks on batch x seq x n_embd elements",
            )
            raise ExerciseFailed(f"{call} gave {nbytes:g} bytes, expected {want_bytes:g}: {hint}")
    return f"counts and bytes right for {len(_traffic_cases())} models (TP = 1, 2, 3, 4, 8)"
