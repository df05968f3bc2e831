"""Checkers for chapter 9's exercises ("Hybrid data and model parallelism").

1. ``check_weight_shard``: write ``shard(W, rank, world_size, split) -> tensor``, the block of
   ``W`` (in ``Y = X W``, W of shape ``(in, out)``) that rank holds when ``split`` is
   ``"column"`` (a contiguous block of W's columns, Megatron's ColumnParallelLinear) or ``"row"``
   (a contiguous block of W's rows, RowParallelLinear); ValueError when the split dimension does
   not divide by the world size.
2. ``check_gather_last_dim``: write ``gather_last_dim(block, group)``, the conjugate operator at
   the end of a column-parallel layer with ``gather_output=True``: forward, every rank's block of
   the last dimension side by side on every rank; backward, this rank's block of the output's
   gradient. Checked on 3 ranks with torch's and dmlbook's gather operators switched off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmlbook.comm.groups import even_block
from dmlbook.exercises import (
    ExerciseFailed,
    checker,
    expect_value_error,
    learner_code,
    run_answer,
)

__all__ = ["check_gather_last_dim", "check_weight_shard"]


# --------------------------------------------------------------------------- 1. weight shards


def _expected_shard(W: torch.Tensor, rank: int, world: int, split: str) -> torch.Tensor:
    dim = 1 if split == "column" else 0
    start, stop = even_block(W.shape[dim], rank=rank, world_size=world)
    return W[:, start:stop] if split == "column" else W[start:stop, :]


def _shard_cases() -> list[tuple[tuple[int, int], int]]:
    return [((4, 4), 2), ((3, 6), 3), ((6, 4), 2), ((8, 12), 4), ((3, 5), 1), ((6, 6), 3)]


@checker("weight_shard", writes=("dmlbook.comm.groups.even_block",))
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


# --------------------------------------------------------------------------- 2. gather's conjugate


def _gather_on_rank(fn: Callable, width: int) -> dict:
    """Rank function: rank r's block is r + (small distinct numbers); every rank computes the
    same loss, sum(whole output * weights), from the whole output it gathered."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 2
    block = rank + torch.arange(rows * width, dtype=torch.float64).view(rows, width) / 100
    block.requires_grad_()
    whole = fn(block, dist.group.WORLD)
    out = {"shape": tuple(whole.shape) if isinstance(whole, torch.Tensor) else None}
    if not isinstance(whole, torch.Tensor):
        out["type"] = type(whole).__name__
        return out
    weights = torch.arange(rows * width * world, dtype=torch.float64).view(rows, -1) + 1
    out["value"] = whole.detach().clone()
    out["connected"] = whole.requires_grad
    if whole.requires_grad and whole.shape == weights.shape:
        (whole * weights).sum().backward()
    out["grad"] = None if block.grad is None else block.grad.clone()
    out["block"] = block.detach().clone()
    return out


@checker(
    "gather_last_dim",
    writes=(
        "dmlbook.advanced.tensor_parallel.comm.gather_from_tensor_parallel",
        "dmlbook.advanced.tensor_parallel.comm.AllGatherForwardSplitBackward.forward",
        "dmlbook.advanced.tensor_parallel.comm._all_gather_last",
        "torch.distributed.nn.functional.all_gather",
    ),
)
def check_gather_last_dim(fn: Callable[[torch.Tensor, object], torch.Tensor]) -> str:
    """Check ``fn(block, group)`` on 3 ranks: forward, every rank's block of the last dimension
    side by side in rank order on every rank; backward, this rank's block of the output's
    gradient, with no sum over the ranks (they all computed the same loss)."""
    world, width = 3, 2
    call = f"your gather_last_dim(block of shape (2, {width}), group) on {world} ranks"
    with learner_code(call):
        ranks = run_answer(_gather_on_rank, world, fn, width)
    weights = torch.arange(2 * width * world, dtype=torch.float64).view(2, -1) + 1
    blocks = [r["block"] for r in ranks if "block" in r]
    want_value = torch.cat(blocks, dim=-1) if len(blocks) == world else None
    for rank, r in enumerate(ranks):
        if r["shape"] is None:
            raise ExerciseFailed(f"{call} returned {r['type']} on rank {rank}, not a tensor")
        if r["shape"] != (2, width * world):
            hint = (
                ": that is this rank's block alone; gather every rank's"
                if r["shape"] == (2, width)
                else ": the blocks go side by side along the last dimension"
                if r["shape"] == (2 * world, width)
                else ""
            )
            raise ExerciseFailed(
                f"{call} returned shape {r['shape']} on rank {rank}, expected "
                f"{(2, width * world)}{hint}"
            )
        if not torch.equal(r["value"], want_value):
            raise ExerciseFailed(
                f"{call} returned on rank {rank}\n{r['value']}\nexpected\n{want_value}\n(rank "
                "r's block holds the number r plus hundredths: put rank r's block at columns "
                f"[r * {width}, (r + 1) * {width}))"
            )
        mine = weights[:, rank * width : (rank + 1) * width]
        if not r["connected"] or r["grad"] is None:
            raise ExerciseFailed(
                f"{call}: no gradient reached the block on rank {rank}. dist.all_gather fills "
                "tensors outside autograd: write a torch.autograd.Function whose backward says "
                "what the block's gradient is (or join the block itself, not a gathered copy "
                "of it, into the output)"
            )
        grad = r["grad"]
        if torch.equal(grad, mine):
            continue
        if torch.allclose(grad, world * mine):
            hint = (
                f"{world} times the right one: your backward summed over the ranks (an "
                "all-reduce or reduce-scatter). Every rank computed the same loss from the same "
                "whole output, so each already holds the whole output's gradient: keep your "
                "block of it, no communication (the conjugate of this all-gather is a split)"
            )
        elif any(torch.equal(grad, weights[:, k * width : (k + 1) * width]) for k in range(world)):
            hint = "another rank's block of the output gradient; take columns of your own rank"
        else:
            hint = "expected this rank's block of the output's gradient, unchanged"
        raise ExerciseFailed(
            f"{call}: on rank {rank} the block's gradient was\n{grad}\nexpected\n{mine}: {hint}"
        )
    return f"forward and backward right on {world} ranks"
