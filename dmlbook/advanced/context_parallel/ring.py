"""Context parallelism: attention over a sequence that is split across ranks (chapter 13).

This module is :mod:`dmlbook.advanced.context_parallel`'s arithmetic and messages; the plan
styles that put it into a model are :mod:`~dmlbook.advanced.context_parallel.styles`.

Tensor and sequence parallelism still give every rank all the keys and values of a sequence for
attention. With long contexts even that is too much, so context parallelism keeps only a slice of
the sequence on each rank, q, k and v alike, and moves the keys and values instead:

* **ring attention** (:func:`ring_attention`; Liu et al. 2023, "Ring Attention with Blockwise
  Transformers"): p steps; at each, every rank attends its queries to the K/V block it holds, then
  passes that block to the next rank round the ring. The partial results are combined by the
  online-softmax rule (:func:`merge`, Milakov and Gimelshein 2018; FlashAttention's rescaling):
  an attention output over two sets of keys is the two outputs weighted by their softmax
  denominators, carried as log-sum-exps, so no rank ever holds a full row of scores;
* **all-gather K/V** (:func:`all_gather_attention`, as Llama 3 trains long contexts): one
  all-gather of every rank's K/V, then the same block loop. More memory, fewer and larger
  messages; the same arithmetic.

Causal attention makes the work uneven: with the sequence cut into p contiguous blocks
(:func:`contiguous_chunks`), the last rank's queries see every key and the first rank's only its
own. The **zigzag** split (:func:`zigzag_chunks`) cuts the sequence into 2p chunks and gives
rank r chunks r and 2p-1-r, one from each end, so every rank computes the same number of
scores. A split is data, a :data:`RankChunks` list: for each rank, its ``[start, stop)`` chunks
of the sequence in order; :func:`split` and :func:`unsplit` move a tensor into and out of it;
:func:`attention_work` predicts each rank's scores from the chunks, and every block computed is
recorded as an
:class:`AttentionBlock` (``with counting_work() as blocks:``), so the notebook can measure the
work before and after balancing.

Gradients: the ring's hand-on is an autograd function (:class:`_RingPass`: send to the next rank
forward, the gradient to the previous one backward) and the all-gather's conjugate is a
reduce-scatter, so autograd runs the backward ring through the same blocks. That keeps every
block's scores for backward (O(p) blocks of memory); production kernels (FlashAttention's ring
variants) recompute them from the saved log-sum-exp instead. Messages go round one at a time;
production code overlaps each step's compute with the next block's transfer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmlbook.comm import collectives, trace
from dmlbook.comm.alltoall import exchange_sizes
from dmlbook.comm.groups import balanced_blocks, group_rank_size

__all__ = [
    "AttentionBlock",
    "RankChunks",
    "all_gather_attention",
    "attention_work",
    "block_attention",
    "contiguous_chunks",
    "counting_work",
    "merge",
    "ring_attention",
    "split",
    "unsplit",
    "zigzag_chunks",
    "zigzag_split",
    "zigzag_unsplit",
]

Chunk = tuple[int, int]  # [start, stop) positions of the sequence
RankChunks = list[list[Chunk]]  # chunks[rank]: that rank's chunks, in the order it holds them

# --------------------------------------------------------------------------- chunk lists


def contiguous_chunks(seq_len: int, world_size: int) -> RankChunks:
    """p contiguous blocks, near-equal when ``seq_len`` does not divide (the first ones longer)."""
    return [[block] for block in balanced_blocks(seq_len, world_size)]


def zigzag_chunks(seq_len: int, world_size: int) -> RankChunks:
    """2p equal chunks; rank r holds chunks r and 2p-1-r, one from each end of the sequence, so
    that every rank's queries see the same number of causal keys (the load-balanced split)."""
    parts = 2 * world_size
    if seq_len % parts:
        raise ValueError(
            f"the zigzag chunks need the sequence length divisible by 2 x world size: "
            f"sequence length={seq_len} is not divisible by {parts} (pad the sequence, or use "
            "contiguous_chunks)"
        )
    c = seq_len // parts
    return [
        [(r * c, (r + 1) * c), ((parts - 1 - r) * c, (parts - r) * c)] for r in range(world_size)
    ]


def _length(chunks: Sequence[Chunk]) -> int:
    return sum(stop - start for start, stop in chunks)


def split(x: torch.Tensor, chunks: RankChunks, rank: int, dim: int = -2) -> torch.Tensor:
    """Rank's positions of ``x`` (the whole sequence along ``dim``), its chunks side by side."""
    return torch.cat([x.narrow(dim, a, b - a) for a, b in chunks[rank]], dim=dim)


