"""Small models shared by every chapter, so that each notebook parallelises the same code.

- ``MLP`` and ``CNN``: image classifiers for the digits / MNIST / CIFAR tensors of
  ``dmlbook.datasets``. Data parallelism, parameter servers, bottlenecks (chapters 1-4) and
  federated, elastic and heterogeneous training (chapters 10-12).
- ``CharGPT``: a character-level decoder-only transformer in the style of nanoGPT. Model
  parallelism, pipelining, serving and Megatron-style tensor parallelism (chapters 5-9).

Layers that later chapters split are exposed by name: ``MLP.layers`` and ``CNN.layers`` (an
``nn.Sequential`` to cut into pipeline stages), ``CharGPT.blocks`` (an ``nn.ModuleList``) and the
``c_attn`` / ``c_proj`` / ``c_fc`` linears that tensor parallelism shards. The factories ``mlp``,
``cnn`` and ``char_gpt`` build a model from a seed without touching the caller's RNG, so every rank
of a distributed run can build the same initial weights. ``accuracy`` scores a classifier.

The one model contract (every training loop, reference and parallel, goes through it): a
:class:`Batch` is ``(inputs, targets)``, and :func:`batch_loss` is a model's loss on one. A model
either brings its own loss (``model(inputs, targets)`` returns ``(outputs, loss)``, as
``CharGPT`` does with :func:`next_token_loss`), or the caller names a ``loss_fn`` applied to
``model(inputs)``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

M = TypeVar("M", bound=nn.Module)


def _takes_targets(model: nn.Module) -> bool:
    """Whether ``model(inputs, targets)`` is a valid call of its forward."""
    try:
        inspect.signature(model.forward).bind(None, None)
    except TypeError:
        return False
    return True


class Batch(NamedTuple):
    """One batch of samples: what a model's forward takes and what its loss compares with."""

    inputs: torch.Tensor  # (B, ...) e.g. (B, features) images or (B, T) token ids
    targets: torch.Tensor  # (B,) class labels or (B, T) next tokens


def next_token_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every prediction: classifier outputs ``(N, C)`` against ``(N,)``,
    or language-model logits ``(B, T, V)`` against ``(B, T)`` (all ``B * T`` tokens): CharGPT's
    loss, and that of a pipeline's last stage (chapters 6-9b)."""
    return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())


def batch_loss(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable | None = None
) -> torch.Tensor:
    """``model``'s loss on ``batch = (inputs, targets)``: the one way every loop computes it.

    Without ``loss_fn`` the model brings its own loss: ``model(inputs, targets)`` must return
    ``(outputs, loss)`` (``CharGPT``; a tensor-parallel CharGPT computes it on split logits).
    With ``loss_fn`` it is ``loss_fn(model(inputs), targets)``; a model that returns
    ``(outputs, ...)`` has its outputs taken.
    """
    inputs, targets = batch
    if loss_fn is None:
        out = model(inputs, targets) if _takes_targets(model) else None
        if not (isinstance(out, tuple) and len(out) == 2 and torch.is_tensor(out[1])):
            raise TypeError(
                f"{type(model).__name__}(inputs, targets) returned no (outputs, loss) pair: "
                "pass a loss_fn, e.g. torch.nn.functional.cross_entropy"
            )
        return out[1]
    out = model(inputs)
    return loss_fn(out[0] if isinstance(out, tuple) else out, targets)


class MLP(nn.Module):
    """Linear-ReLU stack; ``self.layers`` is one ``nn.Sequential`` to split into pipeline stages."""

    def __init__(
        self, in_features: int = 64, hidden: Sequence[int] = (128,), out_features: int = 10
    ) -> None:
        super().__init__()
        sizes = [in_features, *hidden]
        layers: list[nn.Module] = []
        for fan_in, fan_out in pairwise(sizes):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1))  # (N, in_features) -> (N, out_features)


class CNN(nn.Module):
    """Two 3x3 conv blocks, adaptive pooling and a linear head: one net for 8x8, 28x28 and 32x32.

    A flat ``(N, s*s)`` input is reshaped to ``(N, 1, s, s)`` when ``in_channels == 1``, so the
    flat digits tensors can be fed directly.
    """

    def __init__(self, in_channels: int = 1, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.in_channels = in_channels
        pooled = 4  # every input size is averaged down to a 4x4 map before the head
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),  # (N, w, H, W)
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),  # (N, 2w, H/2, W/2)
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(pooled),  # (N, 2w, 4, 4)
            nn.Flatten(),  # (N, 2w*16)
            nn.Linear(2 * width * pooled * pooled, classes),  # (N, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.in_channels == 1:
            side = math.isqrt(x.shape[1])
            if side * side != x.shape[1]:
                raise ValueError(f"flat input has {x.shape[1]} features, not a square image")
            x = x.view(-1, 1, side, side)  # (N, s*s) -> (N, 1, s, s)
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        return self.layers(x)


