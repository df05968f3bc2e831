"""Quantizing the model itself: fp16 and int8 weights, their error, size and accuracy, measured.

Chapter 4 ("Bottlenecks and solutions") lists quantization among the answers to the on-device
memory bottleneck, and chapter 8 ("Higher throughput and lower latency") reduces bits to serve a
model faster and in less memory (chapter 10 ships such a model to the edge). Here the *weights*
are quantized; :mod:`dmlbook.comm.compression` does the same to gradients on the wire.

- ``quantize_int8`` / ``dequantize``: symmetric int8, ``q = round(w / scale)`` in [-127, 127]
  with ``scale = max|w| / 127`` per output channel (row) or per tensor, so that every element
  comes back within ``scale / 2``. One outlier row only coarsens its own scale per channel.
- ``QuantizedLinear`` stores its weight as fp16 or int8 + scales and dequantizes it in forward;
  ``quantize_model`` returns a copy of a model with every ``nn.Linear`` replaced by one.
- ``quantization_errors``, ``model_bytes`` and ``compare_on_digits`` measure what it costs and
  saves: error per tensor against its bound, bytes, and accuracy on the digits task.
- ``Int8Linear`` (chapter 8) also *computes* in int8: each input row is quantized when it
  arrives (``quantize_rows``, a dynamic scale per row), ``int8_matmul`` multiplies int8 by int8
  with exact int32 sums, and one float multiply by both scales gives the output back.
  ``int8_model`` swaps it in for every ``nn.Linear``; torch's counterpart is
  ``torch.ao.quantization.quantize_dynamic``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dmlbook.datasets import load_digits
from dmlbook.models import MLP, accuracy, mlp

QMAX = 127  # symmetric int8: -128 is left out so that +-max|w| both map to +-127

# ---- int8: quantize and dequantize one tensor -------------------------------------------------


def quantize_int8(
    tensor: torch.Tensor, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: int8 ``q`` of ``tensor``'s shape and float32 scales with ``q * scales``
    within ``scales / 2`` of ``tensor`` everywhere (chapters 4 and 8).

    Per channel, ``scales`` has shape ``(C, 1, ..., 1)``: one scale per output channel (dim 0,
    the rows of a Linear weight), broadcastable against ``q``. Per tensor it is a 0-d tensor.
    """
    if not tensor.is_floating_point():
        raise TypeError(f"can only quantize floating-point tensors, got {tensor.dtype}")
    if tensor.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    if per_channel and tensor.dim() == 0:
        raise ValueError("per-channel quantization needs at least one dimension")
    if not torch.isfinite(tensor).all():
        raise ValueError("cannot quantize a tensor with inf or nan: its scale would be inf/nan")
    t = tensor.detach().float()
    if per_channel:
        absmax = t.abs().reshape(t.shape[0], -1).amax(dim=1)  # (C,): one per output channel
        absmax = absmax.reshape((-1,) + (1,) * (t.dim() - 1))  # (C, 1, ..., 1)
    else:
        absmax = t.abs().max()  # ()
    scales = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))  # zero rows: any
    # Divide in float64: a float32 quotient can land on the wrong side of a half-integer and
    # round to the farther integer; in float64 the bound |q * scale - t| <= scale / 2 is exact.
    q = torch.round(t.double() / scales.double()).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32):
    """``q * scales`` as ``dtype``: back to floating point (what a layer computes with)."""
    if q.dtype != torch.int8:
        raise TypeError(f"expected an int8 tensor, got {q.dtype}")
    if scales.dim() not in (0, q.dim()) or (scales.dim() and scales.shape[0] != q.shape[0]):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit q {tuple(q.shape)}")
    return q.to(dtype) * scales.to(dtype)


# ---- A Linear layer with quantized weight storage ---------------------------------------------