def unsplit(pieces: Sequence[torch.Tensor], chunks: RankChunks, dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's piece (``pieces[r]`` as :func:`split` gave it)."""
    parts = []
    for piece, mine in zip(pieces, chunks, strict=True):
        offset = 0
        for a, b in mine:
            parts.append((a, piece.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(parts, key=lambda ap: ap[0])], dim=dim)


def zigzag_split(x: torch.Tensor, rank: int, world_size: int, dim: int = -2) -> torch.Tensor:
    """Rank's two zigzag chunks of ``x`` along ``dim``."""
    return split(x, zigzag_chunks(x.shape[dim], world_size), rank, dim)


def zigzag_unsplit(pieces: Sequence[torch.Tensor], dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's zigzag piece."""
    seq_len = sum(p.shape[dim] for p in pieces)
    return unsplit(pieces, zigzag_chunks(seq_len, len(pieces)), dim)


# --------------------------------------------------------------------------- work


@dataclass(frozen=True)
class AttentionBlock:
    """One block of scores a rank computed: its query chunk against a key chunk."""

    q_chunk: Chunk
    k_chunk: Chunk
    elements: int  # query positions x key positions (per batch row and head)


def counting_work() -> AbstractContextManager[list[AttentionBlock]]:
    """Record every block of scores computed inside the block (:mod:`dmlbook.comm.trace`)."""
    return trace.recording(AttentionBlock)


def _future(q_chunk: Chunk, k_chunk: Chunk) -> bool:
    """Every key of k_chunk comes after every query of q_chunk: causal attention skips it."""
    return k_chunk[0] >= q_chunk[1]


def attention_work(chunks: RankChunks, causal: bool = True) -> list[int]:
    """Score elements each rank computes (per batch row and head): its query chunks against
    every key chunk, skipping the blocks wholly in the future."""
    every_chunk = [c for mine in chunks for c in mine]
    return [
        sum(
            (q[1] - q[0]) * (k[1] - k[0])
            for q in mine
            for k in every_chunk
            if q[1] > q[0] and k[1] > k[0] and not (causal and _future(q, k))
        )
        for mine in chunks
    ]


# --------------------------------------------------------------------------- blocks and merging


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_chunk: Chunk, k_chunk: Chunk, causal=True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries at positions ``q_chunk`` to keys at ``k_chunk``: the output
    ``(B, H, tq, D)`` and each query's log-sum-exp of scores ``(B, H, tq)``, what :func:`merge`
    needs. A causal mask hides keys after the query (by global position)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, tq, tk)
    if causal and k_chunk[1] - 1 > q_chunk[0]:  # some key comes after some query
        q_pos = torch.arange(*q_chunk, device=q.device)
        k_pos = torch.arange(*k_chunk, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = scores.logsumexp(dim=-1)  # (B, H, tq)
    trace.record(AttentionBlock(q_chunk, k_chunk, q.shape[-2] * k.shape[-2]))
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse  # (B, H, tq, D), (B, H, tq)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from attention over each: softmax denominators add, so
    ``lse = log(e^lse_a + e^lse_b)`` and the outputs are weighted by ``e^(lse_x - lse)``.
    A row that no key reached (``lse = -inf`` on both sides) stays zero."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)  # exp(-inf - 0) = 0 rather than nan
    out = (lse_a - safe).exp().unsqueeze(-1) * out_a + (lse_b - safe).exp().unsqueeze(-1) * out_b
    return out, lse


class _Accumulator:
    """The running (output, log-sum-exp) of each of this rank's query chunks."""

    def __init__(self, q: torch.Tensor, q_chunks: Sequence[Chunk], causal: bool) -> None:
        self.q_chunks, self.causal = list(q_chunks), causal
        self.q = q.split([b - a for a, b in q_chunks], dim=-2)
        self.state: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(q_chunks)

    def attend(self, k: torch.Tensor, v: torch.Tensor, k_chunks: Sequence[Chunk]) -> None:
        """Fold the keys and values of ``k_chunks`` (side by side in k, v) into every query."""
        ks = k.split([b - a for a, b in k_chunks], dim=-2)
        vs = v.split([b - a for a, b in k_chunks], dim=-2)
        for i, (q, q_chunk) in enumerate(zip(self.q, self.q_chunks, strict=True)):
            for kc, vc, k_chunk in zip(ks, vs, k_chunks, strict=True):
                empty = q_chunk[1] == q_chunk[0] or k_chunk[1] == k_chunk[0]
                if empty or (self.causal and _future(q_chunk, k_chunk)):
                    continue  # compute: none; this block is masked out entirely
                part = block_attention(q, kc, vc, q_chunk, k_chunk, self.causal)
                self.state[i] = part if self.state[i] is None else merge(*self.state[i], *part)

    def output(self, received: torch.Tensor) -> torch.Tensor:
        """The attention output ``(B, H, t_local, D)``, tied to ``received`` (what communication
        brought) with weight zero. Backward must run every communication of forward on every
        rank, or a peer waits for a gradient that never comes; a rank whose queries skipped the
        last block (wholly in their future) would otherwise skip the conjugate message."""
        outs = [s[0] if s else 0.0 * q for s, q in zip(self.state, self.q, strict=True)]
        return torch.cat(outs, dim=-2) + 0.0 * received.sum()


# --------------------------------------------------------------------------- communication


def _check(name: str, q, k, v, chunks: RankChunks, group) -> tuple[int, int]:
    """Local shapes first, then one all-gather of (B, H, positions, D, dtype): every rank raises
    the same ValueError when the ranks disagree, instead of waiting for a block that never comes."""
    rank, world = group_rank_size(group)
    if len(chunks) != world:
        raise ValueError(f"{name}: the chunks are for {len(chunks)} ranks, the group has {world}")
    if not (q.dim() == k.dim() == v.dim() == 4) or not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"{name}: q, k and v must be (batch, heads, positions, head dim) of one shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    names = ("batch", "heads", "sequence positions", "head dim")
    rows = exchange_sizes([*q.shape, q.element_size()], group, q.device)
    problems = []
    for d, dim_name in enumerate(names):
        expected = [_length(c) for c in chunks] if d == 2 else [rows[0][d]] * world
        if [row[d] for row in rows] != expected:
            found = ", ".join(f"rank {r}: {row[d]}" for r, row in enumerate(rows))
            want = f" (the chunks give {expected})" if d == 2 else ""
            problems.append(f"ranks disagree on {dim_name}: {found}{want}")
    if len({row[4] for row in rows}) > 1:
        problems.append("ranks pass different dtypes")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))
    return rank, world


