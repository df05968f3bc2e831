"""What a transformer is, and how many bytes each number takes, by precision (chapter 5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dmlbook.models import CharGPT

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
class PrecisionBytes:
    """Bytes per element of each kind of tensor a step keeps, for one precision."""

    param: int  # weights as the model holds them (the fp32 master copy in mixed precision)
    act: int  # matmul inputs, q/k/v, GELU: what the compute dtype makes
    residual: int  # the residual stream and LayerNorm inputs (fp32 under autocast)
    stats: int  # LayerNorm mean and 1/std per token
    loss: int  # log-softmax output of the cross-entropy (fp32 under autocast)
    weight_copy: int  # autocast's low-precision copy of each Linear weight, saved for backward


# Each precision's PrecisionBytes: what the estimator multiplies element counts by.
BYTES_BY_PRECISION = {
    "fp32": PrecisionBytes(param=4, act=4, residual=4, stats=4, loss=4, weight_copy=0),
    "bf16": PrecisionBytes(param=2, act=2, residual=2, stats=2, loss=2, weight_copy=0),
    # torch.autocast(bfloat16): fp32 weights, gradients and optimizer state; matmuls in bf16 on
    # bf16 copies of their inputs and weights; LayerNorm, residual adds and the loss in fp32.
    "mixed": PrecisionBytes(param=4, act=2, residual=4, stats=4, loss=4, weight_copy=2),
}
LSE_BYTES = 4  # fused attention keeps one fp32 log-sum-exp per (batch, head, query) in any dtype
INDEX_BYTES = 8  # token ids, positions and targets are int64
ADAM_STEP_BYTES = 4  # torch's Adam keeps its step count as a float32 scalar tensor per parameter


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """A ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def state_bytes_per_parameter(precision: str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Bytes per parameter of weights, gradients and optimizer state (Adam's step count aside).

    Mixed precision costs 16 bytes with Adam either way one counts it: torch's autocast keeps
    fp32 weights (4), fp32 gradients (4) and two fp32 moments (8); the ZeRO paper's accounting
    (Rajbhandari et al. 2020) has fp16 weights and gradients (2 + 2) and an fp32 master copy plus
    two moments (12).
    """
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    per = BYTES_BY_PRECISION[precision].param
    buffers = {"sgd": 0, "sgd_momentum": 1, "adam": 2}[optimizer]  # momentum; Adam: m and v
    return {"parameters": per, "gradients": per, "optimizer_state": buffers * per}


# ---- Parameters, layer by layer -----------------------------------------------------------------


@dataclass(frozen=True)
class ParamCount:
    """The parameters of one part of a model (a layer, a block), counted from its sizes."""

    numel: int  # scalars
    tensors: int  # parameter tensors (Adam keeps a step count for each)
    linear_weights: int  # scalars in Linear weights (mixed precision saves a bf16 copy of each)


def _linear(
    spec: TransformerSpec, fan_in: int, fan_out: int, bias: bool | None = None
) -> ParamCount:
    bias = spec.bias if bias is None else bias
    return ParamCount(fan_in * fan_out + (fan_out if bias else 0), 1 + bias, fan_in * fan_out)


def _norm(spec: TransformerSpec) -> ParamCount:
    return ParamCount(spec.d_model * (1 + spec.bias), 1 + spec.bias, 0)


def _total(*parts: ParamCount) -> ParamCount:
    return ParamCount(
        *(sum(getattr(p, f) for p in parts) for f in ("numel", "tensors", "linear_weights"))
    )


def block_params(spec: TransformerSpec) -> ParamCount:
    """One transformer block's parameters: two norms, attention and the feed-forward."""
    h, f = spec.d_model, spec.d_ff
    return _total(
        _norm(spec), _linear(spec, h, 3 * h), _linear(spec, h, h),  # attention: qkv, projection
        _norm(spec), _linear(spec, h, f), _linear(spec, f, h),  # feed-forward
    )  # fmt: skip


def embed_params(spec: TransformerSpec) -> ParamCount:
    """The embedding tables (tokens, positions, token types) and BERT's norm after them."""
    h = spec.d_model
    tables = (spec.vocab_size + spec.max_positions + spec.token_types) * h
    parts = [ParamCount(tables, 2 + (spec.token_types > 0), 0)]
    if spec.kind == "encoder":
        parts.append(_norm(spec))  # BERT normalises the summed embeddings
    return _total(*parts)


def head_params(spec: TransformerSpec) -> ParamCount:
    """The head: GPT's final norm and output layer, or BERT's classifier or MLM decoder."""
    h = spec.d_model
    if spec.head == "classifier":  # BERT: pooler (dense + tanh on [CLS]), then the classifier
        return _total(_linear(spec, h, h), _linear(spec, h, spec.num_labels))
    tied = spec.tied_embeddings
    out = (
        ParamCount(0, 0, spec.vocab_size * h) if tied else _linear(spec, h, spec.vocab_size, False)
    )
    if spec.head == "lm":  # GPT: final LayerNorm, then the output layer over the vocabulary
        return _total(_norm(spec), out)
    bias = (
        ParamCount(spec.vocab_size, 1, 0) if tied else ParamCount(0, 0, 0)
    )  # BERT's MLM decoder bias
    return _total(_linear(spec, h, h), _norm(spec), out, bias)  # transform, LayerNorm, decoder


def spec_parameters(spec: TransformerSpec) -> int:
    """Parameters of the whole model ``spec`` describes (tied weights counted once), in closed
    form from its sizes, without building it; :func:`dmlbook.models.count_parameters` counts a
    built model's."""
    return sum(p.numel for p in layer_params(spec))


def layer_params(spec: TransformerSpec) -> list[ParamCount]:
    """Each layer's parameters in order: the embedding, every block, the head."""
    return [embed_params(spec), *[block_params(spec)] * spec.n_layer, head_params(spec)]