class QuantizedLinear(nn.Module):
    """``nn.Linear`` whose weight is stored as fp16 or int8 + per-row scales, dequantized in
    forward: memory shrinks 2x or ~4x, the arithmetic stays in the input's precision.

    The bias is one number per output: stored as fp16 in an fp16 layer and kept float32 in an
    int8 one (an int8 bias would need its own scale for little gain).
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if dtype == torch.float16:
            if weight.abs().max() > torch.finfo(torch.float16).max:
                raise ValueError("weights beyond fp16's range (65504) would become inf")
            self.register_buffer("weight_q", weight.half())
            self.scales = None
            bias_dtype = torch.float16
        elif dtype == torch.int8:
            q, scales = quantize_int8(weight, per_channel=True)
            self.register_buffer("weight_q", q)  # (out, in) int8
            self.register_buffer("scales", scales)  # (out, 1) float32
            bias_dtype = torch.float32
        else:
            raise ValueError(f"dtype must be torch.float16 or torch.int8, got {dtype}")
        bias = None if linear.bias is None else linear.bias.detach().to(bias_dtype)
        self.register_buffer("bias", bias)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with: the stored one, dequantized to ``dtype``."""
        if self.scales is None:
            return self.weight_q.to(dtype)
        return dequantize(self.weight_q, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight(x.dtype), bias)  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, stored as {self.weight_q.dtype}"


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` replaced by ``make(linear)``."""
    quantized = copy.deepcopy(model)
    linears = [(name, m) for name, m in quantized.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantize")
    for name, linear in linears:
        parent, _, child = name.rpartition(".")
        owner = quantized.get_submodule(parent) if parent else quantized
        setattr(owner, child, make(linear))
    return quantized.eval()


def quantize_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` a ``QuantizedLinear`` storing ``dtype``
    weights; other layers (embeddings, norms) are copied unchanged. The original is untouched."""
    if dtype not in (torch.float16, torch.int8):
        raise ValueError(f"dtype must be torch.float16 or torch.int8, got {dtype}")
    return _replace_linears(model, lambda linear: QuantizedLinear(linear, dtype))


# ---- Computing in int8: integer matmul, dynamic activation scales (chapter 8) -------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: each row of ``x`` (N, K) as symmetric int8 with its own scale, chosen at
    run time from the row's largest magnitude ("dynamic" quantization): ``scales`` is (N, 1)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"expected a floating-point (N, K) matrix, got {x.dtype} {tuple(x.shape)}")
    absmax = x.detach().abs().amax(dim=1, keepdim=True).float()  # (N, 1)
    scales = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))  # zero rows: any
    q = torch.round(x.float() / scales).clamp_(-QMAX, QMAX).to(torch.int8)  # (N, K)
    return q, scales


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 ``a`` (N, K) times int8 ``b`` (K, M) -> int32 (N, M), summed exactly in integers.

    ``torch._int_mm`` is torch's int8 GEMM (the VNNI / IMMA instructions where the hardware has
    them). A CUDA GPU runs it only for N > 16 and K, M multiples of 8; other shapes use a float64
    product, which is exact too (every partial sum is an integer below 2^53).
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul needs int8 operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    if a.shape[1] * QMAX * QMAX >= 2**31:
        raise ValueError(f"K = {a.shape[1]} products of int8 could overflow an int32 sum")
    n, k = a.shape
    if a.is_cuda and not (n > 16 and k % 8 == 0 and b.shape[1] % 8 == 0):
        return (a.double() @ b.double()).to(torch.int32)
    return torch._int_mm(a, b)  # int8 x int8 -> int32 accumulate


class Int8Linear(nn.Module):
    """``nn.Linear`` that multiplies in integers: int8 weights (one scale per output channel)
    times int8 activations (one scale per input row, found at run time), int32 sums, and one
    float multiply by both scales at the end: ``y = (x_q @ w_q^T) * s_x * s_w^T + b``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight.detach(), per_channel=True)
        self.register_buffer("weight_q", q)  # (out, in) int8
        self.register_buffer("scales", scales.reshape(1, -1))  # (1, out) float32
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        x_q, x_scales = quantize_rows(rows)  # (N, in) int8, (N, 1)
        acc = int8_matmul(x_q, self.weight_q.t())  # (N, out) int32: exact integer sums
        y = acc.float() * x_scales * self.scales  # back to real units: s_x (row) * s_w (column)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, int8 x int8 -> int32"


