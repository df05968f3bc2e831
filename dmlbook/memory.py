"""How much memory one training step of a transformer needs, predicted and then measured.

Chapter 5 ("Splitting the model") starts from an out-of-memory error: a model that will not train
on one device. Four things fill the device: the **parameters**, their **gradients**, the
**optimizer state** (nothing for SGD, one buffer for momentum, two for Adam) and the
**activations** that backward needs, which grow with batch and sequence length. The estimator
counts each one op by op, the way this PyTorch build saves tensors for backward, so that it can be
checked against our char-GPT on a CPU to within a few percent:

- ``TransformerSpec`` describes a BERT- or GPT-style model; ``BERT_TINY`` ... ``GPT2_XL`` are the
  published sizes and ``spec_of`` reads one off a ``CharGPT``.
- ``estimate`` predicts every component (per layer, per pipeline stage with ``stages=``, with
  recomputation or in bf16), ``largest_batch`` the biggest batch that fits a device, and
  ``block_saved_terms`` lists what one transformer block saves, tensor by tensor.
- ``measure`` runs a real step of a ``CharGPT`` and measures the same components: parameter,
  gradient and optimizer-state bytes as allocated, saved activations with
  :class:`dmlbook.recompute.SavedTensorMeter`, and the allocator's peak (``cpu_peak_bytes`` reads
  it from the profiler on a CPU, :func:`dmlbook.recompute.cuda_peak_bytes` on a GPU);
  ``measure_stage`` does it for one rank's stage of a model split over ranks.
- ``memory_cap`` turns a rank into a small device: past its budget, an allocation raises
  ``torch.OutOfMemoryError``, and the notebook that launched the rank is never at risk.
- ``korthikanti_bytes`` is the published per-layer formula (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models"): s b h (34 + 5 a s / h) bytes in fp16
  with dropout and an explicit softmax; ``estimate`` reproduces it in that setting exactly.
- ``layer_gemm_flops`` counts the matrix multiplies (D = A x B + C) of one layer, the work that
  Tensor Cores do, and ``GPUS`` / ``DGX1_NVLINK`` hold the hardware table of the chapter.
"""

from __future__ import annotations

import copy
import ctypes
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from dmlbook import pipeline
from dmlbook.launch import INSIDE_RUN
from dmlbook.models import CharGPT
from dmlbook.recompute import (
    SavedTensorMeter,
    checkpoint_segment,
    cuda_peak_bytes,
    layer_chain,
    split_segments,
    sqrt_segments,
)

__all__ = [
    "BERT_BASE",
    "BERT_LARGE",
    "BERT_TINY",
    "DGX1_NVLINK",
    "GPT2_LARGE",
    "GPT2_MEDIUM",
    "GPT2_SMALL",
    "GPT2_XL",
    "GPU",
    "GPUS",
    "PRESETS",
    "LayerMemory",
    "MemoryEstimate",
    "MemoryMeasurement",
    "TransformerSpec",
    "block_saved_terms",
    "count_parameters",
    "cpu_peak_bytes",
    "estimate",
    "estimate_stages",
    "format_bytes",
    "korthikanti_bytes",
    "largest_batch",
    "layer_gemm_flops",
    "make_optimizer",
    "measure",
    "measure_stage",
    "measure_step",
    "memory_cap",
    "onednn_disabled",
    "spec_of",
    "state_bytes_per_parameter",
]

PRECISIONS = ("fp32", "bf16", "mixed")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam")
ATTENTIONS = ("fused", "math")
DEVICES = ("cpu", "cuda")
COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations", "transient")  # of a step

