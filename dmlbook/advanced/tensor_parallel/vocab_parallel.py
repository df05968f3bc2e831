"""Vocabulary parallelism: the embedding table and the loss split by token ids (chapter 9).

A language model's first and last layers are as wide as its vocabulary. Chapter 9 ("Hybrid data
and model parallelism") splits them across the tensor-parallel ranks as Megatron-LM does:

* :class:`VocabParallelEmbedding`: each rank holds a block of the table's rows, looks up the ids
  it owns, writes zeros for the others, and one all-reduce adds the ranks' rows;
* :func:`vocab_parallel_cross_entropy`: the loss over logits split by columns, with no rank ever
  holding all V of them: the softmax's max and sum-exp are all-reduced, and the target's logit is
  taken from the rank that owns it;
* :func:`padded_vocab_size`: the vocabulary padded so that it divides by the TP size.

Their communication is :mod:`dmlbook.advanced.tensor_parallel.comm`'s, so ``counting()`` sees it;
:mod:`dmlbook.advanced.composition.plan` applies them to a model by plan
(:class:`VocabParallelCrossEntropy` is the loss as a module, for the plan's ``criterion``), and
:mod:`dmlbook.advanced.tensor_parallel` gives their names with the other layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dmlbook.advanced.tensor_parallel.comm import raw_all_reduce, reduce_from_tensor_parallel
from dmlbook.comm.groups import even_block, group_rank_size

__all__ = [
    "VocabParallelCrossEntropy",
    "VocabParallelCrossEntropyFunction",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "vocab_parallel_cross_entropy",
]


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= ``vocab_size``: Megatron pads the vocabulary so
    that it divides by the TP size; the padding ids are simply never used."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"need vocab_size >= 1 and multiple >= 1, got {vocab_size}, {multiple}")
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (token ids) are split across the ranks.

    Each rank looks up the ids it owns and writes zeros for the others; one all-reduce adds the
    ranks' rows, so every rank ends with every token's vector.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, dtype=None) -> None:
        super().__init__()
        rank, world = group_rank_size(group)
        self.vocab_range = even_block(
            num_embeddings, rank=rank, world_size=world, what="num_embeddings"
        )
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        rows = self.vocab_range[1] - self.vocab_range[0]
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype))
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None) -> VocabParallelEmbedding:
        """This rank's rows of an unsplit ``nn.Embedding``."""
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, group, embedding.weight.dtype
        )
        start, stop = layer.vocab_range
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[start:stop])
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        start, stop = self.vocab_range
        foreign = (idx < start) | (idx >= stop)  # ids another rank owns
        local = (idx - start).masked_fill(foreign, 0)
        rows = F.embedding(local, self.weight)  # (..., D)
        rows = rows.masked_fill(foreign.unsqueeze(-1), 0.0)  # no gradient to row 0 either
        return reduce_from_tensor_parallel(rows, self.group)


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Each token's cross-entropy from this rank's block of the logits: two all-reduces forward
    (the max; the sum of exp with the target's logit), none backward (softmax - one-hot, on the
    rank's own columns)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        # logits: (N, V / p), this rank's columns; target: (N,) global ids.
        local_max = logits.max(dim=-1).values
        global_max = raw_all_reduce(local_max, group, "forward", dist.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)  # the same shift on every rank
        exp = shifted.exp()
        vocab = logits.shape[-1]
        mine = (target >= vocab_start) & (target < vocab_start + vocab)
        local_target = (target - vocab_start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        # One all-reduce adds both the sums of exp and the target's logit (only its owner has a
        # non-zero one); Megatron runs these two as separate all-reduces.
        both = torch.stack([exp.sum(dim=-1), picked.masked_fill(~mine, 0.0)])  # (2, N)
        sum_exp, target_logit = raw_all_reduce(both, group, "forward")
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, mine)
        return sum_exp.log() - target_logit  # (N,): each token's loss, on every rank

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors
        grad_logits = softmax.clone()  # d loss / d logit = softmax - one_hot(target)
        rows = torch.arange(len(local_target))
        grad_logits[rows, local_target] -= mine.to(softmax.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group=None, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy over a vocabulary whose logits are split by columns across ``group``.

    ``logits`` ``(..., V / p)`` is this rank's block; ``target`` holds global token ids. No rank
    ever holds all V logits: an all-reduce of one number per token (the max) and one of two (the
    sum of exp and the target's logit) give every rank the loss. ``reduction`` is "mean", "sum"
    or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on the "
            "leading dimensions"
        )
    rank, _ = group_rank_size(group)
    vocab_start = rank * logits.shape[-1]
    losses = VocabParallelCrossEntropyFunction.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group, vocab_start
    ).view(target.shape)
    if reduction == "mean":
        return losses.mean()
    return losses.sum() if reduction == "sum" else losses


class VocabParallelCrossEntropy(nn.Module):
    """:func:`vocab_parallel_cross_entropy` as a module: the mean loss of logits ``(B, T, V / p)``,
    this rank's vocabulary block, against targets ``(B, T)``; what the plan puts at a char-GPT's
    ``criterion`` so that the logits are never gathered."""

    def __init__(self, group=None) -> None:
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.group)