def int8_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` an :class:`Int8Linear`."""
    return _replace_linears(model, Int8Linear)


# ---- Measuring: error, bytes, accuracy ----------------------------------------------------------


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (int8 weights, scales, biases...), each
    storage counted once."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _fp16_half_spacing(values: torch.Tensor) -> torch.Tensor:
    """Per element, half the gap between fp16 neighbours of its fp16 value: the rounding bound."""
    mag = values.half().abs()
    up = torch.nextafter(mag, torch.full_like(mag, float("inf")))
    down = torch.nextafter(mag, torch.zeros_like(mag))
    gap = torch.where(torch.isinf(up), mag.double() - down.double(), up.double() - mag.double())
    return gap / 2


@dataclass
class TensorError:
    """How far one quantized weight is from the original, against the bound it must respect."""

    name: str
    max_abs_error: float
    mean_abs_error: float
    bound: float  # the largest per-element bound: scale / 2 (int8), half an fp16 step (fp16)
    within_bound: bool  # every element within its own bound (its row's scale / 2 for int8)


def quantization_errors(model: nn.Module, quantized: nn.Module) -> list[TensorError]:
    """Per ``QuantizedLinear`` of ``quantized``: its stored weight against ``model``'s original,
    computed in float64, where int8 * scale and its difference to the weight are exact."""
    originals = dict(model.named_modules())
    errors = []
    for name, layer in quantized.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        weight = originals[name].weight.detach().double()
        error = (layer.weight(torch.float64) - weight).abs()
        if layer.scales is None:
            bound = _fp16_half_spacing(weight)
        else:
            bound = (layer.scales.double() / 2).expand_as(weight)
        errors.append(
            TensorError(
                name=f"{name}.weight",
                max_abs_error=error.max().item(),
                mean_abs_error=error.mean().item(),
                bound=bound.max().item(),
                within_bound=bool((error <= bound).all()),
            )
        )
    return errors


def train_digits_mlp(
    steps: int = 150, hidden: int | Sequence[int] = 128, seed: int = 0, lr: float = 1e-2
) -> MLP:
    """An MLP trained full-batch with Adam on the digits train split: about 97% test accuracy
    in a second on a laptop CPU, and deterministic for a given seed. ``hidden`` is one width or
    a sequence of them (chapter 8 trains a (256, 256) teacher)."""
    x, y = load_digits("train")
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    model = mlp(seed=seed, in_features=64, hidden=widths, out_features=10)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


def compare_on_digits(model: nn.Module | None = None) -> list[dict]:
    """fp32 vs fp16 vs int8 weights of a digits MLP: bytes, test accuracy, logit change, error."""
    model = train_digits_mlp() if model is None else model.eval()
    x, y = load_digits("test")
    with torch.no_grad():
        logits = model(x)
    base_bytes, base_acc = model_bytes(model), accuracy(model, x, y)
    records = [{"dtype": "float32", "bytes": base_bytes, "bytes_ratio": 1.0, "accuracy": base_acc}]
    for dtype in (torch.float16, torch.int8):
        quantized = quantize_model(model, dtype)
        with torch.no_grad():
            change = (quantized(x) - logits).abs().max().item()
        acc = accuracy(quantized, x, y)
        errors = quantization_errors(model, quantized)
        records.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": model_bytes(quantized),
                "bytes_ratio": model_bytes(quantized) / base_bytes,
                "accuracy": acc,
                "accuracy_change_points": 100 * (acc - base_acc),
                "max_logit_change": change,
                "max_weight_error": max(e.max_abs_error for e in errors),
                "within_bound": all(e.within_bound for e in errors),
            }
        )
    return records
