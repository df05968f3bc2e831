"""Checkers for chapter 12's exercises ("Advanced techniques for further speed-ups").

1. ``check_proportional_batches``: write ``split(speeds, global_batch) -> batches``, one batch
   size per rank, in proportion to the ranks' speeds (samples per second): each within one sample
   of ``global_batch * speed / sum(speeds)``, at least one each, summing exactly to
   ``global_batch``; ValueError for a speed <= 0 or fewer samples than ranks.
2. ``check_overlap``: write ``overlap(a, b) -> seconds``, the total time covered by both interval
   lists ``a`` and ``b`` (each a list of (start, end); intervals within one list may overlap each
   other, as nested profiler events do), each moment counted once: the time an all-reduce was
   hidden behind backward.
3. ``check_loss_scale``: write ``loss_scale(batches, rank) -> float``, what rank ``rank``
   multiplies its *mean* loss by so that the gradients *averaged* over the ranks (as torch's DDP
   does: the sum divided by the world size) equal the gradient of the mean loss over the union
   batch, whatever the (unequal) batch sizes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from dmlbook.advanced.speedups import intervals
from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code

__all__ = ["check_loss_scale", "check_overlap", "check_proportional_batches"]


# --------------------------------------------------------------------------- 1. batch split


def _split_cases() -> list[tuple[list[float], int]]:
    rng = random.Random(12)
    cases = [
        ([1.0, 1.0], 10),
        ([3.0, 1.0], 8),
        ([1.0, 1.0, 1.0], 10),  # 10 / 3 each: someone rounds up, and only one
        ([1.0, 2.0, 2.0], 11),
        ([0.7, 0.2, 0.1], 10),
        ([5.0, 4.0, 3.0, 2.0], 100),
        ([120.5, 40.25, 300.0], 64),
        ([1000.0, 1.0], 4),  # the slow rank's share rounds to 0: it still needs one sample
        ([2.0], 7),  # one rank takes everything
    ]
    for n in (3, 4, 5):
        speeds = [round(rng.uniform(0.5, 9.0), 3) for _ in range(n)]
        cases.append((speeds, rng.randint(4 * n, 200)))
    return cases


def _split_hint(got: list[int], speeds: Sequence[float], batch: int) -> str:
    inverse = [batch * (1 / s) / sum(1 / v for v in speeds) for s in speeds]
    if len(set(speeds)) > 1 and all(abs(g - e) < 1 for g, e in zip(got, inverse, strict=True)):
        return ": that follows the time per sample; the FASTER rank should take MORE samples"
    if len(set(got)) == 1 and len(set(speeds)) > 1:
        return ": an equal split makes everyone wait for the slowest rank"
    shares = [batch * s / sum(speeds) for s in speeds]
    off = [r for r, (g, e) in enumerate(zip(got, shares, strict=True)) if abs(g - e) >= 1]
    if sum(got) == batch and len(off) == 1:
        return (
            f": rank {off[0]} absorbs all the rounding error. Round every share down, then give "
            "the samples left, one each, to the ranks with the largest remainders"
        )
    if abs(sum(got) - batch) >= len(speeds):
        return (
            f": they sum to {sum(got)}, not {batch}, further off than rounding can go. Compute "
            "the sizes from the arguments (speeds and global_batch): are they fixed numbers?"
        )
    if sum(got) != batch:
        return (
            f": they sum to {sum(got)}, not {batch}. Rounding each share on its own (down or to "
            "the nearest) does not keep the sum; round down, then give the samples left to the "
            "largest remainders"
        )
    return ""


def _whole_numbers(call: str, returned: list) -> list[int]:
    """The batch sizes as ints; a size that is not a whole number fails, as returned."""
    got = []
    for b in returned:
        try:
            whole = float(b).is_integer()
        except (TypeError, ValueError):
            whole = False
        if not whole:
            raise ExerciseFailed(
                f"{call} returned {returned}: a batch size is a whole number of samples. Round "
                "the shares (so that they still sum to global_batch) and return ints"
            )
        got.append(int(b))
    return got


@checker(
    "proportional_batches",
    writes=(
        "dmlbook.advanced.speedups.heterogeneous.proportional_batches",
        "torch.utils.data.random_split",  # lengths from fractions, the remainder dealt out
    ),
)
def check_proportional_batches(fn: Callable[[list[float], int], list[int]]) -> str:
    """Check ``fn(speeds, global_batch)``: one batch per rank, each >= 1 and within one sample of
    its proportional share, summing to ``global_batch``; ValueError on bad input."""
    cases = _split_cases()
    for speeds, batch in cases:
        call = f"your split({speeds}, {batch})"
        with learner_code(call):
            returned = list(fn(list(speeds), batch))
        got = _whole_numbers(call, returned)
        shares = [batch * s / sum(speeds) for s in speeds]
        if len(got) != len(speeds):
            raise ExerciseFailed(f"{call} returned {got}: one batch size per rank, {len(speeds)}")
        if min(got) < 1:
            raise ExerciseFailed(
                f"{call} returned {got}: every rank needs at least one sample, since it still "
                "joins every all-reduce (a rank with no data would have no gradient to send)"
            )
        # A share below 1 is raised to 1 sample, taken from the others: allow for those.
        slack = 1 + sum(e < 1 for e in shares)
        wrong = sum(got) != batch or any(
            abs(g - e) >= (1 if e < 1 else slack) for g, e in zip(got, shares, strict=True)
        )
        if wrong:
            want = [round(e, 2) for e in shares]
            raise ExerciseFailed(
                f"{call} returned {got}; the proportional shares are {want}"
                f"{_split_hint(got, speeds, batch)}"
            )
    for speeds, batch, why in (([1.0, 0.0], 8, "a speed of 0"), ([1.0, 2.0, 3.0], 2, "2 < 3")):
        expect_value_error(
            f"split({speeds}, {batch})", lambda s=speeds, b=batch: fn(list(s), b), why
        )
    return f"proportional and exact on all {len(cases)} splits, ValueError on bad input"


# --------------------------------------------------------------------------- 2. overlap


def _overlap_cases() -> list[tuple[list, list]]:
    rng = random.Random(3)
    cases = [
        ([(0, 4), (8, 10)], [(2, 9)]),  # 2 + 1
        ([(0, 1)], [(1, 2)]),  # touching: 0
        ([(0, 10)], [(2, 3), (5, 6)]),
        ([(0, 5), (1, 3)], [(2, 4)]),  # nested within a: count 2..4 once
        ([(2, 4)], [(0, 5), (1, 3)]),  # nested within b
        ([(5, 6), (0, 1)], [(0.5, 5.5)]),  # unsorted
        ([], [(0, 1)]),
        ([(0.25, 0.75)], [(0.5, 2.0), (0.6, 0.7)]),
    ]
    for _ in range(4):
        lists = []
        for _ in range(2):
            starts = [rng.uniform(0, 20) for _ in range(rng.randint(2, 6))]
            lists.append([(round(s, 6), round(s + rng.uniform(0.1, 4), 6)) for s in starts])
        cases.append((lists[0], lists[1]))
    return cases


def _merged_unsorted(intervals_: list) -> list:
    """Merging as if the list were sorted by start: a common slip."""
    out: list[list[float]] = []
    for start, end in intervals_:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _overlap_mistakes(a: list, b: list) -> dict[str, float]:
    pairwise = sum(max(0.0, min(ea, eb) - max(sa, sb)) for sa, ea in a for sb, eb in b)
    unsorted = sum(
        max(0.0, min(ea, eb) - max(sa, sb))
        for sa, ea in _merged_unsorted(a)
        for sb, eb in _merged_unsorted(b)
    )

    def span(intervals_: list) -> list:
        return (
            [(min(s for s, _ in intervals_), max(e for _, e in intervals_))] if intervals_ else []
        )

    def merged_keeping_last_end(intervals_: list) -> list:
        out: list[list[float]] = []
        for start, end in sorted(intervals_):
            if out and start <= out[-1][1]:
                out[-1][1] = end  # a nested interval cuts the one around it short
            else:
                out.append([start, end])
        return out

    def overlap_of(x: list, y: list) -> float:
        return sum(max(0.0, min(ex, ey) - max(sx, sy)) for sx, ex in x for sy, ey in y)

    return {
        "you took each list's span, from its first start to its last end, so the gaps between "
        "its intervals count as covered; intersect the intervals themselves": overlap_of(
            span(a), span(b)
        ),
        "you took the smaller of the two lists' total lengths: that is only an upper bound, "
        "since what counts is where the intervals lie": min(
            intervals.length(a), intervals.length(b)
        ),
        "that is the smaller of the two lists' summed durations, not where they meet": min(
            sum(e - s for s, e in a), sum(e - s for s, e in b)
        ),
        "when you merged a list, an interval nested inside the one before cut it short: keep "
        "the later end, max(end, previous end)": overlap_of(
            merged_keeping_last_end(a), merged_keeping_last_end(b)
        ),
        "you added the overlap of every pair, so time covered twice within one list counts "
        "twice; merge each list into disjoint intervals first": pairwise,
        "you merged each list without sorting it by start first, so an interval that starts "
        "earlier but comes later in the list is not merged; sort, then merge": unsorted,
        "that is the time covered by EITHER list (the union), not by both": intervals.length(a + b),
        "that is a fraction; return the overlapping time itself": (
            intervals.overlap_fraction(a, b) if a else -1.0
        ),
    }


@checker(
    "overlap",
    writes=tuple(  # each of them, or two together, gives the time covered by both lists
        f"dmlbook.advanced.speedups.intervals.{name}"
        for name in ("union", "length", "intersection", "difference", "overlap_fraction")
    ),
)
def check_overlap(fn: Callable[[list, list], float]) -> str:
    """Check ``fn(a, b)`` is the total time covered by both interval lists, each moment once."""
    cases = _overlap_cases()
    for a, b in cases:
        call = f"your overlap({a}, {b})"
        with learner_code(call):
            got = float(fn(list(a), list(b)))
        want = intervals.length(intervals.intersection(a, b))
        if abs(got - want) <= 1e-9 * max(1.0, want):
            continue
        hint = next(
            (f": {why}" for why, v in _overlap_mistakes(a, b).items() if abs(got - v) <= 1e-9),
            "",
        )
        if not hint and abs(got - want) <= 0.02 * want:
            hint = (
                ": close, but not exact. Sampling time at points (a grid) only approximates; "
                "compute the answer from the intervals' ends"
            )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g}{hint}")
    return f"overlap right on {len(cases)} interval pairs (nested, touching, unsorted, empty)"


# --------------------------------------------------------------------------- 3. loss scale


def _scale_cases() -> list[list[int]]:
    return [[5, 19], [3, 9, 12], [1, 2, 8, 13], [8, 8], [7]]


def _scale(call: str, returned: object) -> float:
    """The learner's factor as a float: a Python number, a numpy scalar or a one-element tensor."""
    try:
        return float(returned)
    except (TypeError, ValueError) as error:
        raise ExerciseFailed(
            f"{call} returned {returned!r}: return one number, the factor (a Python float)"
        ) from error


