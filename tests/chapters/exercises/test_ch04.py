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


def quantize_per_row(t):
    rows = t.reshape(len(t), -1) if t.dim() > 1 else t.reshape(1, -1)
    scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(rows / scales).to(torch.int8).view_as(t), scales.squeeze(1)


def quantize_without_zero_guard(t):
    scale = t.abs().max().item() / 127
    q = torch.round(t / scale).clamp(-127, 127).nan_to_num(0).to(torch.int8)
    return q, scale


def quantize_nan_scale(t):
    return quantize(t)[0], float("nan")


def test_int8_quantize_passes_the_right_answer():
    assert ch04.check_int8_quantize(quantize).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (quantize_by_max, r"max\(t\) / 127; use the largest MAGNITUDE"),
        (quantize_truncating, "Round to the nearest integer"),
        (quantize_per_row, "ONE number for the whole tensor"),
        (quantize_without_zero_guard, "Guard the all-zero case"),
        (quantize_nan_scale, "must be a finite number"),
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


# An answer for each exercise that only calls the library: test_back_doors.py
# checks that each is rejected, because the functions that do the job are switched off.
def _delegate_quantize(t):
    from dmlbook.model_parallel.efficiency import quantization

    return quantization.quantize_int8(t, per_channel=False)


def _delegate_compress(grad, residual, k):
    from dmlbook.comm import compression

    return compression.topk_compress(grad, residual, k)


DELEGATING_ANSWERS = {
    "int8_quantize": _delegate_quantize,
    "topk_error_feedback": _delegate_compress,
}


def _quantize_by_torch(t):
    scale = max(t.abs().max().item() / 127, 1e-12)
    return torch.quantize_per_tensor(t, scale, 0, torch.qint8).int_repr(), scale


def _quantize_rows(t):
    from dmlbook.model_parallel.efficiency import quantization

    q, scales = quantization.quantize_rows(t.reshape(1, -1))
    return q.view_as(t), scales.item()


def _quantize_per_channel_by_torch(t):
    flat = t.reshape(1, -1)
    scale = max(t.abs().max().item() / 127, 1e-12)
    q = torch.quantize_per_channel(flat, torch.tensor([scale]), torch.tensor([0]), 0, torch.qint8)
    return q.int_repr().view_as(t), scale


@pytest.mark.parametrize(
    "answer", [_quantize_by_torch, _quantize_rows, _quantize_per_channel_by_torch]
)
def test_other_library_quantizers_are_rejected_too(answer):
    with pytest.raises(ExerciseFailed, match="called the library instead.*switched off"):
        ch04.check_int8_quantize(answer)


def test_topk_compress_is_the_hooks_mechanism_and_passes_the_checker():
    """The library's topk_compress (what topk_hook runs) meets the exercise's contract."""
    from dmlbook.comm import compression

    g = torch.Generator().manual_seed(0)
    grad, residual = torch.randn(40, generator=g), torch.randn(40, generator=g)
    values, indices, new_residual = compression.topk_compress(grad, residual, 4)
    ours = compress(grad, residual, 4)
    assert torch.equal(indices.sort().values, ours[1].sort().values)
    assert torch.equal(new_residual, ours[2])
