"""Checkers for chapter 11's exercises ("Elastic model training and serving").

1. ``check_rank_batch``: write ``rank_batch(order, position, local_batch, rank, world_size)``,
   rank ``rank``'s samples of the global batch that starts at ``position`` in the epoch's order
   (the next ``local_batch * world_size`` samples, fewer at the end of the epoch). After a resize
   the ranks resume mid-epoch: together they must cover the rest of the epoch, every sample exactly
   once, with parts that differ in size by at most one
   (:func:`dmlbook.advanced.elastic.rank_batch`; it, :func:`dmlbook.comm.groups.balanced_blocks`,
   ``numpy.array_split`` and ``torch.tensor_split`` are switched off while the answer runs).
2. ``check_resume_plan``: write ``resume_plan(step, old_world, new_world, local_batch,
   epoch_size, base_lr, base_batch) -> (epoch, position, lr, steps_left)``: a checkpoint that
   holds only the global step, written by a job that ran every step at ``old_world``, resumed at
   ``new_world``: where the epoch stands in samples, the learning rate by the linear rule for the
   new global batch, and the steps the new world takes to finish the epoch
   (:func:`dmlbook.advanced.elastic.lr_for`, :func:`dmlbook.data_parallel.linear_scaling`,
   :func:`~dmlbook.advanced.elastic.position_after` and, as a way around the arithmetic,
   :func:`~dmlbook.advanced.elastic.elastic_batches` are switched off while the answer runs).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

from dmlbook.advanced import elastic
from dmlbook.exercises import ExerciseFailed, checker, learner_code, switched_off

__all__ = ["check_rank_batch", "check_resume_plan"]


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
    writes=(
        "dmlbook.advanced.elastic.rank_batch",
        "dmlbook.comm.groups.balanced_blocks",
        "numpy.array_split",
        "torch.tensor_split",
    ),
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
                span = local_batch * world
                if got == list(range(start, start + len(batch))):
                    why = (
                        "you returned positions in the order, not samples: rank r's samples are "
                        "the values order[p] at its positions p"
                    )
                elif start > 0 and got == sorted(order[start * span : start * span + span]):
                    why = (
                        f"you took order[position * local_batch * world_size ...] = "
                        f"order[{start * span}...]: position counts samples, not batches (11.2); "
                        "the global batch starts at order[position]"
                    )
                elif world > 1 and all(p == parts[0] for p in parts):
                    why = "every rank took the same part: each rank's part must depend on rank"
                elif twice and not lost and not extra:
                    why = (
                        "your parts repeat samples of the batch to make the parts equal in size "
                        "(padding, as DistributedSampler does): here a repeated sample is trained "
                        "twice in the epoch. Let the parts differ in size by one instead"
                    )
                elif extra and set(extra) <= before:
                    why = (
                        "the extra samples come before position: start at position, the samples "
                        "before it were trained before the failure"
                    )
                elif extra and set(extra) <= after:
                    why = (
                        "the extra samples come after this global batch, which is the "
                        f"local_batch * world_size = {span} samples from position: "
                        "an off-by-one in a slice, or parts of the wrong size"
                    )
                elif twice:
                    why = "two ranks took the same samples: the ranks' parts must not overlap"
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
                    "batch[rank::world_size], or blocks whose sizes differ by one at most: the "
                    "first len(batch) % world_size ranks take one sample more) instead of "
                    "local_batch each in turn, equal ceil-sized blocks, or the remainder to one "
                    "rank"
                )
            seen += got
            start += len(batch)
        if sorted(seen) != sorted(order[position:]):
            raise ExerciseFailed(f"resuming at {position} did not cover the rest of the epoch")
    return "every sample after the resume point exactly once, at world sizes 1 to 4"


# Also switched off: a way around the arithmetic (walk the batches), though not its answer, which
# is why it is not in ``writes``: 11.2 shows its source as the mechanism of re-partitioning.
_WALKS = ("dmlbook.advanced.elastic.elastic_batches",)


def _resume_plan(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch):
    """The checker's own answer: what a restarted worker works out from the step alone."""
    old_batch, new_batch = local_batch * old_world, local_batch * new_world
    epoch, done = divmod(step, math.ceil(epoch_size / old_batch))  # the last step may be short
    position = done * old_batch
    return (
        epoch,
        position,
        base_lr * new_batch / base_batch,
        -(-(epoch_size - position) // new_batch),
    )


@checker(
    "resume_plan",
    writes=(
        "dmlbook.advanced.elastic.lr_for",
        "dmlbook.data_parallel.linear_scaling",
        "dmlbook.advanced.elastic.position_after",
    ),
)
def check_resume_plan(fn: Callable[..., tuple[int, int, float, int]]) -> str:
    """Compare ``fn(step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch)``
    with the position in samples, the linear rule and the ceiling of the samples left."""
    cases = [(20, 2, 1, 16, 1438, 0.1, 32),  # chapter 11's run: step 20 at world 2, then world 1
             (45, 2, 1, 16, 1438, 0.1, 32),  # the checkpoint closed epoch 0
             (50, 2, 3, 16, 1438, 0.1, 32),  # grow: 5 steps into epoch 1
             (7, 3, 4, 4, 37, 0.05, 12),  # a short last batch: 4 steps an epoch, 1 sample left
             (9, 4, 2, 5, 60, 0.2, 40),  # three whole epochs; base_batch is not the old batch
             (5, 1, 2, 8, 100, 0.1, 8)]  # fmt: skip
    for case in cases:
        step, old_world, new_world, local_batch, epoch_size, base_lr, base_batch = case
        call = "your resume_plan({}, {}, {}, {}, {}, {}, {})".format(*case)
        with learner_code(call), switched_off(_WALKS, fn):
            answer = fn(*case)
        want = _resume_plan(*case)
        epoch, position, lr, steps = want
        old_batch, new_batch = local_batch * old_world, local_batch * new_world
        try:
            got_epoch, got_position, got_lr, got_steps = answer
        except (TypeError, ValueError):
            raise ExerciseFailed(
                f"{call} returned {answer!r}: return the tuple (epoch, position, lr, steps_left)"
            ) from None
        per_epoch = math.ceil(epoch_size / old_batch)
        where = (
            f"each epoch of {epoch_size} samples took {per_epoch} steps of {old_batch} at world "
            f"size {old_world}, so step {step} ends at epoch {epoch}, sample {position}"
        )
        if (got_epoch, got_position) != (epoch, position):
            if got_position == step * new_batch:
                hint = (
                    f"you counted the steps in the new world's batches ({new_batch}); the "
                    f"checkpoint's steps were taken at world size {old_world}, {old_batch} each"
                )
            elif got_position == step * old_batch or got_position >= epoch_size:
                hint = "a position is within one epoch: the epoch goes on from sample 0"
            elif per_epoch != epoch_size // old_batch and (got_epoch, got_position) == (
                divmod(step, epoch_size // old_batch)[0],
                divmod(step, epoch_size // old_batch)[1] * old_batch,
            ):
                hint = "the last, shorter batch of an epoch is a step too (a ceiling, not a floor)"
            else:
                hint = "the position counts samples from the start of the epoch"
            raise ExerciseFailed(
                f"{call} gave epoch {got_epoch}, position {got_position}: {where}. {hint}"
            )
        if not isinstance(got_lr, (int, float)) or not math.isclose(got_lr, lr, rel_tol=1e-9):
            hint = ""
            if math.isclose(got_lr, base_lr, rel_tol=1e-9):
                hint = "that is base_lr unchanged: the learning rate follows the new global batch"
            elif math.isclose(got_lr, base_lr * new_world / old_world, rel_tol=1e-9):
                hint = (
                    "that scales by new_world / old_world: the rule starts from base_lr at "
                    f"base_batch = {base_batch}, which need not be the old global batch"
                )
            elif math.isclose(got_lr, base_lr * base_batch / new_batch, rel_tol=1e-9):
                hint = "that is upside down: a larger batch gets a larger learning rate"
            elif math.isclose(got_lr, base_lr * math.sqrt(new_batch / base_batch), rel_tol=1e-9):
                hint = "that is square-root scaling; the chapter uses the linear rule"
            elif math.isclose(got_lr, base_lr * local_batch / base_batch, rel_tol=1e-9):
                hint = "that scales by the local batch: the rule takes the global batch"
            raise ExerciseFailed(
                f"{call} gave lr {got_lr}; the linear rule gives base_lr x {new_batch} / "
                f"{base_batch} = {lr}" + (f" ({hint})" if hint else "")
            )
        if isinstance(got_steps, bool) or not isinstance(got_steps, numbers.Integral):
            raise ExerciseFailed(
                f"{call} gave {got_steps!r} steps: a count of steps is a whole number (an int)"
            )
        if got_steps != steps:
            left = epoch_size - position
            if got_steps == left // new_batch:
                hint = "the last, shorter batch is a step too"
            elif got_steps == math.ceil(epoch_size / new_batch):
                hint = "that is a whole epoch: count only the samples after the position"
            else:
                hint = f"the new world's global batch is local_batch x new_world = {new_batch}"
            raise ExerciseFailed(
                f"{call} gave {got_steps} steps left; {left} samples in batches of {new_batch} "
                f"take {steps} ({hint})"
            )
    return "the position in samples, the linear rule and the steps left, growing and shrinking"
