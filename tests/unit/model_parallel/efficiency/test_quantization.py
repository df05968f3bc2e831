"""Tests for dmlbook.model_parallel.efficiency.quantization: the scale / 2 bound exactly,
per-channel vs per-tensor, bytes, and digits accuracy of fp16 / int8 models against fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmlbook.exercises import ch04
from dmlbook.model_parallel.efficiency.quantization import (
    QuantizedLinear,
    compare_on_digits,
    dequantize,
    model_bytes,
    quantization_errors,
    quantize_int8,
    quantize_model,
    train_digits_mlp,
)
from dmlbook.models import char_gpt, mlp

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits_mlp():
    return train_digits_mlp()


def _exact_error(t: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """|q * scale - t| in float64, where both the product and the difference are exact."""
    return (q.double() * scales.double() - t.double()).abs()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    with_zero_row = torch.randn(5, 7, generator=g)
    with_zero_row[2] = 0
    scale = 0.5 / 127
    return {
        "vector": torch.randn(100, generator=g),
        "linear weight": torch.randn(32, 64, generator=g) * 0.05,
        "conv weight": torch.randn(8, 3, 3, 3, generator=g),
        "a zero row": with_zero_row,
        "near half steps": torch.tensor([[0.5, 0.5 * scale, 2.5 * scale, -126.5 * scale]]),
        "tiny values": torch.randn(4, 4, generator=g) * 1e-30,
    }


# ---- one tensor --------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [True, False])
def test_round_trip_is_within_half_a_scale_everywhere(per_channel):
    for name, t in _tensors().items():
        q, scales = quantize_int8(t, per_channel=per_channel)
        assert q.dtype == torch.int8 and q.shape == t.shape, name
        assert q.abs().max() <= 127, name
        if per_channel:
            assert scales.shape == (t.shape[0],) + (1,) * (t.dim() - 1), name
            absmax = t.abs().reshape(t.shape[0], -1).amax(dim=1).reshape(scales.shape)
        else:
            assert scales.dim() == 0, name
            absmax = t.abs().max()
        assert torch.equal(scales, torch.where(absmax > 0, absmax / 127, 1.0)), name
        assert (_exact_error(t, q, scales) <= scales.double() / 2).all(), name
        back = dequantize(q, scales)
        assert back.dtype == torch.float32
        assert torch.allclose(back, t, rtol=0, atol=scales.max().item() / 2 * (1 + 1e-6)), name
    zero_q, _ = quantize_int8(_tensors()["a zero row"])
    assert not zero_q[2].any()


def test_bound_holds_exactly_where_float32_division_breaks_it():
    """A million values: dividing in float32 rounds some near-half-integers the wrong way."""
    t = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_int8(t)
    assert (_exact_error(t, q, scales) <= scales.double() / 2).all()
    naive = torch.round(t / scales).clamp(-127, 127)
    assert (_exact_error(t, naive, scales) > scales.double() / 2).any()


def test_per_tensor_matches_the_chapter_4_exercise():
    """The library's per-tensor int8 is what chapter 4's exercise asks for: its checker's
    tensors, quantized before the check (inside it the library is switched off)."""
    done = [(t, quantize_int8(t, per_channel=False)) for _, t in ch04._cases()]
    ch04.check_int8_quantize(lambda t: next(r for s, r in done if torch.equal(s, t)))


def test_per_channel_beats_per_tensor_on_uneven_rows():
    g = torch.Generator().manual_seed(1)
    row_ranges = torch.logspace(-3, 1, 16).unsqueeze(1)  # rows from 1e-3 to 10
    t = torch.randn(16, 256, generator=g) * row_ranges
    per_row = _exact_error(t, *quantize_int8(t, per_channel=True))
    per_tensor = _exact_error(t, *quantize_int8(t, per_channel=False))
    assert (per_row.amax(dim=1) <= per_tensor.amax(dim=1)).all()
    assert per_row.mean() < 0.5 * per_tensor.mean()
    # The small rows are where it matters: per tensor, the 1e-3 row is all rounded to zero.
    assert per_row[0].mean() < 0.01 * per_tensor[0].mean()
    assert not quantize_int8(t, per_channel=False)[0][0].any()


# ---- models --------------------------------------------------------------------------------------


def test_model_bytes_fp16_half_and_int8_a_quarter_plus_scales():
    model = mlp(seed=0, in_features=64, hidden=(128,), out_features=10)
    weights, outputs = 64 * 128 + 128 * 10, 128 + 10
    assert model_bytes(model) == 4 * (weights + outputs)
    assert model_bytes(quantize_model(model, torch.float16)) == model_bytes(model) / 2
    int8 = quantize_model(model, torch.int8)
    # 1 byte per weight, a float32 scale per output channel, and the float32 bias.
    assert model_bytes(int8) == weights + 4 * outputs + 4 * outputs
    assert 0.25 < model_bytes(int8) / model_bytes(model) < 0.28


def test_quantize_model_copies_and_respects_the_bounds():
    model = char_gpt(30, seed=0, n_layer=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = model.eval()(idx)
    for dtype, atol in ((torch.float16, 1e-3), (torch.int8, 2e-2)):
        quantized = quantize_model(model, dtype)
        linears = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 2 * 4 + 1  # c_attn, c_proj, c_fc, c_proj per block, and lm_head
        assert not any(isinstance(m, nn.Linear) for m in quantized.modules())
        errors = quantization_errors(model, quantized)
        assert len(errors) == 9 and all(e.within_bound for e in errors)
        assert all(e.mean_abs_error <= e.max_abs_error <= e.bound for e in errors)
        with torch.no_grad():
            assert torch.allclose(quantized(idx)[0], logits, atol=atol)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"quantize_model changed the original's {k}"


def test_digits_accuracy_barely_moves(digits_mlp):
    records = {r["dtype"]: r for r in compare_on_digits(digits_mlp)}
    assert records["float32"]["accuracy"] > 0.95
    assert records["float16"]["bytes_ratio"] == 0.5
    assert records["int8"]["bytes_ratio"] < 0.28
    for dtype in ("float16", "int8"):
        assert abs(records[dtype]["accuracy_change_points"]) <= 1.0, records[dtype]
        assert records[dtype]["within_bound"]
    assert records["float16"]["max_logit_change"] < records["int8"]["max_logit_change"]


# ---- bad inputs ----------------------------------------------------------------------------------


def _huge_linear() -> nn.Linear:
    layer = nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.fill_(1e5)  # beyond fp16's largest finite value, 65504
    return layer


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: quantize_int8(torch.arange(4)), TypeError, "floating-point"),
        (lambda: quantize_int8(torch.empty(0, 3)), ValueError, "empty"),
        (lambda: quantize_int8(torch.tensor(1.5)), ValueError, "at least one dimension"),
        (lambda: quantize_int8(torch.tensor([1.0, float("nan")])), ValueError, "inf or nan"),
        (lambda: quantize_int8(torch.tensor([float("inf")]), False), ValueError, "inf or nan"),
        (lambda: dequantize(torch.zeros(2, 3), torch.ones(2, 1)), TypeError, "int8"),
        (
            lambda: dequantize(torch.zeros(2, 3, dtype=torch.int8), torch.ones(3, 1)),
            ValueError,
            "do not fit",
        ),
        (lambda: quantize_model(mlp(), torch.bfloat16), ValueError, "float16 or torch.int8"),
        (lambda: quantize_model(nn.ReLU(), torch.int8), ValueError, "no nn.Linear"),
        (lambda: quantize_model(_huge_linear(), torch.float16), ValueError, "fp16's range"),
    ],
)
def test_bad_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call()
