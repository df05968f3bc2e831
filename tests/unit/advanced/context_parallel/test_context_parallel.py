"""dmlbook.advanced.context_parallel: ring attention and the all-gather-K/V variant equal torch's
``scaled_dot_product_attention`` on the whole sequence (causal and not; outputs and q/k/v
gradients in float64 to 1e-12) at world sizes 1-4, with the contiguous chunks at sequence
lengths that do not divide (and one with fewer positions than ranks) and the zigzag chunks; the
online-softmax merge alone; the work each rank computes, measured, equals the chunks' prediction
and is balanced by zigzag; bad chunk lists and shapes raise ValueError naming the dimension, on
every rank, and the ranks stay in step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_checks import by_world, caught
from torch.nn import functional as F

from dmlbook.advanced import context_parallel as cp
from dmlbook.comm.groups import group_rank_size

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, D = 2, 2, 4
TOL = 1e-12
# (chunks, sequence length, causal): 7 and 13 divide by none of 2, 3, 4; 3 < 4 ranks; the zigzag
# chunks need 2 x world to divide, which 24 does for every world size here.
CASES = [("contiguous", 7, True), ("contiguous", 13, True), ("contiguous", 3, True),
         ("zigzag", 24, True), ("contiguous", 7, False)]  # fmt: skip
CHUNKS = {"contiguous": cp.contiguous_chunks, "zigzag": cp.zigzag_chunks}
VARIANTS = {"ring": cp.ring_attention, "all_gather": cp.all_gather_attention}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _checks() -> dict:
    rank, world = group_rank_size()
    out: dict = {"errors": {}, "work": {}}
    for split_name, seq, causal in CASES:
        g = torch.Generator().manual_seed(seq)
        q, k, v, w = (torch.randn(B, H, seq, D, generator=g, dtype=torch.float64) for _ in "qkvw")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*full, is_causal=causal)
        (reference * w).sum().backward()
        chunks = CHUNKS[split_name](seq, world)
        for variant, attention in VARIANTS.items():
            mine = [cp.split(t, chunks, rank).requires_grad_() for t in (q, k, v)]
            with cp.counting_work() as blocks:
                y = attention(*mine, chunks, causal=causal)
            (y * cp.split(w, chunks, rank)).sum().backward()
            errors = [_err(y, cp.split(reference.detach(), chunks, rank))]
            for m, f in zip(mine, full, strict=True):
                errors.append(_err(m.grad, cp.split(f.grad, chunks, rank)))
            key = f"{variant} {split_name} T={seq} causal={causal}"
            out["errors"][key] = max(errors)
            out["work"][key] = sum(b.elements for b in blocks)

    # Errors, raised on every rank alike.
    shape = (B, H, 4, D + (rank == world - 1))  # the last rank's head dim is one larger
    q = torch.zeros(shape, dtype=torch.float64)
    out["bad_head_dim"] = caught(
        lambda: cp.ring_attention(q, q, q, cp.contiguous_chunks(4 * world, world))
    )
    q = torch.zeros(B, H, 3 + (rank == 0), D)  # rank 0 holds one position more than its block
    out["bad_positions"] = caught(
        lambda: cp.all_gather_attention(q, q, q, cp.contiguous_chunks(3 * world, world))
    )
    check = torch.ones(1)
    if world > 1:
        dist.all_reduce(check)
    out["after_errors"] = check.item()
    return out


results = by_world(_checks, timeout=90)


WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_equal_to_scaled_dot_product_attention(world):
    for rank, r in enumerate(results(world)):
        assert len(r["errors"]) == 2 * len(CASES)
        bad = {key: e for key, e in r["errors"].items() if not e <= TOL}
        assert not bad, f"rank {rank} of {world}: {bad}"


@pytest.mark.parametrize("world", WORLDS)
def test_measured_work_equals_the_chunks_prediction(world):
    for rank, r in enumerate(results(world)):
        for split_name, seq, causal in CASES:
            predicted = cp.attention_work(CHUNKS[split_name](seq, world), causal)[rank]
            for variant in VARIANTS:
                assert r["work"][f"{variant} {split_name} T={seq} causal={causal}"] == predicted


def test_zigzag_balances_causal_work():
    # 24 positions on 3 ranks: contiguous blocks of 8 see 1, 2 and 3 blocks of keys ...
    assert cp.attention_work(cp.contiguous_chunks(24, 3)) == [64, 128, 192]
    # ... zigzag chunks of 4 (0 and 5, 1 and 4, 2 and 3) each see 7 chunks: balanced.
    assert cp.attention_work(cp.zigzag_chunks(24, 3)) == [112, 112, 112]
    assert cp.attention_work(cp.zigzag_chunks(32, 4)) == [144] * 4
    assert cp.attention_work(cp.contiguous_chunks(24, 3), causal=False) == [192] * 3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bad_shapes_raise_on_every_rank_naming_the_dimension(world):
    for r in results(world):
        assert "ranks disagree on head dim" in r["bad_head_dim"]
        assert f"rank {world - 1}: {D + 1}" in r["bad_head_dim"]
        assert "ranks disagree on sequence positions: rank 0: 4" in r["bad_positions"]
        assert "the chunks give [3" in r["bad_positions"]
        assert r["after_errors"] == world


def test_zigzag_needs_the_length_to_divide():
    with pytest.raises(ValueError, match=r"sequence length=13 is not divisible by 4"):
        cp.zigzag_chunks(13, 2)
    with pytest.raises(ValueError, match="q, k and v must be"):
        x = torch.zeros(1, 1, 4, 2)
        cp.ring_attention(x, x, x[..., :1], cp.contiguous_chunks(4, 1))


def test_chunk_lists_and_split_round_trip():
    assert cp.zigzag_chunks(8, 2) == [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    assert cp.contiguous_chunks(7, 3) == [[(0, 3)], [(3, 5)], [(5, 7)]]
    x = torch.arange(24).view(1, 1, 24, 1)
    pieces = [cp.zigzag_split(x, r, 3) for r in range(3)]
    assert pieces[0].flatten().tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(cp.zigzag_unsplit(pieces), x)
    chunks = cp.contiguous_chunks(7, 4)
    assert torch.equal(cp.unsplit([cp.split(x[..., :7, :], chunks, r) for r in range(4)], chunks),
                       x[..., :7, :])  # fmt: skip


def test_merge_of_two_halves_is_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in "qkv")
    whole = F.scaled_dot_product_attention(q, k, v)
    a = cp.block_attention(q, k[..., :2, :], v[..., :2, :], (0, 5), (0, 2), causal=False)
    b = cp.block_attention(q, k[..., 2:, :], v[..., 2:, :], (0, 5), (2, 5), causal=False)
    merged, lse = cp.merge(*a, *b)
    assert _err(merged, whole) <= TOL
    scores = q @ k.transpose(-1, -2) / 2.0
    assert _err(lse, scores.logsumexp(-1)) <= TOL
    # A side that saw no key (lse = -inf) changes nothing; two such sides give zeros, not nan.
    empty = (torch.zeros_like(whole), torch.full_like(lse, float("-inf")))
    assert _err(cp.merge(merged, lse, *empty)[0], whole) <= TOL
    assert torch.equal(cp.merge(*empty, *empty)[0], torch.zeros_like(whole))
