"""Chapter 12's exercise checkers: right answers pass; planted bugs (rounding each share, rounding
down, splitting by time per sample, equal split, the remainder to the last rank, a rank left with
nothing, no ValueError; pairwise overlaps that double-count, the union, a fraction, merging
unsorted lists, each list's span, the smaller length, a merge that forgets nested intervals, a
sampled grid; plain DDP, 1 / world size, 1 / batch, batch / global batch, 1 / global batch) are
caught with a message that says so; fractional batch sizes, hard-coded sizes and non-numbers are
rejected saying why; float32 and numpy answers pass; unanswered exercises are "not attempted"."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dmlbook.advanced import speedups as pr
from dmlbook.data_parallel.loop import ForwardBackward
from dmlbook.exercises import ExerciseFailed, ch12
from dmlbook.models import Batch


def unanswered(*args):
    raise NotImplementedError


# ---- 1. proportional batches -------------------------------------------------------------------


def _checked(speeds, batch):
    if batch < len(speeds) or min(speeds) <= 0:
        raise ValueError("bad split")


def split(speeds, batch):
    """Round down, then the largest remainders; lift any zero to one."""
    _checked(speeds, batch)
    shares = [batch * s / sum(speeds) for s in speeds]
    out = [math.floor(e) for e in shares]
    for r in sorted(range(len(out)), key=lambda r: out[r] - shares[r])[: batch - sum(out)]:
        out[r] += 1
    while 0 in out:
        out[out.index(max(out))] -= 1
        out[out.index(0)] = 1
    return out


def split_rounding_each(speeds, batch):
    _checked(speeds, batch)
    return [max(1, round(batch * s / sum(speeds))) for s in speeds]


def split_rounding_down(speeds, batch):
    _checked(speeds, batch)
    return [max(1, math.floor(batch * s / sum(speeds))) for s in speeds]


def split_by_time(speeds, batch):
    return split([1 / s for s in speeds], batch)


def split_equally(speeds, batch):
    return pr.equal_batches(batch, len(speeds))


def split_leaving_zero(speeds, batch):
    _checked(speeds, batch)
    shares = [batch * s / sum(speeds) for s in speeds]
    out = [math.floor(e) for e in shares]
    for r in sorted(range(len(out)), key=lambda r: out[r] - shares[r])[: batch - sum(out)]:
        out[r] += 1
    return out


def split_without_valueerror(speeds, batch):
    return split([max(s, 1e-9) for s in speeds], max(batch, len(speeds)))


def split_remainder_to_last(speeds, batch):  # floors, then the last rank takes what is left
    _checked(speeds, batch)
    batches = [max(1, math.floor(batch * s / sum(speeds))) for s in speeds]
    batches[-1] += batch - sum(batches)
    return batches


def split_fractional(speeds, batch):  # the exact shares, not whole numbers
    _checked(speeds, batch)
    return [batch * s / sum(speeds) for s in speeds]


def split_hard_coded(speeds, batch):  # the chapter's example, whatever the input
    _checked(speeds, batch)
    return [768, 256] + [1] * (len(speeds) - 2)


def test_proportional_batches_passes_right_answers():
    assert ch12.check_proportional_batches(split).status == "passed"
    # numpy ints and whole floats are whole numbers of samples
    numpy = pytest.importorskip("numpy")
    assert ch12.check_proportional_batches(lambda s, b: numpy.array(split(s, b))).status == (
        "passed"
    )
    assert ch12.check_proportional_batches(lambda s, b: [float(x) for x in split(s, b)]).status == (
        "passed"
    )


@pytest.mark.parametrize(
    "answer, message",
    [
        (split_rounding_each, "Rounding each share on its own"),
        (split_rounding_down, "Rounding each share on its own"),
        (split_by_time, "FASTER rank should take MORE"),
        (split_equally, "equal split"),
        (split_remainder_to_last, "absorbs all the rounding error"),
        (split_leaving_zero, "at least one sample"),
        (split_without_valueerror, "raise ValueError"),
        (split_fractional, r"returned \[5\.0, 5\.0\]|a whole number of samples"),
        (split_hard_coded, "further off than rounding can go"),
    ],
)
def test_proportional_batches_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch12.check_proportional_batches(answer)


# ---- 2. overlap ----------------------------------------------------------------------------------


def _merge(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(a, b):
    return sum(max(0.0, min(ea, eb) - max(sa, sb)) for sa, ea in _merge(a) for sb, eb in _merge(b))


def overlap_pairwise(a, b):
    return sum(max(0.0, min(ea, eb) - max(sa, sb)) for sa, ea in a for sb, eb in b)


def overlap_union(a, b):
    return sum(e - s for s, e in _merge(a + b))


def overlap_fraction(a, b):
    total = sum(e - s for s, e in _merge(a))
    return overlap(a, b) / total if total else 0.0


def overlap_same_index(a, b):
    return sum(
        max(0.0, min(ea, eb) - max(sa, sb)) for (sa, ea), (sb, eb) in zip(a, b, strict=False)
    )


def overlap_merged_unsorted(a, b):  # merges as if each list were sorted by start
    def merged(intervals):
        out = []
        for start, end in intervals:
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in merged(a) for s2, e2 in merged(b))


def overlap_of_spans(a, b):  # each list as one interval, first start to last end
    def span(x):
        return [(min(s for s, _ in x), max(e for _, e in x))] if x else []

    return overlap(span(a), span(b))


def overlap_min_length(a, b):
    return min(sum(e - s for s, e in _merge(a)), sum(e - s for s, e in _merge(b)))


def overlap_forgetting_nested(a, b):  # merges, but a nested interval cuts the outer one short
    def merged(intervals):
        out = []
        for s, e in sorted(intervals):
            if out and s <= out[-1][1]:
                out[-1][1] = e
            else:
                out.append([s, e])
        return out

    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in merged(a) for s2, e2 in merged(b))


def overlap_on_a_grid(a, b, step=1e-3):  # counts grid points covered by both
    def covered(t, x):
        return any(s <= t < e for s, e in x)

    ends = [e for _, e in a + b]
    n = int(max(ends, default=0) / step) + 1
    return step * sum(covered(i * step + step / 3, a) and covered(i * step + step / 3, b)
                      for i in range(n))  # fmt: skip


def test_overlap_passes_right_answers():
    assert ch12.check_overlap(overlap).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (overlap_pairwise, "merge each list"),
        (overlap_union, "EITHER list"),
        (overlap_fraction, "a fraction"),
        (overlap_merged_unsorted, "without sorting it by start first"),
        (overlap_same_index, "expected"),
        (overlap_of_spans, "each list's span"),
        (overlap_min_length, "smaller of the two lists"),
        (overlap_forgetting_nested, "nested inside the one before"),
        (overlap_on_a_grid, "Sampling time at points"),
    ],
)
def test_overlap_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch12.check_overlap(answer)


# ---- 3. loss scale -------------------------------------------------------------------------------


def loss_scale(batches, rank):
    return len(batches) * batches[rank] / sum(batches)


def test_loss_scale_passes_the_right_answer():
    assert ch12.check_loss_scale(loss_scale).status == "passed"


def test_loss_scale_accepts_float32_and_numpy_numbers():
    numpy = pytest.importorskip("numpy")
    as_tensor = ch12.check_loss_scale(lambda b, r: torch.tensor(loss_scale(b, r)))
    assert as_tensor.status == "passed", as_tensor.message  # float32: 1e-7 off
    assert ch12.check_loss_scale(lambda b, r: numpy.float32(loss_scale(b, r))).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (lambda batches, rank: 1.0, "plain DDP"),
        (lambda batches, rank: 1 / len(batches), "a second time"),
        (lambda batches, rank: 1 / batches[rank], "weight of a whole batch"),
        (lambda batches, rank: batches[rank] / sum(batches), "gradients are SUMMED"),
        (lambda batches, rank: 2 * loss_scale(batches, rank), "not the union batch"),
        (lambda batches, rank: 1 / sum(batches), "suits a SUMMED loss"),
        (lambda batches, rank: [loss_scale(batches, rank)] * 2, "return one number"),
    ],
)
def test_loss_scale_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch12.check_loss_scale(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch12.check_proportional_batches(unanswered).status == "not attempted"
    assert ch12.check_overlap(unanswered).status == "not attempted"
    assert ch12.check_loss_scale(unanswered).status == "not attempted"


# ---- answers that only call the library: test_back_doors.py rejects each -------


def split_by_random_split(speeds, batch):
    parts = torch.utils.data.random_split(range(batch), [s / sum(speeds) for s in speeds])
    return [len(part) for part in parts]


def loss_scale_via_the_loop(batches, rank):
    """The loop's weighted loss over the plain mean loss, on a throwaway model, times the world
    size that the average divides by."""
    model = torch.nn.Linear(2, 3)
    x, y = torch.randn(batches[rank], 2), torch.randint(0, 3, (batches[rank],))
    state = SimpleNamespace(model=model, batch=SimpleNamespace(global_size=sum(batches)))
    weighted = ForwardBackward().loss(state, Batch(x, y))
    return len(batches) * (weighted / F.cross_entropy(model(x), y)).item()


DELEGATING_ANSWERS = {
    "proportional_batches": lambda speeds, batch: pr.proportional_batches(speeds, batch),
    "overlap": lambda a, b: pr.length(pr.intersection(a, b)),
    "loss_scale": loss_scale_via_the_loop,
}


def test_the_delegating_answers_are_right_with_the_library_on():
    """Each would pass if the library were not switched off: the rejection is for delegating."""
    assert pr.proportional_batches([3.0, 1.0], 8) == [6, 2]
    assert math.isclose(loss_scale_via_the_loop([5, 15], 0), 0.5, rel_tol=1e-5)
    assert DELEGATING_ANSWERS["overlap"]([(0, 4), (1, 2)], [(3, 6)]) == 1.0


def test_random_split_is_switched_off_too():
    with pytest.raises(ExerciseFailed, match="called the library instead.*random_split"):
        ch12.check_proportional_batches(split_by_random_split)
