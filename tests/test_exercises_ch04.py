"""Chapter 4's exercise checkers: right answers pass; planted bugs (max instead of max |.|,
truncation instead of rounding, no error feedback, largest values instead of magnitudes, a lost
residual) are caught with a message that says so."""

import pytest
import torch

from dmlbook.exercises import ExerciseFailed, ch04


def unanswered(*args):
    raise NotImplementedError


def quantize(t):
    scale = t.abs().max().item() / 127
    if scale == 0:
        return torch.zeros_like(t, dtype=torch.int8), 1.0
    return torch.round(t / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_by_max(t):
    scale = max(t.max().item() / 127, 1e-12)
    return torch.round(t / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_truncating(t):
    scale = max(t.abs().max().item() / 127, 1e-12)
    return (t / scale).to(torch.int8), scale


def test_int8_quantize_passes_the_right_answer():
    assert ch04.check_int8_quantize(quantize).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (quantize_by_max, r"max\(t\) / 127; use the largest MAGNITUDE"),
        (quantize_truncating, "Round to the nearest integer"),
    ],
)
def test_int8_quantize_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch04.check_int8_quantize(answer)


def compress(grad, residual, k):
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    values = corrected[indices]
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return values, indices, new_residual


def compress_without_feedback(grad, residual, k):
    indices = grad.abs().topk(k).indices
    new_residual = grad.clone()
    new_residual[indices] = 0
    return grad[indices], indices, new_residual


def compress_largest_values(grad, residual, k):
    corrected = grad + residual
    indices = corrected.topk(k).indices
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return corrected[indices], indices, new_residual


def compress_forgets_the_residual(grad, residual, k):
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    return corrected[indices], indices, torch.zeros_like(grad)


def test_topk_passes_the_right_answer():
    assert ch04.check_topk_error_feedback(compress).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (compress_without_feedback, "Add the residual first"),
        (compress_largest_values, "largest VALUES"),
        (compress_forgets_the_residual, "keep every entry not sent in the new residual"),
    ],
)
def test_topk_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch04.check_topk_error_feedback(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch04.check_int8_quantize(unanswered).status == "not attempted"
    assert ch04.check_topk_error_feedback(unanswered).status == "not attempted"
