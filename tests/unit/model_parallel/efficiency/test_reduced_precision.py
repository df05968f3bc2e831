"""Chapter 8's reduced precision: the int8 x int8 -> int32 linear layer (exact integer sums,
within its error bound, close to torch's dynamic quantized Linear) and the fp16 / bf16 / int8
comparison table."""

import warnings

import pytest
import torch
from torch import nn

from dmlbook.model_parallel.efficiency import reduced_precision
from dmlbook.model_parallel.efficiency.quantization import (
    Int8Linear,
    int8_matmul,
    int8_model,
    quantize_rows,
)
from dmlbook.models import char_gpt, mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer_and_input(in_features=96, out_features=40, rows=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features)
    with torch.no_grad():
        layer.weight.copy_(0.1 * torch.randn(out_features, in_features, generator=g))
        layer.bias.copy_(torch.randn(out_features, generator=g))
    scales = torch.logspace(-2, 1, rows).unsqueeze(1)  # rows of very different sizes
    return layer, scales * torch.randn(rows, in_features, generator=g)


def test_int8_matmul_sums_exactly_in_integers():
    g = torch.Generator().manual_seed(0)
    for n, k, m in ((1, 64, 10), (17, 256, 8), (33, 5, 7)):
        a = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (k, m), generator=g, dtype=torch.int8)
        out = int8_matmul(a, b)
        assert out.dtype == torch.int32
        assert torch.equal(out.long(), a.long() @ b.long())
    extreme = torch.full((2, 512), 127, dtype=torch.int8)
    assert int8_matmul(extreme, extreme.t().contiguous()).eq(512 * 127 * 127).all()


def test_quantize_rows_keeps_every_element_within_half_a_step():
    _, x = _layer_and_input()
    x[3] = 0
    q, scales = quantize_rows(x)
    assert q.dtype == torch.int8 and scales.shape == (len(x), 1) and q.abs().max() <= 127
    error = (q.double() * scales.double() - x.double()).abs()
    assert (error <= scales.double() / 2 * (1 + 1e-5)).all()
    assert not q[3].any()


def test_int8_linear_is_the_dequantized_product_within_its_bound():
    layer, x = _layer_and_input()
    ours = Int8Linear(layer)
    y = ours(x)
    x_q, x_scales = quantize_rows(x)
    x_hat = x_q.double() * x_scales.double()  # what the integers stand for
    w_hat = ours.weight_q.double() * ours.scales.double().t()
    expected = x_hat @ w_hat.t() + layer.bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-5)
    # Against the float layer: |x w - x^ w^| <= |x - x^| |w| + |x^| |w - w^| elementwise,
    # with |x - x^| <= s_x / 2 per row and |w - w^| <= s_w / 2 per output channel.
    w = layer.weight.detach().double()
    bound = (x_scales.double() / 2) * w.abs().sum(1) + x_hat.abs().sum(1, keepdim=True) * (
        ours.scales.double() / 2
    )
    error = (y.double() - layer(x).detach().double()).abs()
    assert (error <= bound * (1 + 1e-6) + 1e-5).all()
    # (N, T, C) inputs work row by row, like nn.Linear.
    torch.testing.assert_close(ours(x[:32].reshape(4, 8, -1)), y[:32].reshape(4, 8, -1))


def _torch_dynamic(layer, per_channel):
    from torch.ao.quantization import (
        default_dynamic_qconfig,
        per_channel_dynamic_qconfig,
        quantize_dynamic,
    )

    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(nn.Sequential(layer), {nn.Linear: qconfig}, dtype=torch.qint8)


@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_linear_agrees_with_torch_dynamic_quantization(per_channel):
    layer, x = _layer_and_input(rows=64)
    exact = layer(x).detach()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _torch_dynamic(layer, per_channel)(x)
    ours = Int8Linear(layer)(x)
    # Both are the float layer up to int8 rounding, so they agree to that level ...
    assert (ours - theirs).abs().max() < 0.02 * exact.abs().max()
    # ... and ours, with a scale per input row and 8-bit activations, is the closer one: torch's
    # x86 default uses one activation scale per tensor and 7 bits (reduce_range).
    assert (ours - exact).abs().mean() < (theirs - exact).abs().mean()


def test_int8_model_keeps_a_gpt_close():
    model = char_gpt(30, seed=0, n_layer=2, n_embd=32, block_size=16).eval()
    idx = torch.randint(30, (2, 16), generator=torch.Generator().manual_seed(1))
    quantized = int8_model(model)
    assert sum(isinstance(m, Int8Linear) for m in quantized.modules()) == 9
    with torch.no_grad():
        torch.testing.assert_close(quantized(idx)[0], model(idx)[0], rtol=0, atol=2e-2)


def test_compare_precisions_table():
    model = mlp(seed=0, in_features=64, hidden=(128,), out_features=10).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(50, 64, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)  # labels the fp32 model gets right by construction
    rows = {r["variant"]: r for r in reduced_precision.compare_precisions(model, x, y, rounds=1)}
    assert list(rows) == ["fp32", "fp16", "bf16", "int8 weights", "int8 (ours)", "int8 (torch)"]
    assert rows["fp32"]["accuracy"] == 1.0 and rows["fp32"]["speedup"] == 1.0
    assert 0.45 < rows["fp16"]["bytes_ratio"] < 0.6 and 0.45 < rows["bf16"]["bytes_ratio"] < 0.6
    for name in ("int8 weights", "int8 (ours)", "int8 (torch)"):
        # a quarter of the weights' bytes, plus scales and torch.save's own few kB
        assert rows[name]["bytes_ratio"] < 0.4, name
    for name, row in rows.items():
        assert row["accuracy"] >= 0.9 and row["latency_ms"] > 0, name
    # bf16 keeps 8 bits of mantissa, fp16 11: fp16's logits are the closer ones.
    assert 0 < rows["fp16"]["max_logit_change"] < rows["bf16"]["max_logit_change"] < 0.1


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="int8 operands"):
        int8_matmul(torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="cannot multiply"):
        int8_matmul(torch.ones(2, 3, dtype=torch.int8), torch.ones(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="overflow"):
        big = torch.ones(1, 200_000, dtype=torch.int8)
        int8_matmul(big, big.t())
    with pytest.raises(ValueError, match=r"floating-point \(N, K\)"):
        quantize_rows(torch.ones(3))
    with pytest.raises(ValueError, match="floating-point dtype"):
        reduced_precision.CastModel(mlp(), torch.int8)
    with pytest.raises(ValueError, match="rounds"):
        reduced_precision.compare_precisions(mlp(), torch.ones(2, 64), torch.zeros(2), rounds=0)


@pytest.mark.gpu
def test_int8_linear_on_a_gpu_matches_the_cpu():
    layer, x = _layer_and_input(in_features=128, out_features=64, rows=64)
    on_cpu = Int8Linear(layer)(x)
    on_gpu = Int8Linear(layer.cuda())(x.cuda())
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-5, atol=1e-5)


def test_arithmetic_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n")
    flags = reduced_precision.arithmetic_flags(cpuinfo)
    assert flags["avx512f"] and flags["avx512_vnni"] and not flags["avx512_bf16"]
    assert not any(reduced_precision.arithmetic_flags(tmp_path / "absent").values())