@dataclass
class GPTConfig:
    vocab_size: int  # number of distinct tokens (characters for CharGPT)
    block_size: int = 64  # longest context, in tokens, the model attends over
    n_layer: int = 2  # number of transformer blocks
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 64  # width of the residual stream
    dropout: float = 0.0  # dropout probability (0.0 keeps training deterministic)
    bias: bool = True  # biases in the Linear and LayerNorm layers

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_size = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The number of heads is read off the tensor (-1), not the config, so that a tensor-parallel
        # c_attn holding only this rank's heads works unchanged (chapter 9).
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # 3 x (B, T, C)
        q = q.view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    """Position-wise MLP: widen 4x, GELU, project back (the GEMM pair Megatron splits)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class TokenCrossEntropy(nn.Module):
    """Mean cross-entropy of logits ``(B, T, V)`` against targets ``(B, T)``: a char-GPT's
    ``criterion``. A module, so that chapter 9's tensor-parallel plan can replace it by path
    (:class:`~dmlbook.advanced.composition.plan.LossParallel`) as it replaces the layers."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(logits, targets)


class CharGPT(nn.Module):
    """Character-level GPT: embeddings, ``n_layer`` ``Block``s, final LayerNorm, ``lm_head``.

    ``forward`` is ``embed``, then each of ``self.blocks``, then ``head``: the three pieces a
    pipeline stage is cut from (chapters 6-7). The input embedding and ``lm_head`` are not tied,
    so the first and last pipeline stages share no parameter.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.criterion = TokenCrossEntropy()  # no parameters: the loss, by path, for plans
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) to keep the stream's variance.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` to the residual stream ``(B, T, C)``."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; "
                "crop the context to the last block_size tokens"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream ``(B, T, C)`` to next-token logits ``(B, T, V)``."""
        return self.lm_head(self.ln_f(x))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, self.loss(logits, targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the ``B * T`` tokens, :func:`next_token_loss`, by
        ``self.criterion`` (tensor parallelism replaces it with one that takes vocabulary-split
        logits, :class:`dmlbook.advanced.composition.plan.LossParallel`)."""
        return self.criterion(logits, targets)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``; returns ``(B, T+new)``.

        ``temperature=0`` picks the most likely token; pass a seeded ``torch.Generator`` for
        reproducible samples. Call ``model.eval()`` first if the model uses dropout.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits, _ = self(context)
            logits = logits[:, -1, :]  # (B, V): only the last position predicts the next token
            if temperature == 0:
                next_idx = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                probs = F.softmax(logits / temperature, dim=-1)  # (B, V)
                next_idx = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, next_idx], dim=1)
        return idx


def build_seeded(build: Callable[[], M], seed: int) -> M:
    """Run ``build`` with the CPU RNG seeded to ``seed``, restoring the caller's RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # CPU only: leaves any CUDA RNG alone
        return build()


def mlp(seed: int = 0, **kwargs) -> MLP:
    """``MLP(**kwargs)`` with weights determined by ``seed``; the global RNG is left untouched."""
    return build_seeded(lambda: MLP(**kwargs), seed)


def cnn(seed: int = 0, **kwargs) -> CNN:
    """``CNN(**kwargs)`` with weights determined by ``seed``; the global RNG is left untouched."""
    return build_seeded(lambda: CNN(**kwargs), seed)


def char_gpt(vocab_size: int, seed: int = 0, **kwargs) -> CharGPT:
    """``CharGPT(GPTConfig(vocab_size, **kwargs))`` with weights determined by ``seed``."""
    return build_seeded(lambda: CharGPT(GPTConfig(vocab_size=vocab_size, **kwargs)), seed)


def count_parameters(module: nn.Module) -> int:
    """Number of scalars in a built ``module``'s parameters (shared parameters counted once);
    :func:`dmlbook.model_parallel.memory.spec_parameters` gives a transformer's from its sizes."""
    return sum(p.numel() for p in module.parameters())


def count_correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(how many of ``x`` the model classifies as ``y``, how many there are)."""
    with torch.no_grad():
        return int((model(x).argmax(dim=-1) == y).sum()), len(y)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y`` (every chapter that trains one)."""
    correct, total = count_correct(model, x, y)
    return correct / total
