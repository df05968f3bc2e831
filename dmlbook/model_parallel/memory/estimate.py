"""The estimate: what each layer of a step keeps in memory, op by op, and its peak (chapter 5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dmlbook.model_parallel import pipeline
from dmlbook.model_parallel.memory.kernels import reduction_scratch_bytes
from dmlbook.model_parallel.memory.spec import (
    ADAM_STEP_BYTES,
    ATTENTIONS,
    BYTES_BY_PRECISION,
    COMPONENTS,
    DEVICES,
    INDEX_BYTES,
    LSE_BYTES,
    PRECISIONS,
    TransformerSpec,
    block_params,
    check_choice,
    head_params,
    layer_params,
    state_bytes_per_parameter,
)
from dmlbook.model_parallel.recompute import (
    split_segments,
    sqrt_segments,
)

# ---- Activations: what each op saves for backward -----------------------------------------------


def _stats_bytes(precision: str, device: str) -> int:
    """LayerNorm's mean and 1/std: fp32 on CUDA whatever the input; the input's dtype on a CPU."""
    return 4 if device == "cuda" else BYTES_BY_PRECISION[precision].stats


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
    by = BYTES_BY_PRECISION[precision]
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
        terms["bf16 copies of the weights"] = block_params(spec).linear_weights * by.weight_copy
    return terms


def _embed_saved(spec: TransformerSpec, b: int, s: int, precision: str, device: str) -> int:
    by = BYTES_BY_PRECISION[precision]
    saved = INDEX_BYTES * (b * s + s)  # token ids for the embedding's backward; positions
    if spec.token_types:
        saved += INDEX_BYTES * b * s  # segment ids
    if spec.kind == "encoder":
        saved += b * s * (spec.d_model * by.residual + 2 * _stats_bytes(precision, device))
    if spec.dropout > 0:
        saved += b * s * spec.d_model * _mask_bytes(by.residual, device)
    return saved


def _head_saved(spec: TransformerSpec, b: int, s: int, precision: str, device: str) -> int:
    by = BYTES_BY_PRECISION[precision]
    h, tokens = spec.d_model, b * s
    copies = head_params(spec).linear_weights * by.weight_copy
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
    spec: TransformerSpec,
    b: int,
    s: int,
    precision: str,
    head_saved: int | None = None,
    device: str = "cpu",
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
    by = BYTES_BY_PRECISION[precision]
    tokens, h, f = b * s, spec.d_model, spec.d_ff
    weight_gradient = h * f * (by.param + by.weight_copy)
    # Backward through fc2 (d_ff -> h): its input's gradient, its weight's, its bias's sum.
    fc2 = (
        tokens * h * by.residual
        + tokens * f * by.act
        + weight_gradient
        + reduction_scratch_bytes(tokens, h, by.act, device)
    )
    # Then through fc1 (h -> d_ff), once GELU's backward has freed the GELU input and output it
    # saved: the GELU input's gradient, fc1's input's and weight's, and its bias's (d_ff wide)
    # sum. On a CPU this is never the peak; on CUDA the wider sum's scratch can make it so.
    fc1 = (
        tokens * h * by.residual
        + tokens * f * by.act
        + tokens * h * by.act
        + weight_gradient
        + reduction_scratch_bytes(tokens, f, by.act, device)
        - 2 * tokens * f * by.act
    )
    feed_forward = max(fc2, fc1)
    if head_saved is None:
        return tokens * h * by.residual + feed_forward  # + the stage's output
    outputs = b * spec.num_labels if spec.head == "classifier" else tokens * spec.vocab_size
    return max(2 * outputs * by.loss, feed_forward - head_saved)


def _attention(spec: TransformerSpec, attention: str | None, device: str) -> str:
    """The attention path torch takes unless told: on a CPU, attention dropout needs the math
    path; otherwise, and always on CUDA, a fused kernel."""
    check_choice("device", device, DEVICES)
    if attention is None:
        return "math" if device == "cpu" and spec.dropout > 0 else "fused"
    check_choice("attention", attention, ATTENTIONS)
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
    for name, params, act in zip(names, layer_params(spec), saved, strict=True):
        steps = ADAM_STEP_BYTES * params.tensors if optimizer == "adam" else 0
        rows.append(
            LayerMemory(
                name,
                params.numel * per["parameters"],
                params.numel * per["gradients"],
                params.numel * per["optimizer_state"] + steps,
                act,
                checkpoint_input=b * s * spec.d_model * BYTES_BY_PRECISION[precision].residual,
            )
        )
    return rows


def _activation_peak(rows: Sequence[LayerMemory], segments: int | None) -> int:
    """Peak saved bytes of layers run in order; with ``segments``, the blocks among them are
    checkpointed as :func:`dmlbook.model_parallel.recompute.checkpoint_sequential` does (the last
    segment runs
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


def check_batch_and_seq(batch: int, seq: int, spec: TransformerSpec) -> None:
    """A ValueError unless batch and seq are integers >= 1 and seq fits the model's positions."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq must be an integer >= 1, got {seq!r}")
    if seq > spec.max_positions:
        raise ValueError(f"seq={seq} exceeds {spec.name}'s {spec.max_positions} positions")


def recompute_segment_count(recompute: bool | int, n_blocks: int) -> int | None:
    """The checkpoint segments ``recompute`` asks for (True: sqrt of the blocks; off: None)."""
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
    check_batch_and_seq(batch, seq, spec)
    check_choice("precision", precision, PRECISIONS)
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
        segments = recompute_segment_count(recompute, n_blocks)
        out.append(
            MemoryEstimate(
                spec, batch, seq, precision, optimizer, mine, _activation_peak(mine, segments),
                _transient(spec, batch, seq, precision,
                           mine[-1].activations if stage == stages - 1 else None, device),
                segments,
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
