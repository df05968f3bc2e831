"""Checkers for chapter 11's exercises ("Elastic model training and serving").

1. ``check_rank_batch``: write ``rank_batch(order, position, local_batch, rank, world_size)``,
   rank ``rank``'s samples of the global batch that starts at ``position`` in the epoch's order
   (the next ``local_batch * world_size`` samples, fewer at the end of the epoch). After a resize
   the ranks resume mid-epoch: together they must cover the rest of the epoch, every sample exactly
   once, with parts that differ in size by at most one
   (:func:`dmlbook.advanced.elastic.rank_batch`; it and :func:`dmlbook.comm.groups.balanced_blocks`
   are switched off while the answer runs).
2. ``check_rescale``: write ``rescale(base_lr, base_batch, local_batch, world_size,
   samples_left) -> (lr, global_batch, steps_left)``: the learning rate by the linear scaling rule
   for the new global batch, and the steps left in the epoch (the last one may be short)
   (:func:`dmlbook.advanced.elastic.lr_for` and :func:`dmlbook.data_parallel.linear_scaling` are
   switched off while the answer runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dmlbook.advanced import elastic
from dmlbook.exercises import ExerciseFailed, checker, learner_code

__all__ = ["check_rank_batch", "check_rescale"]


def _epoch_cases() -> list[tuple[list[int], int, int, int]]:
    """(order, position, local_batch, world_size): resumes at and off batch boundaries."""
    order = elastic.epoch_order(37, seed=3, epoch=1)
    return [
        (order, 0, 4, 1),
        (order, 0, 4, 2),
        (order, 8, 4, 3),  # the non-power of two, mid-epoch
        (order, 10, 3, 4),  # the position is not a multiple of the new global batch
        (order, 33, 4, 3),  # only 4 samples left for 3 ranks
        (order, 35, 4, 4),  # fewer samples left than ranks: someone gets none
        (list(range(10)), 3, 2, 2),
    ]


@checker(
    "rank_batch",
    writes=("dmlbook.advanced.elastic.rank_batch", "dmlbook.comm.groups.balanced_blocks"),
)
def check_rank_batch(fn: Callable[[Sequence[int], int, int, int, int], list[int]]) -> str:
    """Walk the rest of each epoch from ``position`` as the ranks would, and check each global
    batch is covered exactly once, by parts within one sample of each other in size."""
    for order, position, local_batch, world in _epoch_cases():
        seen: list[int] = []
        start = position
        while start < len(order):
            parts = []
            for rank in range(world):
                call = f"your rank_batch(order, {start}, {local_batch}, {rank}, {world})"
                with learner_code(call):
                    parts.append([int(i) for i in fn(list(order), start, local_batch, rank, world)])
            batch = list(order[start : start + local_batch * world])
            got = sorted(i for p in parts for i in p)
            if got != sorted(batch):
                lost = sorted(set(batch) - set(got))
                extra = sorted(set(got) - set(batch))
                twice = sorted({i for i in got if got.count(i) > 1})
                before, after = set(order[:start]), set(order[start + len(batch) :])
                if extra and set(extra) <= before:
                    why = (
                        "the extra samples come before position: start at position, the samples "
                        "before it were trained before the failure"
                    )
                elif extra and set(extra) <= after:
                    why = (
                        "the extra samples come after this global batch, which is the "
                        f"local_batch * world_size = {local_batch * world} samples from position: "
                        "an off-by-one in a slice, or parts of the wrong size"
                    )
                elif twice:
                    why = "two ranks took the same samples: each rank's part must depend on rank"
                else:
                    why = (
                        "no rank took them: the parts together must cover the whole global batch, "
                        "also when it does not divide by world_size (split the remainder too)"
                    )
                raise ExerciseFailed(
                    f"at position {start} with local_batch {local_batch} on {world} ranks the "
                    f"global batch is order[{start}:{start + local_batch * world}] = {batch}; "
                    f"your parts {parts} lose {lost}, repeat {twice} and add {extra}: {why}"
                )
            sizes = [len(p) for p in parts]
            if max(sizes) - min(sizes) > 1:
                raise ExerciseFailed(
                    f"at position {start} on {world} ranks your parts have sizes {sizes}: they "
                    "may differ by one at most, or one rank does most of the work. At the end of "
                    "the epoch the global batch is short: share what is left evenly (strided, "
                    "batch[rank::world_size], or blocks of ceil or floor size) instead of "
                    "local_batch each in turn or the remainder to one rank"
                )
            seen += got
            start += len(batch)
        if sorted(seen) != sorted(order[position:]):
            raise ExerciseFailed(f"resuming at {position} did not cover the rest of the epoch")
    return "every sample after the resume point exactly once, at world sizes 1 to 4"


@checker(
    "rescale",
    writes=("dmlbook.advanced.elastic.lr_for", "dmlbook.data_parallel.linear_scaling"),
)
def check_rescale(fn: Callable[[float, int, int, int, int], tuple[float, int, int]]) -> str:
    """Compare ``fn(base_lr, base_batch, local_batch, world_size, samples_left)`` with the linear
    rule and the ceiling of samples_left / global_batch."""
    cases = [(0.1, 32, 16, 2, 1438), (0.1, 32, 16, 1, 798), (0.05, 64, 16, 3, 1000),
             (0.2, 256, 32, 4, 128), (0.1, 32, 16, 3, 47)]  # fmt: skip
    for base_lr, base_batch, local_batch, world, left in cases:
        call = f"your rescale({base_lr}, {base_batch}, {local_batch}, {world}, {left})"
        with learner_code(call):
            lr, global_batch, steps = fn(base_lr, base_batch, local_batch, world, left)
        want_batch = local_batch * world
        want_lr = base_lr * want_batch / base_batch
        want_steps = math.ceil(left / want_batch)
        if global_batch != want_batch:
            raise ExerciseFailed(
                f"{call} gave global batch {global_batch}: each of the {world} ranks still takes "
                f"{local_batch} samples, so it is {want_batch}"
            )
        if not math.isclose(lr, want_lr, rel_tol=1e-9):
            hint = ""
            if math.isclose(lr, base_lr * world, rel_tol=1e-9):
                hint = " (that scales by the world size: scale by global_batch / base_batch)"
            elif math.isclose(lr, base_lr * math.sqrt(want_batch / base_batch), rel_tol=1e-9):
                hint = " (that is square-root scaling; the chapter uses the linear rule)"
            raise ExerciseFailed(f"{call} gave lr {lr}, the linear rule gives {want_lr}{hint}")
        if steps != want_steps:
            hint = " (the last, shorter batch is a step too)" if steps == left // want_batch else ""
            raise ExerciseFailed(
                f"{call} gave {steps} steps; {left} samples in batches of {want_batch} take "
                f"{want_steps}{hint}"
            )
    return "linear LR scaling and the steps left, at world sizes 1 to 4"
