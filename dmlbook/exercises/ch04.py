"""Checkers for chapter 4's exercises ("Bottlenecks and solutions").

1. ``check_int8_quantize``: write ``quantize(t) -> (q, scale)``, symmetric int8 quantization
   with one scale per tensor: ``q = round(t / scale)`` in [-127, 127] with ``scale = max|t| / 127``,
   so that ``q * scale`` is within ``scale / 2`` of every element
   (:mod:`dmlbook.model_parallel.efficiency.quantization` does it per output channel).
2. ``check_topk_error_feedback``: write ``compress(grad, residual, k) -> (values, indices,
   new_residual)``, top-k sparsification with error feedback: add the residual left from last
   step, send the k entries of largest *magnitude*, and keep everything not sent as the new
   residual, so that nothing is ever lost, only delayed (:mod:`dmlbook.comm.compression`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dmlbook.exercises import ExerciseFailed, checker, learner_code

__all__ = ["check_int8_quantize", "check_topk_error_feedback"]


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        ("a gradient-like tensor", 1e-3 * torch.randn(200, generator=g)),
        ("a tensor whose largest magnitude is negative", torch.tensor([-5.0, 1.0, 2.5, -0.1])),
        ("a 2-d weight matrix", torch.randn(8, 16, generator=g)),
        ("an all-zero tensor", torch.zeros(6)),
    ]


def _one_scale(name: str, scale) -> float:
    """The learner's scale as one float, or a failure that says why it is not one."""
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        raise ExerciseFailed(
            f"on {name}: scale must be ONE number for the whole tensor (max|t| / 127), got a "
            f"tensor of shape {tuple(scale.shape)}: one scale per row or channel is a different "
            "scheme (quantize_int8's per_channel); take the max over every element"
        )
    try:
        value = float(scale)
    except (TypeError, ValueError) as error:
        raise ExerciseFailed(
            f"on {name}: scale must be one number (a float, or a one-element tensor), got "
            f"{type(scale).__name__}: {error}"
        ) from None
    if not math.isfinite(value):
        raise ExerciseFailed(
            f"on {name}: scale is {value}; it must be a finite number (did you divide by zero? "
            "an all-zero tensor needs a guard)"
        )
    return value


@checker(
    "int8_quantize",
    writes=(
        "dmlbook.model_parallel.efficiency.quantization.quantize_int8",
        "dmlbook.model_parallel.efficiency.quantization.quantize_rows",
        "dmlbook.comm.compression.int8_hook",
        "torch.quantize_per_tensor",
        "torch.quantize_per_tensor_dynamic",
        "torch.quantize_per_channel",
        "torch.fake_quantize_per_tensor_affine",
        "torch.fake_quantize_per_channel_affine",
    ),
)
def check_int8_quantize(fn: Callable[[torch.Tensor], tuple[torch.Tensor, float]]) -> str:
    """Check ``fn(t) -> (q, scale)``: int8 ``q`` of t's shape, ``scale = max|t| / 127``, and
    ``q * scale`` within ``scale / 2`` of t everywhere; an all-zero t gives zeros and a positive
    scale (``0 / 0`` is NaN, which has no int8 value)."""
    for name, t in _cases():
        with learner_code(f"your quantize on {name}"):
            q, scale = fn(t.clone())
        scale = _one_scale(name, scale)
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.shape != t.shape:
            got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q)
            raise ExerciseFailed(
                f"on {name}: q must be an int8 tensor of shape {tuple(t.shape)}, got {got}"
            )
        absmax = t.abs().max().item()
        if absmax > 0 and abs(scale - absmax / 127) > 1e-6 * absmax:
            hint = ""
            if abs(scale - t.max().item() / 127) < 1e-9 * absmax:
                hint = ": that is max(t) / 127; use the largest MAGNITUDE, max(|t|)"
            raise ExerciseFailed(
                f"on {name}: scale should be max|t| / 127 = {absmax / 127:.6g}, got {scale:.6g}"
                + hint
            )
        if q.abs().max().item() > 127:
            raise ExerciseFailed(f"on {name}: q must stay in [-127, 127]")
        error = (q.float() * scale - t).abs().max().item()
        if absmax > 0 and error > scale / 2 * (1 + 1e-5):
            raise ExerciseFailed(
                f"on {name}: q * scale is {error:.3g} away from t somewhere, more than scale / 2 "
                f"= {scale / 2:.3g}. Round to the nearest integer (torch.round), do not truncate"
            )
        if absmax == 0 and q.any():
            raise ExerciseFailed(f"on {name}: a zero tensor must quantize to zeros")
        if absmax == 0 and not (math.isfinite(scale) and scale > 0):
            raise ExerciseFailed(
                f"on {name}: scale is {scale}, so t / scale is 0 / 0 = NaN, and NaN has no int8 "
                "value (what .to(torch.int8) makes of it depends on the machine). Guard the "
                "all-zero case: return zeros and a positive scale such as 1.0"
            )
    return "int8 within scale / 2 everywhere, with scale = max|t| / 127, on all 4 tensors"


@checker(
    "topk_error_feedback",
    writes=("dmlbook.comm.compression.topk_compress", "dmlbook.comm.compression.topk_hook"),
)
def check_topk_error_feedback(fn: Callable) -> str:
    """Check ``fn(grad, residual, k) -> (values, indices, new_residual)`` over 20 steps: the k
    largest-magnitude entries of grad + residual are sent, and sent + new residual always equals
    grad + old residual: what is not sent now is sent later, never dropped."""
    g = torch.Generator().manual_seed(7)
    n, k = 50, 5
    residual = torch.zeros(n)
    for step in range(20):
        grad = torch.randn(n, generator=g)
        corrected = grad + residual
        with learner_code(f"your compress at step {step}"):
            values, indices, new_residual = fn(grad.clone(), residual.clone(), k)
        indices = torch.as_tensor(indices, dtype=torch.long)
        if len(values) != k or len(indices) != k or len(set(indices.tolist())) != k:
            raise ExerciseFailed(f"step {step}: send exactly k = {k} distinct entries")
        sent = torch.zeros(n).index_put_((indices,), torch.as_tensor(values, dtype=torch.float))
        want = corrected.abs().topk(k).values.min().item()
        if corrected[indices].abs().min().item() < want - 1e-6:
            hint = ""
            if step > 0 and torch.equal(
                indices.sort().values, grad.abs().topk(k).indices.sort().values
            ):
                hint = ": you picked from grad alone. Add the residual first (error feedback)"
            elif torch.equal(indices.sort().values, corrected.topk(k).indices.sort().values):
                hint = ": you picked the largest VALUES; pick the largest magnitudes, |x|"
            raise ExerciseFailed(
                f"step {step}: the entries sent are not the {k} of largest "
                f"magnitude of grad + residual{hint}"
            )
        if not torch.allclose(sent + new_residual, corrected, atol=1e-6):
            raise ExerciseFailed(
                f"step {step}: sent + new_residual must equal grad + residual (nothing lost, only "
                "delayed); keep every entry not sent in the new residual, and zero the sent ones"
            )
        residual = new_residual
    return f"top-{k} of {n} with error feedback: 20 steps, nothing lost"
