"""Chapter 8's low-rank decomposition: exact at full rank, optimal (Eckart-Young) below it and
no worse than torch.svd_lowrank, the energy rule, and decomposed models."""

import pytest
import torch
from torch import nn

from dmlbook.model_parallel.efficiency import lowrank
from dmlbook.models import mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def _linear(out_features=24, in_features=40, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def test_full_rank_reconstructs_the_layer():
    for out_features, in_features in ((24, 40), (40, 24), (16, 16)):
        layer = _linear(out_features, in_features)
        full = lowrank.factorize(layer, min(out_features, in_features))
        torch.testing.assert_close(full.weight(), layer.weight, rtol=0, atol=1e-6)
        x = torch.randn(7, in_features)
        torch.testing.assert_close(full(x), layer(x), rtol=1e-5, atol=1e-5)
        assert full.down.weight.shape == (min(out_features, in_features), in_features)


def test_truncation_is_optimal_and_matches_the_svd_product():
    layer = _linear()
    w = layer.weight.detach().double()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    for rank in (1, 3, 8, 20):
        ours = lowrank.factorize(layer, rank).weight().double()
        # torch.linalg.svd's truncated product, U_r S_r V_r^T: the same matrix.
        truncated = u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]
        torch.testing.assert_close(ours, truncated, rtol=0, atol=1e-6)
        # Eckart-Young: the error is the root of the dropped squared singular values ...
        error = torch.linalg.matrix_norm(w - ours).item()
        assert error == pytest.approx(s[rank:].square().sum().sqrt().item(), rel=1e-5)
        # ... and torch's randomized svd_lowrank at the same rank can only be as good or worse.
        torch.manual_seed(rank)
        ul, sl, vl = torch.svd_lowrank(w, q=rank, niter=4)
        theirs = torch.linalg.matrix_norm(w - ul @ torch.diag(sl) @ vl.T).item()
        assert error <= theirs * (1 + 1e-6)
        assert theirs < 1.3 * error  # and close to it: both find the top directions


def test_energy_rank():
    weight = torch.diag(torch.tensor([2.0, 2.0, 1.0, 1.0]))  # squared: 4, 4, 1, 1 of 10
    assert lowrank.energy_rank(weight, 0.4) == 1
    assert lowrank.energy_rank(weight, 0.8) == 2  # exactly 8 / 10: two are enough
    assert lowrank.energy_rank(weight, 0.81) == 3
    assert lowrank.energy_rank(weight, 1.0) == 4
    layer = _linear()
    for keep in (0.5, 0.9, 0.99):
        r = lowrank.energy_rank(layer.weight, keep)
        w = layer.weight.detach().double()
        kept = lowrank.factorize(layer, r).weight().double().square().sum() / w.square().sum()
        assert kept >= keep - 1e-6
        if r > 1:
            less = lowrank.factorize(layer, r - 1).weight().double().square().sum()
            assert less / w.square().sum() < keep


def test_decompose_replaces_only_layers_that_get_smaller():
    model = mlp(seed=0, in_features=64, hidden=(128, 128), out_features=10)
    x = torch.randn(5, 64)
    decomposed = lowrank.decompose(model, rank=16)
    kinds = [type(m).__name__ for m in decomposed.layers if not isinstance(m, nn.ReLU)]
    # 10 x 128 at rank 10 would not be smaller than 10 x 128: that layer stays whole.
    assert kinds == ["LowRankLinear", "LowRankLinear", "Linear"]
    params = sum(p.numel() for p in decomposed.parameters())
    assert params < 0.4 * sum(p.numel() for p in model.parameters())
    full = lowrank.decompose(model, keep=1.0)  # every rank full: nothing would get smaller
    assert not any(isinstance(m, lowrank.LowRankLinear) for m in full.modules())
    torch.testing.assert_close(full(x), model(x))
    assert lowrank.breakeven_rank(128, 128) == 63  # 63 * 256 < 128 * 128 <= 64 * 256


def test_time_ranks_reports_every_variant():
    times = lowrank.time_ranks(64, 64, [4, 16], batch=8, rounds=2)
    assert list(times) == ["dense", "rank 4", "rank 16"] and all(t > 0 for t in times.values())


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rank must be in \[1, 24\]"):
        lowrank.factorize(_linear(), 25)
    with pytest.raises(ValueError, match="exactly one of"):
        lowrank.decompose(mlp(), rank=4, keep=0.9)
    with pytest.raises(ValueError, match="keep must be"):
        lowrank.energy_rank(torch.eye(3), 0.0)
    with pytest.raises(ValueError, match="expected a matrix"):
        lowrank.energy_rank(torch.ones(3), 0.5)