# ---- What a model is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerSpec:
    """The sizes that decide a BERT- or GPT-style transformer's memory (chapter 5)."""

    name: str
    vocab_size: int  # tokens (characters for our char-GPT, WordPiece / BPE pieces for BERT / GPT-2)
    max_positions: int  # longest sequence: learned position embeddings (block_size)
    n_layer: int  # transformer blocks
    d_model: int  # width of the residual stream (h)
    n_head: int  # attention heads (a)
    d_ff: int  # width of the feed-forward layer (4 h in BERT and GPT)
    kind: Literal["encoder", "decoder"]  # BERT: bidirectional encoder; GPT: causal decoder
    head: Literal["lm", "mlm", "classifier"] = "lm"  # next-token LM, masked LM, or [CLS] classifier
    tied_embeddings: bool = False  # the output layer reuses the token embedding (GPT-2, BERT MLM)
    dropout: float = 0.1  # dropout probability; > 0 saves a mask per dropout for backward
    bias: bool = True  # biases in the Linear and LayerNorm layers
    token_types: int = 0  # BERT's segment embeddings (2); 0 for GPT
    num_labels: int = 2  # classes of the classifier head

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_positions", "n_layer", "d_model", "n_head", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")
        if self.kind not in ("encoder", "decoder"):
            raise ValueError(f"kind must be 'encoder' or 'decoder', got {self.kind!r}")
        if self.head not in ("lm", "mlm", "classifier"):
            raise ValueError(f"head must be 'lm', 'mlm' or 'classifier', got {self.head!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def _bert(name: str, n_layer: int, d_model: int, n_head: int) -> TransformerSpec:
    """BERT (Devlin et al. 2019) fine-tuned for classification: WordPiece vocabulary of 30522,
    512 positions, 2 segment types, pooler + classifier head, d_ff = 4 d_model."""
    return TransformerSpec(
        name, 30522, 512, n_layer, d_model, n_head, 4 * d_model, "encoder", "classifier",
        token_types=2,
    )  # fmt: skip


def _gpt2(name: str, n_layer: int, d_model: int, n_head: int) -> TransformerSpec:
    """GPT-2 (Radford et al. 2019): byte-level BPE of 50257, 1024 positions, tied output layer."""
    return TransformerSpec(
        name, 50257, 1024, n_layer, d_model, n_head, 4 * d_model, "decoder", "lm",
        tied_embeddings=True,
    )  # fmt: skip


BERT_TINY = _bert("BERT-Tiny", 2, 128, 2)  # Turc et al. 2019, "Well-Read Students Learn Better"
BERT_BASE = _bert("BERT-base", 12, 768, 12)
BERT_LARGE = _bert("BERT-large", 24, 1024, 16)
GPT2_SMALL = _gpt2("GPT-2 small", 12, 768, 12)
GPT2_MEDIUM = _gpt2("GPT-2 medium", 24, 1024, 16)
GPT2_LARGE = _gpt2("GPT-2 large", 36, 1280, 20)
GPT2_XL = _gpt2("GPT-2 XL", 48, 1600, 25)
PRESETS = (BERT_TINY, BERT_BASE, BERT_LARGE, GPT2_SMALL, GPT2_MEDIUM, GPT2_LARGE, GPT2_XL)


def spec_of(model: CharGPT) -> TransformerSpec:
    """Our char-GPT as a ``TransformerSpec``: a decoder with an untied, bias-free ``lm_head``."""
    if not isinstance(model, CharGPT):
        raise TypeError(f"spec_of reads a CharGPT, got {type(model).__name__}")
    c = model.config
    return TransformerSpec(
        f"char-GPT {c.n_layer}x{c.n_embd}", c.vocab_size, c.block_size, c.n_layer, c.n_embd,
        c.n_head, 4 * c.n_embd, "decoder", "lm", dropout=c.dropout, bias=c.bias,
    )  # fmt: skip


# ---- Bytes per number, by precision -------------------------------------------------------------


@dataclass(frozen=True)
class _Bytes:
    """Bytes per element of each kind of tensor a step keeps, for one precision."""

    param: int  # weights as the model holds them (the fp32 master copy in mixed precision)
    act: int  # matmul inputs, q/k/v, GELU: what the compute dtype makes
    residual: int  # the residual stream and LayerNorm inputs (fp32 under autocast)
    stats: int  # LayerNorm mean and 1/std per token
    loss: int  # log-softmax output of the cross-entropy (fp32 under autocast)
    weight_copy: int  # autocast's low-precision copy of each Linear weight, saved for backward


_BYTES = {
    "fp32": _Bytes(param=4, act=4, residual=4, stats=4, loss=4, weight_copy=0),
    "bf16": _Bytes(param=2, act=2, residual=2, stats=2, loss=2, weight_copy=0),
    # torch.autocast(bfloat16): fp32 weights, gradients and optimizer state; matmuls in bf16 on
    # bf16 copies of their inputs and weights; LayerNorm, residual adds and the loss in fp32.
    "mixed": _Bytes(param=4, act=2, residual=4, stats=4, loss=4, weight_copy=2),
}
LSE_BYTES = 4  # fused attention keeps one fp32 log-sum-exp per (batch, head, query) in any dtype
INDEX_BYTES = 8  # token ids, positions and targets are int64
ADAM_STEP_BYTES = 4  # torch's Adam keeps its step count as a float32 scalar tensor per parameter


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def state_bytes_per_parameter(precision: str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Bytes per parameter of weights, gradients and optimizer state (Adam's step count aside).

    Mixed precision costs 16 bytes with Adam either way one counts it: torch's autocast keeps
    fp32 weights (4), fp32 gradients (4) and two fp32 moments (8); the ZeRO paper's accounting
    (Rajbhandari et al. 2020) has fp16 weights and gradients (2 + 2) and an fp32 master copy plus
    two moments (12).
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    per = _BYTES[precision].param
    buffers = {"sgd": 0, "sgd_momentum": 1, "adam": 2}[optimizer]  # momentum; Adam: m and v
    return {"parameters": per, "gradients": per, "optimizer_state": buffers * per}


# ---- Parameters, layer by layer -----------------------------------------------------------------


@dataclass(frozen=True)
class _Params:
    numel: int  # scalars
    tensors: int  # parameter tensors (Adam keeps a step count for each)
    linear_weights: int  # scalars in Linear weights (mixed precision saves a bf16 copy of each)


def _linear(spec: TransformerSpec, fan_in: int, fan_out: int, bias: bool | None = None) -> _Params:
    bias = spec.bias if bias is None else bias
    return _Params(fan_in * fan_out + (fan_out if bias else 0), 1 + bias, fan_in * fan_out)


def _norm(spec: TransformerSpec) -> _Params:
    return _Params(spec.d_model * (1 + spec.bias), 1 + spec.bias, 0)


def _total(*parts: _Params) -> _Params:
    return _Params(
        *(sum(getattr(p, f) for p in parts) for f in ("numel", "tensors", "linear_weights"))
    )


def _block_params(spec: TransformerSpec) -> _Params:
    h, f = spec.d_model, spec.d_ff
    return _total(
        _norm(spec), _linear(spec, h, 3 * h), _linear(spec, h, h),  # attention: qkv, projection
        _norm(spec), _linear(spec, h, f), _linear(spec, f, h),  # feed-forward
    )  # fmt: skip


def _embed_params(spec: TransformerSpec) -> _Params:
    h = spec.d_model
    tables = (spec.vocab_size + spec.max_positions + spec.token_types) * h
    parts = [_Params(tables, 2 + (spec.token_types > 0), 0)]
    if spec.kind == "encoder":
        parts.append(_norm(spec))  # BERT normalises the summed embeddings
    return _total(*parts)


def _head_params(spec: TransformerSpec) -> _Params:
    h = spec.d_model
    if spec.head == "classifier":  # BERT: pooler (dense + tanh on [CLS]), then the classifier
        return _total(_linear(spec, h, h), _linear(spec, h, spec.num_labels))
    tied = spec.tied_embeddings
    out = _Params(0, 0, spec.vocab_size * h) if tied else _linear(spec, h, spec.vocab_size, False)
    if spec.head == "lm":  # GPT: final LayerNorm, then the output layer over the vocabulary
        return _total(_norm(spec), out)
    bias = _Params(spec.vocab_size, 1, 0) if tied else _Params(0, 0, 0)  # BERT's MLM decoder bias
    return _total(_linear(spec, h, h), _norm(spec), out, bias)  # transform, LayerNorm, decoder


def count_parameters(spec: TransformerSpec) -> int:
    """Parameters of the whole model (tied weights counted once)."""
    return sum(p.numel for p in _layer_params(spec))


def _layer_params(spec: TransformerSpec) -> list[_Params]:
    return [_embed_params(spec), *[_block_params(spec)] * spec.n_layer, _head_params(spec)]


# ---- Activations: what each op saves for backward -----------------------------------------------


def _stats_bytes(precision: str, device: str) -> int:
    """LayerNorm's mean and 1/std: fp32 on CUDA whatever the input; the input's dtype on a CPU."""
    return 4 if device == "cuda" else _BYTES[precision].stats


def _mask_bytes(tensor_bytes: int, device: str) -> int:
    """A dropout mask: a bool per element on CUDA; on the CPU, torch saves a float noise tensor
    of the input's dtype."""
    return 1 if device == "cuda" else tensor_bytes


def block_saved_terms(
    spec: TransformerSpec,
    batch: int,
    seq: int,
    precision: str = "fp32",
    attention: str | None = None,
    device: str = "cpu",
) -> dict[str, int]:
    """Bytes one transformer block saves for backward, tensor by tensor (the same for pre-LN GPT
    blocks and post-LN BERT blocks: each saves two LayerNorm inputs and four matmul inputs).

    ``attention="fused"`` is ``scaled_dot_product_attention``'s flash / memory-efficient kernel:
    it keeps q, k, v, the output and one log-sum-exp per query, never the s x s scores.
    ``"math"`` is the explicit softmax(q k^T) v of the original BERT and GPT-2 code (and torch's
    path on a CPU when attention dropout is on), which keeps the scores.
    """
    attention = _attention(spec, attention, device)
    b, s, h, f, a = batch, seq, spec.d_model, spec.d_ff, spec.n_head
    by = _BYTES[precision]
    tokens, scores = b * s, b * a * s * s
    terms = {
        "LayerNorm inputs (2)": 2 * tokens * h * by.residual,
        "LayerNorm mean and 1/std (2)": 2 * 2 * tokens * _stats_bytes(precision, device),
        "qkv and fc inputs (LayerNorm outputs)": 2 * tokens * h * by.act,
    }
    if attention == "fused":
        terms["q, k, v"] = 3 * tokens * h * by.act
        terms["attention output (= projection input)"] = tokens * h * by.act
        terms["attention log-sum-exp"] = b * a * s * LSE_BYTES
    else:
        # On a CPU, torch's math attention computes in fp32 whatever the input dtype.
        inner = 4 if device == "cpu" else by.act
        terms["q, k (scaled copies)"] = 2 * tokens * h * inner
        terms["softmax(q k^T) scores"] = scores * inner
        if spec.dropout > 0:
            terms["attention dropout mask"] = scores * _mask_bytes(inner, device)
            terms["dropped-out scores"] = scores * inner
        terms["v (contiguous copy)"] = tokens * h * inner
        terms["attention output, heads merged (projection input)"] = tokens * h * by.act
    terms["GELU input"] = tokens * f * by.act
    terms["GELU output (second matmul input)"] = tokens * f * by.act
    if spec.dropout > 0:
        terms["dropout masks after attention and MLP"] = (
            2 * tokens * h * _mask_bytes(by.act, device)
        )
    if by.weight_copy:
        terms["bf16 copies of the weights"] = _block_params(spec).linear_weights * by.weight_copy
    return terms


def _embed_saved(spec: TransformerSpec, b: int, s: int, precision: str, device: str) -> int:
    by = _BYTES[precision]
    saved = INDEX_BYTES * (b * s + s)  # token ids for the embedding's backward; positions
    if spec.token_types:
        saved += INDEX_BYTES * b * s  # segment ids
    if spec.kind == "encoder":
        saved += b * s * (spec.d_model * by.residual + 2 * _stats_bytes(precision, device))
    if spec.dropout > 0:
        saved += b * s * spec.d_model * _mask_bytes(by.residual, device)
    return saved


def _head_saved(spec: TransformerSpec, b: int, s: int, precision: str, device: str) -> int:
    by = _BYTES[precision]
    h, tokens = spec.d_model, b * s
    copies = _head_params(spec).linear_weights * by.weight_copy
    if spec.head == "classifier":
        # The pooler reads [CLS] as a view of the last hidden states, which keeps them all alive;
        # then tanh, dropout and the classifier on (b, h); the loss on (b, labels).
        pooled = b * h * (2 * by.act + (_mask_bytes(by.act, device) if spec.dropout else 0))
        return (
            tokens * h * by.act + pooled + b * spec.num_labels * by.loss + INDEX_BYTES * b + copies
        )
    loss = tokens * spec.vocab_size * by.loss + INDEX_BYTES * tokens + by.loss  # + total weight
    stats = 2 * tokens * _stats_bytes(precision, device)
    if spec.head == "lm":  # final LayerNorm (input, stats), output layer input, log-softmax
        return tokens * h * (by.residual + by.act) + stats + loss + copies
    # MLM: dense input, GELU input, LayerNorm input and stats, decoder input, log-softmax
    return 4 * tokens * h * by.act + stats + loss + copies


def _transient(
    spec: TransformerSpec, b: int, s: int, precision: str, head_saved: int | None = None
) -> int:
    """Bytes held during backward but never saved, at their peak.

    Backward through the last block's feed-forward holds the gradient of the residual stream,
    the gradients of the GELU output and input (d_ff wide) and a weight-sized gradient before it
    is added into ``.grad``, while the GELU output and, on the last stage, the head's saved
    tensors are already freed. At the very start of backward, the last stage instead holds the
    gradients of the log-softmax output and of the logits. An earlier pipeline stage
    (``head_saved=None``) also keeps its output and the gradient that comes back for it. (A loop
    that keeps the logits, ``logits, loss = model(x, y)``, holds one more logits-sized tensor.)
    """
    by = _BYTES[precision]
    tokens, h, f = b * s, spec.d_model, spec.d_ff
    feed_forward = (
        tokens * h * by.residual + tokens * f * by.act + h * f * (by.param + by.weight_copy)
    )
    if head_saved is None:
        return tokens * h * by.residual + feed_forward  # + the stage's output
    outputs = b * spec.num_labels if spec.head == "classifier" else tokens * spec.vocab_size
    return max(2 * outputs * by.loss, feed_forward - head_saved)


def _attention(spec: TransformerSpec, attention: str | None, device: str) -> str:
    """The attention path torch takes unless told: on a CPU, attention dropout needs the math
    path; otherwise, and always on CUDA, a fused kernel."""
    _check_choice("device", device, DEVICES)
    if attention is None:
        return "math" if device == "cpu" and spec.dropout > 0 else "fused"
    _check_choice("attention", attention, ATTENTIONS)
    return attention


# ---- The estimate -------------------------------------------------------------------------------


@dataclass
class LayerMemory:
    """One layer's share: the embedding, a transformer block or the head."""

    name: str
    parameters: int  # bytes
    gradients: int
    optimizer_state: int
    activations: int  # bytes saved for backward during the step (no recomputation)
    checkpoint_input: int = 0  # bytes a checkpointed segment starting here keeps (its input)


@dataclass
class MemoryEstimate:
    """Predicted bytes of one device for one training step (chapter 5).

    ``total`` is the peak: weights, gradients (held through the step, as with
    ``zero_grad(set_to_none=False)`` or gradient accumulation), optimizer state, activations at
    their peak, and the transient gradients that backward holds at its peak (never saved).
    """

    spec: TransformerSpec
    batch: int
    seq: int
    precision: str
    optimizer: str
    layers: list[LayerMemory]
    activations: int  # peak bytes saved for backward (with recomputation: the peak of the rerun)
    transient: int
    recompute_segments: int | None = None
    stage: int | None = None  # which pipeline stage this device is, when split
    stages: list[MemoryEstimate] = field(default_factory=list, repr=False)

    @property
    def parameters(self) -> int:
        return sum(layer.parameters for layer in self.layers)

    @property
    def gradients(self) -> int:
        return sum(layer.gradients for layer in self.layers)

    @property
    def optimizer_state(self) -> int:
        return sum(layer.optimizer_state for layer in self.layers)

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer_state + self.activations
            + self.transient
        )  # fmt: skip

    def components(self) -> dict[str, int]:
        """The five parts of ``total``, by name."""
        return {name: getattr(self, name) for name in COMPONENTS}

    def fits(self, device_bytes: float) -> bool:
        """Whether the step's peak fits in ``device_bytes`` (leave room for the CUDA context)."""
        return self.total <= device_bytes

    def __str__(self) -> str:
        where = f", stage {self.stage}" if self.stage is not None else ""
        extra = f", recompute {self.recompute_segments} segments" if self.recompute_segments else ""
        lines = [
            f"{self.spec.name}: batch {self.batch} x seq {self.seq}, {self.precision}, "
            f"{self.optimizer}{extra}{where}"
        ]
        for name, nbytes in self.components().items():
            lines.append(f"  {name:16s} {format_bytes(nbytes):>10s}")
        lines.append(f"  {'total':16s} {format_bytes(self.total):>10s}")
        return "\n".join(lines)


def format_bytes(nbytes: float) -> str:
    """``1.5 GB``, ``12.3 MB``: decimal units, as GPU datasheets print them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _layer_rows(
    spec: TransformerSpec, b: int, s: int, precision: str, optimizer: str, attention, device: str
) -> list[LayerMemory]:
    per = state_bytes_per_parameter(precision, optimizer)
    block = sum(block_saved_terms(spec, b, s, precision, attention, device).values())
    saved = [
        _embed_saved(spec, b, s, precision, device),
        *[block] * spec.n_layer,
        _head_saved(spec, b, s, precision, device),
    ]
    names = ["embed", *(f"block {i}" for i in range(spec.n_layer)), "head"]
    rows = []
    for name, params, act in zip(names, _layer_params(spec), saved, strict=True):
        steps = ADAM_STEP_BYTES * params.tensors if optimizer == "adam" else 0
        rows.append(
            LayerMemory(
                name,
                params.numel * per["parameters"],
                params.numel * per["gradients"],
                params.numel * per["optimizer_state"] + steps,
                act,
                checkpoint_input=b * s * spec.d_model * _BYTES[precision].residual,
            )
        )
    return rows


def _activation_peak(rows: Sequence[LayerMemory], segments: int | None) -> int:
    """Peak saved bytes of layers run in order; with ``segments``, the blocks among them are
    checkpointed as :func:`dmlbook.recompute.checkpoint_sequential` does (the last segment runs
    plainly), so the peak is the larger of the forward's and each segment's rerun in backward."""
    blocks = [i for i, r in enumerate(rows) if r.name.startswith("block")]
    if not segments or not blocks:
        return sum(r.activations for r in rows)
    before = sum(r.activations for r in rows[: blocks[0]])  # embedding, on the first stage
    after = sum(r.activations for r in rows[blocks[-1] + 1 :])  # head, on the last stage
    cuts = [[rows[blocks[0] + i] for i in cut] for cut in split_segments(len(blocks), segments)]
    held, peaks = before, []
    for cut in cuts[:-1]:
        held += cut[0].checkpoint_input  # the segment keeps only its input ...
        # ... and in backward reruns its layers, whose first saved tensor is that same input.
        peaks.append(held + sum(r.activations for r in cut) - cut[0].checkpoint_input)
    forward = held + sum(r.activations for r in cuts[-1]) + after
    return max([forward, *peaks])


def _validate(batch: int, seq: int, spec: TransformerSpec) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq must be an integer >= 1, got {seq!r}")
    if seq > spec.max_positions:
        raise ValueError(f"seq={seq} exceeds {spec.name}'s {spec.max_positions} positions")


def _segments(recompute: bool | int, n_blocks: int) -> int | None:
    if recompute is False or recompute == 0 or n_blocks == 0:
        return None
    if recompute is True:
        return sqrt_segments(n_blocks)
    if not isinstance(recompute, int) or recompute < 1:
        raise ValueError(
            f"recompute must be False, True or a number of segments, got {recompute!r}"
        )
    return min(recompute, n_blocks)


def estimate_stages(
    spec: TransformerSpec,
    batch: int,
    seq: int | None = None,
    stages: int = 2,
    counts: Sequence[int] | None = None,
    precision: str = "fp32",
    optimizer: str = "adam",
    recompute: bool | int = False,
    attention: str | None = None,
    device: str = "cpu",
) -> list[MemoryEstimate]:
    """One estimate per pipeline stage when the layers ``[embed, block 0, ..., head]`` are cut
    into ``counts`` consecutive groups (default: ``pipeline.even_partition``), as vanilla model
    parallelism runs them: one micro-batch in flight.
    ``recompute`` checkpoints each stage's own blocks (``True``: sqrt(blocks) segments)."""
    seq = spec.max_positions if seq is None else seq
    _validate(batch, seq, spec)
    _check_choice("precision", precision, PRECISIONS)
    rows = _layer_rows(spec, batch, seq, precision, optimizer, attention, device)
    counts = list(counts) if counts is not None else pipeline.even_partition(len(rows), stages)
    if sum(counts) != len(rows) or any(c < 1 for c in counts) or len(counts) != stages:
        raise ValueError(
            f"counts {counts} must be {stages} positive numbers of layers summing to {len(rows)} "
            f"(embed, {spec.n_layer} blocks, head)"
        )
    out, start = [], 0
    for stage, count in enumerate(counts):
        mine = rows[start : start + count]
        start += count
        n_blocks = sum(r.name.startswith("block") for r in mine)
        segments = _segments(recompute, n_blocks)
        out.append(
            MemoryEstimate(
                spec, batch, seq, precision, optimizer, mine, _activation_peak(mine, segments),
                _transient(spec, batch, seq, precision,
                           mine[-1].activations if stage == stages - 1 else None), segments,
                stage if stages > 1 else None,
            )
        )  # fmt: skip
    return out


def estimate(
    spec: TransformerSpec,
    batch: int,
    seq: int | None = None,
    precision: str = "fp32",
    optimizer: str = "adam",
    recompute: bool | int = False,
    stages: int = 1,
    attention: str | None = None,
    device: str = "cpu",
) -> MemoryEstimate:
    """Predicted memory of one training step on one device (chapter 5).

    ``precision``: ``"fp32"``, ``"bf16"`` (the whole model cast) or ``"mixed"`` (autocast to
    bf16 over fp32 weights). ``optimizer``: ``"sgd"``, ``"sgd_momentum"`` or ``"adam"``.
    ``recompute``: checkpoint the blocks in segments (``True``: sqrt(n) of them).
    ``stages``: the model split over that many devices; the result is the fullest stage (the
    device that runs out first) and ``.stages`` lists them all. ``attention`` and ``device``
    choose which tensors attention and dropout save (see :func:`block_saved_terms`).
    """
    per_stage = estimate_stages(
        spec, batch, seq, stages, None, precision, optimizer, recompute, attention, device
    )
    fullest = max(per_stage, key=lambda e: e.total)
    if stages > 1:
        fullest = replace(fullest, stages=per_stage)
    return fullest


def largest_batch(
    spec: TransformerSpec, seq: int, device_bytes: float, limit: int = 1 << 20, **options
) -> int:
    """The largest batch whose estimated step fits in ``device_bytes`` (0 if not even one)."""
    if estimate(spec, 1, seq, **options).total > device_bytes:
        return 0
    low, high = 1, 2
    while high <= limit and estimate(spec, high, seq, **options).total <= device_bytes:
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:  # estimate(low) fits, estimate(high) does not
        mid = (low + high) // 2
        low, high = (
            (mid, high) if estimate(spec, mid, seq, **options).total <= device_bytes else (low, mid)
        )
    return low


def korthikanti_bytes(seq: int, batch: int, hidden: int, heads: int) -> int:
    """Activation bytes of one transformer layer in Korthikanti et al. 2022 (16-bit activations,
    1-byte dropout masks, explicit softmax, no parallelism): s b h (34 + 5 a s / h)."""
    s, b, h, a = seq, batch, hidden, heads
    return s * b * h * 34 + 5 * a * s * s * b


def layer_gemm_flops(d_model: int, d_ff: int, batch: int, seq: int) -> dict[str, int]:
    """Floating-point operations of one transformer layer's matrix multiplies in forward (each
    multiply-add counts 2); backward costs twice as much again."""
    tokens, h = batch * seq, d_model
    return {
        "qkv projection": 2 * tokens * h * 3 * h,
        "scores q k^T": 2 * batch * seq * seq * h,
        "scores x v": 2 * batch * seq * seq * h,
        "output projection": 2 * tokens * h * h,
        "feed-forward in": 2 * tokens * h * d_ff,
        "feed-forward out": 2 * tokens * d_ff * h,
    }


# ---- Measuring a real step ----------------------------------------------------------------------


@dataclass
class MemoryMeasurement:
    """Bytes measured during a real training step: the components of :class:`MemoryEstimate`.

    ``transient`` is what the allocator held at its peak beyond the saved activations: the
    gradients in flight, temporaries of the kernels."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # peak bytes autograd saved for backward (SavedTensorMeter)
    peak: int  # the allocator's peak during the step, above what it held before the step
    device: str
    layer_activations: dict[str, int] = field(default_factory=dict)  # embed, block i, head

    @property
    def transient(self) -> int:
        return max(0, self.peak - self.activations)

    @property
    def total(self) -> int:
        """Weights, gradients and optimizer state, plus the step's allocator peak above them."""
        return self.parameters + self.gradients + self.optimizer_state + self.peak

    def components(self) -> dict[str, int]:
        """The five parts of ``total``, by name, as :meth:`MemoryEstimate.components`."""
        return {name: getattr(self, name) for name in COMPONENTS}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """The optimizer ``estimate`` means by ``name`` (learning rates do not change memory)."""
    _check_choice("optimizer", name, OPTIMIZERS)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9 if name == "sgd_momentum" else 0.0)


def cpu_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held during ``step()`` above what it held before it: the CPU
    counterpart of :func:`dmlbook.recompute.cuda_peak_bytes`.

    Torch's profiler with ``profile_memory`` records every allocation and free with its time;
    their running sum is the allocator's live bytes. The legacy (autograd) profiler is used
    because it starts in microseconds, where the Kineto one takes seconds on first use.
    """
    config = torch.autograd.ProfilerConfig(
        torch.autograd.ProfilerState.CPU, False, True, False, False, False,
        torch._C._profiler._ExperimentalConfig(),
    )  # fmt: skip  # (state, shapes, profile_memory, stack, flops, modules, experimental)
    torch.autograd._enable_profiler_legacy(config)
    try:
        step()
    finally:
        records = torch.autograd._disable_profiler_legacy()
    events = sorted(  # (time, order within its thread, bytes allocated (+) or freed (-))
        (event.start_us(), i, event.cpu_memory_usage())
        for thread in records
        for i, event in enumerate(thread)
        if event.kind() == "memory_alloc" and event.device() == -1  # -1: the CPU
    )
    live = peak = 0
    for *_, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    forward_backward: Callable[[], object],
    watch: Callable[[SavedTensorMeter], Callable[[], None]] | None = None,
) -> MemoryMeasurement:
    """Measure a training step of ``module``: ``forward_backward()`` then ``optimizer.step()``.

    The step runs twice. The first creates the gradients and the optimizer state, whose bytes
    are read off the tensors. The second keeps them (``zero_grad(set_to_none=False)``) and is
    measured twice over: the bytes autograd saves for backward (a ``SavedTensorMeter``, whose
    aliases allocate nothing) and the allocator's peak (the profiler on a CPU, the CUDA
    allocator on a GPU). ``watch(meter)`` may install hooks that read the meter during that
    step; it returns their remover. Every rank of a pipeline calls it alike.
    """
    params = list(module.parameters())
    if not params:
        raise ValueError("the module has no parameters to train")

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        forward_backward()
        optimizer.step()

    step()
    grads = [p.grad for p in params]
    state = [t for s in optimizer.state.values() for t in s.values()]
    device = params[0].device
    with SavedTensorMeter([*params, *module.buffers()]) as meter:
        unwatch = watch(meter) if watch is not None else None
        try:
            peak = cuda_peak_bytes(step, device) if device.type == "cuda" else cpu_peak_bytes(step)
        finally:
            if unwatch is not None:
                unwatch()
    return MemoryMeasurement(
        _storage_bytes(params), _storage_bytes(grads), _storage_bytes(state), meter.peak, peak,
        device.type,
    )  # fmt: skip


def measure(
    model: CharGPT,
    batch: int,
    seq: int | None = None,
    precision: str = "fp32",
    optimizer: str = "adam",
    recompute: bool | int = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> MemoryMeasurement:
    """Measure real training steps of a copy of ``model`` (see :func:`measure_step`), with the
    same options as :func:`estimate`; without recomputation, also each layer's saved bytes."""
    _check_choice("precision", precision, PRECISIONS)
    seq = model.config.block_size if seq is None else seq
    _validate(batch, seq, spec_of(model))
    device = torch.device(device)
    model = copy.deepcopy(model).to(device).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    idx, targets = (torch.randint(vocab, (batch, seq), generator=g).to(device) for _ in range(2))
    chain = layer_chain(model)
    segments = _segments(recompute, len(chain.layers))
    autocast = partial(torch.autocast, device.type, torch.bfloat16, enabled=precision == "mixed")
    checkpoint = None
    if segments:
        # CheckpointSegment reruns a segment in backward, outside the autocast block: wrap the
        # segment so that the rerun is cast as the forward was.
        def checkpoint(layers, x):
            return checkpoint_segment([_Autocast(layers, autocast)], x)

    def forward_backward() -> None:
        with autocast():
            loss = chain.loss(idx, targets, checkpoint, segments)
        loss.backward()

    marks: list[tuple[str, int]] = []  # (layer, meter count when it ends)

    def watch(meter: SavedTensorMeter) -> Callable[[], None]:
        """The meter's count between layers gives each layer's share."""
        mark = lambda name: lambda *_: marks.append((name, meter.current))  # noqa: E731
        hooks = [model.blocks[0].register_forward_pre_hook(mark("embed"))]
        for i, block in enumerate(model.blocks):
            hooks.append(block.register_forward_hook(mark(f"block {i}")))
        hooks.append(model.lm_head.register_forward_hook(mark("lm_head")))
        return lambda: [hook.remove() for hook in hooks]

    opt = make_optimizer(optimizer, model.parameters())
    result = measure_step(model, opt, forward_backward, None if segments else watch)
    if marks:
        before, layers = 0, {}
        for name, current in marks:
            layers[name] = current - before
            before = current
        # lm_head's hook fires before the loss saves its log-softmax: the rest is the head's too
        layers["head"] = layers.pop("lm_head") + result.activations - before
        result.layer_activations = layers
    return result


