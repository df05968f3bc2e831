"""Checkers for chapter 9's exercises ("Hybrid data and model parallelism").

1. ``check_weight_shard``: write ``shard(W, rank, world_size, split) -> tensor``, the block of
   ``W`` (in ``Y = X W``, W of shape ``(in, out)``) that rank holds when ``split`` is
   ``"column"`` (a contiguous block of W's columns, Megatron's ColumnParallelLinear) or ``"row"``
   (a contiguous block of W's rows, RowParallelLinear); ValueError when the split dimension does
   not divide by the world size.
2. ``check_gather_last_dim``: write ``gather_last_dim(block, group)``, the conjugate operator at
   the end of a column-parallel layer with ``gather_output=True``: forward, every rank's block of
   the last dimension side by side on every rank; backward, this rank's block of the output's
   gradient, with no communication. Checked on 4 ranks in the process groups [0] and [1, 2, 3]
   (so a global rank used for a group rank is caught), with torch's and dmlbook's gather
   operators switched off, and every collective switched off while backward runs.
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

_GROUPS = [[0], [1, 2, 3]]  # two process groups on 4 ranks: group rank != global rank in the second

# Every collective a backward could call (torch's, its autograd and functional ones, dmlbook's):
# switched off while the learner's backward runs, which must communicate nothing.
_BACKWARD_OFF = tuple(
    [f"torch.distributed.{n}" for n in (
        "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
        "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
        "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")]
    + [f"torch.distributed.nn.functional.{n}" for n in (
        "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")]
    + [f"torch.distributed._functional_collectives.{n}" for n in (
        "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd")]
    + [f"dmlbook.comm.collectives.{n}" for n in (
        "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter")]
)  # fmt: skip


def _gather_on_rank(fn: Callable, width: int, groups: list[list[int]]) -> dict:
    """Rank function: the learner's gather on this rank's group of ``groups``; then a barrier,
    so that no rank leaves while another still connects its group."""
    import torch.distributed as dist

    made = [dist.new_group(ranks) for ranks in groups]  # every rank makes every group, in order
    ranks = next(g for g in groups if dist.get_rank() in g)
    out = _gather_in_group(fn, width, made[groups.index(ranks)], ranks)
    dist.barrier()
    return out


def _gather_in_group(fn: Callable, width: int, group, ranks: list[int]) -> dict:
    """Rank r's block is r + (small distinct numbers); the ranks of the group compute the same
    loss, sum(whole output * weights), from the whole output they gathered. Backward runs with
    every collective switched off: it must not communicate."""
    import torch.distributed as dist

    from dmlbook.exercises import SwitchedOff, switched_off

    rank = dist.get_rank()
    rows = 2
    block = rank + torch.arange(rows * width, dtype=torch.float64).view(rows, width) / 100
    block.requires_grad_()
    out = {"ranks": ranks, "block": block.detach().clone()}
    try:
        whole = fn(block, group)
    except (NotImplementedError, SwitchedOff):
        raise
    except Exception as error:  # e.g. a list of dist.get_world_size() pieces for a smaller group
        out["error"] = f"{type(error).__name__}: {error}"
        return out
    out["shape"] = tuple(whole.shape) if isinstance(whole, torch.Tensor) else None
    if not isinstance(whole, torch.Tensor):
        out["type"] = type(whole).__name__
        return out
    weights = torch.arange(rows * width * len(ranks), dtype=torch.float64).view(rows, -1) + 1
    out["value"] = whole.detach().clone()
    out["connected"] = whole.requires_grad
    if whole.requires_grad and whole.shape == weights.shape:
        try:
            with switched_off(_BACKWARD_OFF, fn):
                (whole * weights).sum().backward()
        except NotImplementedError:
            raise
        except Exception as error:
            cause, seen = error, set()
            while cause is not None and id(cause) not in seen:
                seen.add(id(cause))
                if isinstance(cause, SwitchedOff):
                    out["backward_called"] = str(cause).split(" is switched off")[0]
                    return out
                cause = cause.__cause__ or cause.__context__
            out["backward_error"] = f"{type(error).__name__}: {error}"
            return out
    out["grad"] = None if block.grad is None else block.grad.clone()
    return out


_NOT_GLOBAL = (
    "Inside a process group, a rank's place is its group rank, dist.get_rank(group), and the "
    "group's size is dist.get_world_size(group); dist.get_rank() and dist.get_world_size() are "
    "the whole world's"
)


@checker(
    "gather_last_dim",
    writes=(
        "dmlbook.advanced.tensor_parallel.comm.gather_from_tensor_parallel",
        "dmlbook.advanced.tensor_parallel.comm.AllGatherForwardSplitBackward.forward",
        "dmlbook.advanced.tensor_parallel.comm.raw_all_gather_last",
        "torch.distributed.nn.functional.all_gather",
        "torch.distributed._functional_collectives.all_gather_tensor",
        "torch.distributed._functional_collectives.all_gather_tensor_autograd",
        "torch.distributed._functional_collectives.all_gather_single_autograd",
        "torch.distributed._functional_collectives.all_gather_tensor_inplace",
    ),
)
def check_gather_last_dim(fn: Callable[[torch.Tensor, object], torch.Tensor]) -> str:
    """Check ``fn(block, group)`` on 4 ranks in the process groups [0] and [1, 2, 3]: forward,
    every group rank's block of the last dimension side by side on every rank of the group;
    backward, this rank's block of the output's gradient, with no communication (the ranks of a
    group all computed the same loss from the same whole output)."""
    world, width = 4, 2
    call = (
        f"your gather_last_dim(block of shape (2, {width}), group) on {world} ranks in the "
        f"groups {_GROUPS}"
    )
    with learner_code(call):
        ranks = run_answer(_gather_on_rank, world, fn, width, _GROUPS)
    for rank, r in enumerate(ranks):
        group, size = r["ranks"], len(r["ranks"])
        where = f"on rank {rank} (group {group}, group rank {group.index(rank)})"
        if "error" in r:
            raise ExerciseFailed(f"{call} raised {where}: {r['error']}. {_NOT_GLOBAL}")
        if r["shape"] is None:
            raise ExerciseFailed(f"{call} returned {r['type']} {where}, not a tensor")
        if r["shape"] != (2, width * size):
            hint = (
                ": that is this rank's block alone; gather every rank's"
                if r["shape"] == (2, width) and size > 1
                else ": the blocks go side by side along the last dimension"
                if r["shape"] == (2 * size, width)
                else f". {_NOT_GLOBAL}"
            )
            raise ExerciseFailed(
                f"{call} returned shape {r['shape']} {where}, expected {(2, width * size)}{hint}"
            )
        want_value = torch.cat([ranks[q]["block"] for q in group], dim=-1)
        if not torch.equal(r["value"], want_value):
            raise ExerciseFailed(
                f"{call} returned {where}\n{r['value']}\nexpected\n{want_value}\n(global rank "
                "q's block holds the number q plus hundredths: put group rank i's block at "
                f"columns [i * {width}, (i + 1) * {width}))"
            )
        if "backward_called" in r:
            raise ExerciseFailed(
                f"{call}: backward called {r['backward_called']} {where}. Backward needs no "
                "communication: every rank of the group computed the same loss from the same "
                "whole output, so each already holds the whole output's gradient; its block's "
                "gradient is its own slice of that (an all-reduce then a division by the group "
                "size gives the same numbers at the price of a collective on the critical path)"
            )
        if "backward_error" in r:
            raise ExerciseFailed(
                f"{call}: backward raised {where}: {r['backward_error']}. Its gradient must be "
                f"this rank's block of the output's gradient, shape (2, {width}). {_NOT_GLOBAL}"
            )
        if not r["connected"] or r["grad"] is None:
            raise ExerciseFailed(
                f"{call}: no gradient reached the block {where}. dist.all_gather fills "
                "tensors outside autograd: write a torch.autograd.Function whose backward says "
                "what the block's gradient is (or join the block itself, not a gathered copy "
                "of it, into the output)"
            )
        weights = torch.arange(2 * width * size, dtype=torch.float64).view(2, -1) + 1
        place = group.index(rank)
        mine = weights[:, place * width : (place + 1) * width]
        grad = r["grad"]
        if torch.equal(grad, mine):
            continue
        took = next(
            (k for k in range(size) if torch.equal(grad, weights[:, k * width : (k + 1) * width])),
            None,
        )
        if size > 1 and torch.allclose(grad, size * mine):
            hint = (
                f"{size} times the right one: your backward summed over the ranks. Every rank "
                "computed the same loss from the same whole output, so each already holds the "
                "whole output's gradient: keep your block of it, no communication (the conjugate "
                "of this all-gather is a split)"
            )
        elif took is not None and took == rank:
            hint = (
                f"the block of group rank {took}, this rank's *global* rank. {_NOT_GLOBAL}: in "
                f"group {group}, global rank {rank} is group rank {place}"
            )
        elif took is not None:
            hint = f"group rank {took}'s block of the output gradient; take your own rank's columns"
        else:
            hint = "expected this rank's block of the output's gradient, unchanged"
        raise ExerciseFailed(
            f"{call}: {where} the block's gradient was\n{grad}\nexpected\n{mine}: {hint}"
        )
    return (
        f"forward and backward right on the groups {_GROUPS} of {world} ranks, "
        "backward without communication"
    )