@checker(
    "loss_scale",
    # the loop's loss, weighted by this rank's share of the global batch when a plan says so
    writes=("dmlbook.data_parallel.loop.ForwardBackward.loss",),
)
def check_loss_scale(fn: Callable[[list[int], int], float]) -> str:
    """Check ``fn(batches, rank)`` makes the scaled per-rank gradients, averaged over the ranks
    (the sum divided by the world size, as torch's DDP does), equal the gradient of the mean loss
    over the union batch, on a real linear model with random data."""
    g = torch.Generator().manual_seed(0)
    for batches in _scale_cases():
        total, world = sum(batches), len(batches)
        x = torch.randn(total, 3, generator=g, dtype=torch.float64)
        y = torch.randn(total, generator=g, dtype=torch.float64)
        w = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
        want = torch.autograd.grad(((x @ w - y) ** 2).mean(), w)[0]
        summed, start, scales = torch.zeros(3, dtype=torch.float64), 0, []
        for rank, b in enumerate(batches):
            call = f"your loss_scale({batches}, {rank})"
            with learner_code(call):
                returned = fn(list(batches), rank)
            scales.append(_scale(call, returned))
            part = slice(start, start + b)
            mean_loss = ((x[part] @ w - y[part]) ** 2).mean()
            summed += torch.autograd.grad(scales[-1] * mean_loss, w)[0]
            start += b
        averaged = summed / world  # the all-reduce's sum, divided by the world size
        # float32 answers are fine: a wrong factor is off by far more than 1e-6
        if torch.allclose(averaged, want, rtol=1e-6, atol=1e-9):
            continue
        mistakes = {
            "1 is plain DDP: with unequal batches a sample on a small batch weighs more than "
            "one on a large batch": [1.0] * world,
            "1 / world size divides by the world size a second time: the average over the "
            "ranks already does": [1 / world] * world,
            "1 / my batch gives every rank's samples the weight of a whole batch": [
                1 / b for b in batches
            ],
            "my batch / global batch is the factor when the gradients are SUMMED (section "
            "12.6); here the average divides their sum by the world size, so multiply by it "
            "too": [b / total for b in batches],
            "1 / global batch suits a SUMMED loss with SUMMED gradients; this loss is a mean "
            "over the rank's own samples, and the gradients are averaged": [1 / total] * world,
        }
        hint = next(
            (
                f": {why}"
                for why, v in mistakes.items()
                if all(math.isclose(s, e, rel_tol=1e-6) for s, e in zip(scales, v, strict=True))
            ),
            "",
        )
        raise ExerciseFailed(
            f"with batches {batches} your scales {[round(s, 4) for s in scales]} give an averaged "
            f"gradient {[round(v, 6) for v in averaged.tolist()]}, not the union batch's "
            f"{[round(v, 6) for v in want.tolist()]}{hint}"
        )
    return f"averaged gradients exact for {len(_scale_cases())} batch splits (equal and unequal)"