def measure_stage(
    model: CharGPT,
    batch: int,
    seq: int | None = None,
    counts: Sequence[int] | None = None,
    optimizer: str = "adam",
    seed: int = 0,
) -> MemoryMeasurement:
    """Rank function: measure this rank's pipeline stage of ``model`` (chapter 5's model split).

    The layers ``[embed, *blocks, head]`` are cut into one stage per rank
    (``pipeline.split_model``, ``counts`` or ``pipeline.even_partition``); the layers of other
    stages go to the meta device, so that each rank holds only its own weights; the step is
    ``PipelineStage.train_step`` with the vanilla schedule (one micro-batch, no overlap),
    measured by :func:`measure_step` on every rank alike.
    """
    rank, stages = dist.get_rank(), dist.get_world_size()
    seq = model.config.block_size if seq is None else seq
    _validate(batch, seq, spec_of(model))
    layers = pipeline.layers_of(model.train())
    counts = list(counts) if counts is not None else pipeline.even_partition(len(layers), stages)
    parts = pipeline.split_model(layers, counts)
    for other, part in enumerate(parts):
        if other != rank:
            part.to("meta")  # frees the weights this rank does not run
    stage = pipeline.PipelineStage(parts[rank], rank, stages)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    idx, targets = (
        torch.randint(vocab, (batch, seq), generator=g).to(stage.device) for _ in range(2)
    )
    last = rank == stages - 1

    def forward_backward() -> None:
        stage.train_step(
            idx if rank == 0 else None, targets if last else None,
            pipeline.gpt_loss if last else None, microbatches=1, schedule="vanilla",
        )  # fmt: skip

    return measure_step(
        stage.module, make_optimizer(optimizer, stage.module.parameters()), forward_backward
    )