class _RingPass(torch.autograd.Function):
    """Send to the next rank, receive from the previous one; backward, the gradient goes the
    other way round (to the previous rank, from the next)."""

    @staticmethod
    def forward(ctx, x, recv_shape, group):
        ctx.send_shape, ctx.group = x.shape, group
        return _shift(x.contiguous(), recv_shape, +1, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad.contiguous(), ctx.send_shape, -1, ctx.group, "backward"), None, None


def _shift(x: torch.Tensor, recv_shape, direction: int, group, phase: str) -> torch.Tensor:
    """Communication: ``x`` to the rank ``direction`` away round the ring, one back from it."""
    rank, world = group_rank_size(group)
    to, frm = (rank + direction) % world, (rank - direction) % world
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    out = x.new_empty(recv_shape)
    works = []
    if out.numel():  # empty blocks (fewer positions than ranks) are not sent; both sides know
        works.append(dist.irecv(out, glob(frm), group=group))
    if x.numel():
        nbytes = x.numel() * x.element_size()
        trace.record(trace.Send("ring_attention", phase, 0, glob(rank), glob(to), nbytes))
        works.append(dist.isend(x, glob(to), group=group))
    for work in works:
        work.wait()
    return out


class _AllGatherSequence(torch.autograd.Function):
    """All-gather every rank's (padded) block forward; reduce-scatter the gradient backward,
    since every rank's queries contributed to the gradient of every rank's keys."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _, world = group_rank_size(group)
        pieces = [torch.empty_like(x) for _ in range(world)]
        collectives.all_gather(pieces, x.contiguous(), group=group, check=False)
        return torch.stack(pieces)  # (world, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty_like(grad[0])
        collectives.reduce_scatter(mine, list(grad.contiguous().unbind(0)), group=ctx.group)
        return mine, None


# --------------------------------------------------------------------------- the two variants


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: RankChunks,
    group=None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of this rank's queries to the whole sequence's keys, the K/V blocks passed
    round the ring. q, k, v are ``(B, H, t, D)``: this rank's positions in ``chunks``; so is the
    output. Equal to ``scaled_dot_product_attention`` on the whole sequence, split by chunks."""
    rank, world = _check("ring_attention", q, k, v, chunks, group)
    acc = _Accumulator(q, chunks[rank], causal)
    kv = torch.stack([k, v])  # (2, B, H, t, D): one message per step instead of two
    for step in range(world):
        holder = (rank - step) % world  # whose block this rank holds at this step
        acc.attend(kv[0], kv[1], chunks[holder])  # compute
        if step < world - 1:  # communication: pass the block on, take the previous rank's
            incoming = (*kv.shape[:3], _length(chunks[(holder - 1) % world]), kv.shape[-1])
            kv = _RingPass.apply(kv, incoming, group)
    return acc.output(received=kv)


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: RankChunks,
    group=None,
    causal: bool = True,
) -> torch.Tensor:
    """:func:`ring_attention`'s arithmetic after one all-gather of every rank's K/V (padded to
    the longest block, as the chunks may be uneven)."""
    rank, world = _check("all_gather_attention", q, k, v, chunks, group)
    acc = _Accumulator(q, chunks[rank], causal)
    longest = max(_length(c) for c in chunks)
    kv = torch.stack([k, v])  # (2, B, H, t, D)
    if world > 1:  # communication: every rank's block, padded to the longest
        pad = kv.new_zeros(*kv.shape[:3], longest - kv.shape[-2], kv.shape[-1])
        blocks = _AllGatherSequence.apply(torch.cat([kv, pad], dim=-2), group)
    else:
        blocks = kv.unsqueeze(0)
    for step in range(world):  # compute, in the ring's order so that the sums round alike
        src = (rank - step) % world
        block = blocks[src][..., : _length(chunks[src]), :]
        acc.attend(block[0], block[1], chunks[src])
    return acc.output(received=blocks)
