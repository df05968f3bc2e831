"""Reducing bits for inference: fp16, bf16 and int8 against fp32, in bytes, accuracy and time.

Chapter 8 ("Achieving higher throughput and lower latency") serves a model in fewer bits.
Fewer bits per weight mean fewer bytes to store and move; whether they also mean less time
depends on whether the hardware has fast arithmetic for them. :func:`compare_precisions` measures
both on the same model and inputs:

- ``fp16`` and ``bf16``: the whole model and its inputs cast (``model.to(dtype)``). bf16 keeps
  fp32's exponent range with fewer mantissa bits; fp16 the reverse.
- ``int8 weights``: chapter 4's ``QuantizedLinear``, int8 storage dequantized to fp32 in
  forward: a quarter of the bytes, fp32 arithmetic.
- ``int8 (ours)``: ``dmlbook.model_parallel.efficiency.quantization.Int8Linear``, int8 x int8
  -> int32 products with a scale per weight row and per input row.
- ``int8 (torch)``: torch's dynamic quantization (``torch.ao.quantization.quantize_dynamic``),
  fbgemm / oneDNN int8 kernels.
"""

from __future__ import annotations

import copy
import io
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dmlbook.model_parallel.efficiency.quantization import int8_model, quantize_model

__all__ = [
    "ARITHMETIC_FLAGS",
    "CastModel",
    "arithmetic_flags",
    "compare_precisions",
    "serialized_bytes",
    "torch_dynamic_int8",
    "variants",
]

ARITHMETIC_FLAGS = {  # /proc/cpuinfo flag -> what it adds for low-precision matrix products
    "avx512f": "512-bit fp32 FMA",
    "avx512_bf16": "bf16 dot products into fp32 (2 multiply-adds per 32-bit lane)",
    "avx512_vnni": "int8 dot products into int32 (4 multiply-adds per 32-bit lane)",
    "avx512_fp16": "native fp16 arithmetic",
    "amx_bf16": "AMX bf16 tile matrix multiply",
    "amx_int8": "AMX int8 tile matrix multiply",
}


class CastModel(nn.Module):
    """``model`` held in ``dtype``: floating inputs are cast to it, outputs back to float32."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"CastModel needs a floating-point dtype, got {dtype}")
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(dtype).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            x = x.to(self.dtype)
        return self.model(x).float()


def torch_dynamic_int8(model: nn.Module) -> nn.Module:
    """torch's dynamic int8 quantization of every ``nn.Linear`` in a copy of ``model``."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear}, dtype=torch.qint8)


def serialized_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: what the model weighs on disk or the wire,
    counted the same way for every variant (torch's packed int8 weights included)."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def variants(model: nn.Module) -> dict[str, nn.Module]:
    """The fp32 model and its reduced-precision versions, by name."""
    model = copy.deepcopy(model).eval()
    return {
        "fp32": model,
        "fp16": CastModel(model, torch.float16),
        "bf16": CastModel(model, torch.bfloat16),
        "int8 weights": quantize_model(model, torch.int8),
        "int8 (ours)": int8_model(model),
        "int8 (torch)": torch_dynamic_int8(model),
    }


def arithmetic_flags(cpuinfo: str = "/proc/cpuinfo") -> dict[str, bool]:
    """Which of :data:`ARITHMETIC_FLAGS` this CPU reports (all False where the file is absent)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return {flag: flag in flags for flag in ARITHMETIC_FLAGS}


def _median_times(
    models: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for model in models.values():
            model(x)  # warm-up: first calls allocate and pack weights
        for _ in range(rounds):  # interleaved: a burst of load hits every variant alike
            for name, model in models.items():
                start = clock()
                model(x)
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def compare_precisions(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    latency_inputs: torch.Tensor | None = None,
    rounds: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    """One row per variant: serialized bytes, accuracy on ``(inputs, targets)``, the largest
    change of a logit against fp32, and the median latency of one forward on ``latency_inputs``
    (default ``inputs``) with its speed-up over fp32. CPU: these run on this machine's kernels.
    ``clock`` is wall time by default; with one intra-op thread ``time.thread_time`` leaves out
    the moments the thread waited for a core (chapter 8)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    models = variants(model)
    latency_inputs = inputs if latency_inputs is None else latency_inputs
    with torch.no_grad():
        reference = models["fp32"](inputs)
        outputs = {name: m(inputs).float() for name, m in models.items()}
    seconds = _median_times(models, latency_inputs, rounds, clock)
    rows = []
    for name, m in models.items():
        rows.append(
            {
                "variant": name,
                "bytes": serialized_bytes(m),
                "accuracy": (outputs[name].argmax(-1) == targets).float().mean().item(),
                "max_logit_change": (outputs[name] - reference).abs().max().item(),
                "latency_ms": 1e3 * seconds[name],
                "speedup": seconds["fp32"] / seconds[name],
            }
        )
    base = rows[0]["bytes"]
    for row in rows:
        row["bytes_ratio"] = row["bytes"] / base
    return rows