class _Autocast(nn.Module):
    """``layers`` run in order under ``autocast()``, wherever they run (also in backward)."""

    def __init__(self, layers: Sequence[nn.Module], autocast: Callable) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            for layer in self.layers:
                x = layer(x)
        return x


# ---- A small device: a memory cap for one rank -------------------------------------------------


@contextmanager
def onednn_disabled() -> Iterator[None]:
    """CPU kernels without oneDNN, on PyTorch's own. oneDNN's bf16 kernels keep workspace of
    their own outside any tensor (as cuDNN and cuBLAS do on a GPU): a :func:`memory_cap` counts
    it, the estimator does not (chapter 5)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _set_up_a_first_step() -> None:
    """Run a tiny training step (measured, with each optimizer) so that what a first step sets up
    once, the intra-op thread pool (a stack per thread) and the modules that autograd, the
    optimizers and the profiler import lazily, is not charged to a memory cap's budget."""
    layer = nn.Linear(256, 256)
    for optimizer in OPTIMIZERS:
        opt = make_optimizer(optimizer, layer.parameters())
        cpu_peak_bytes(lambda: layer(torch.ones(1024, 256)).sum().backward())
        opt.step()


_OOM_SIGNS = ("can't allocate memory", "could not create a primitive", "bad_alloc")


@contextmanager
def memory_cap(budget_bytes: int) -> Iterator[None]:
    """Give this process only ``budget_bytes`` more memory, like a small device: an allocation
    beyond it raises ``torch.OutOfMemoryError``, as CUDA's allocator does (chapter 5).

    Linux only, and only inside a rank that :func:`dmlbook.launch.run` started, so that a
    notebook kernel is never the process that runs out. The cap is ``RLIMIT_DATA`` (the
    process's private writable memory, ``VmData``) at its current size plus the budget; glibc is
    told to map every block of 128 kB or more on its own, so that freed tensors give their
    memory back at once. (``RLIMIT_AS`` would be the obvious limit, but it counts the 64 MB that
    glibc reserves for each thread's heap when reserved, so a thread heap's memory is never
    charged: a step then "fits" in less than it uses.)
    """
    if not os.environ.get(INSIDE_RUN):
        raise RuntimeError(
            "memory_cap only runs inside a rank started by dmlbook.launch.run, never in the "
            "notebook's own process: call it from a rank function"
        )
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"memory_cap needs Linux (RLIMIT_DATA and /proc), not {sys.platform}")
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    import resource  # Unix only

    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD fixed at 128 kB: freed blocks are unmapped
    _set_up_a_first_step()
    before = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(
        resource.RLIMIT_DATA, (_proc_status("VmData") + int(budget_bytes), before[1])
    )
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, torch.OutOfMemoryError) or not (
            isinstance(error, MemoryError) or any(s in str(error) for s in _OOM_SIGNS)
        ):
            raise
        said = (str(error).splitlines() or ["(no message)"])[0]
        raise torch.OutOfMemoryError(
            f"out of memory: this rank may use {format_bytes(budget_bytes)} more "
            f"({type(error).__name__}: {said})"
        ) from error
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


def _proc_status(field_name: str) -> int:
    """A ``/proc/self/status`` memory figure, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


# ---- Hardware -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    """A data-center GPU's headline figures (SXM form factor), from NVIDIA's own documents."""

    name: str
    year: int
    memory_gb: float  # HBM capacity, GB (the larger variant where two exist is listed separately)
    hbm_gb_per_s: float  # memory bandwidth
    fp16_tflops: float  # dense FP16 matmul: Tensor Cores from Volta on, plain FP16 units on Pascal
    bf16_tflops: float | None  # dense BF16 Tensor Core matmul (None: no bf16 support)
    nvlink_gb_per_s: float  # total NVLink bandwidth per GPU, both directions
    nvlink_links: int
    source: str


GPUS = (
    GPU("P100", 2016, 16, 732, 21.2, None, 160, 4,
        "NVIDIA Tesla P100 whitepaper (Pascal GP100) and P100 datasheet; no Tensor Cores"),
    GPU("V100", 2017, 16, 900, 125, None, 300, 6,
        "NVIDIA Tesla V100 GPU Architecture whitepaper (2017) and V100 datasheet; also 32 GB"),
    GPU("A100", 2020, 40, 1555, 312, 312, 600, 12,
        "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020) and A100 datasheet"),
    GPU("A100 80GB", 2020, 80, 2039, 312, 312, 600, 12,
        "NVIDIA A100 80GB datasheet"),
    GPU("H100", 2022, 80, 3350, 989, 989, 900, 18,
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) and H100 SXM datasheet"),
)  # fmt: skip

# DGX-1 (P100, 2016) "hybrid cube-mesh": two fully connected quads of 4 GPUs, and each GPU linked
# to its partner in the other quad, using all 4 NVLinks of every P100 (NVIDIA DGX-1 System
# Architecture whitepaper). The V100 DGX-1 keeps this layout and doubles some links with its 6.
DGX1_NVLINK = tuple(
    (i, j) for i in range(8) for j in range(i + 1, 8) if i // 4 == j // 4 or j == i + 4
)
