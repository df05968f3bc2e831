"""Chapter 3's data-parallel serving and parallel hyper-parameter search, against one process."""

import pytest
import torch
import torch.distributed as dist

from dmlbook.comm.groups import balanced_blocks
from dmlbook.data_parallel import serving, tuning
from dmlbook.launch import RankError, run
from dmlbook.models import mlp

INPUTS = 37  # not divisible by 2, 3 or 4


def _model():
    return mlp(seed=0, in_features=6, hidden=(8,), out_features=3)


def _inputs(n=INPUTS):
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(1))


def _score(config):
    """A made-up trial whose best is lr=0.3; the two 'wd' values tie exactly."""
    return -((config["lr"] - 0.3) ** 2)


CONFIGS = [{"lr": lr, "wd": wd} for lr in (0.1, 0.3, 1.0) for wd in (0.0, 0.1)]


def _serve_and_search():
    world = dist.get_world_size()
    model = _model()
    return {
        "all": serving.predict(model, _inputs(), batch_size=5),
        "few": serving.predict(model, _inputs()[: world - 1], batch_size=5) if world > 1 else None,
        "mine": serving.predict(model, _inputs(), batch_size=5, gather=False),
        "search": tuning.search(_score, CONFIGS),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_predict_and_search_equal_one_process(world):
    reference = _model().eval()(_inputs()).detach()
    expected = tuning.search(_score, CONFIGS)  # outside a process group: every trial in turn
    results = run(_serve_and_search, world, timeout=60)
    sizes = []
    for rank, r in enumerate(results):
        # rows are computed in different batches on different ranks: float32 rounding only
        torch.testing.assert_close(r["all"], reference, rtol=1e-6, atol=1e-6)
        if world > 1:  # fewer inputs than ranks: the last rank serves nothing, order still holds
            torch.testing.assert_close(r["few"], reference[: world - 1], rtol=1e-6, atol=1e-6)
        start, stop = balanced_blocks(INPUTS, world)[rank]
        torch.testing.assert_close(r["mine"], reference[start:stop], rtol=1e-6, atol=1e-6)
        sizes.append(len(r["mine"]))
        assert r["search"].scores == expected.scores
        assert r["search"].best == expected.best == 2  # lr=0.3, wd=0.0: the lower index wins
    assert sum(sizes) == INPUTS and max(sizes) - min(sizes) <= 1
    ran = sorted(i for r in results for i in r["search"].ran_here)
    assert ran == list(range(len(CONFIGS)))  # every trial ran exactly once


def _nan_trial():
    tuning.search(lambda c: float("nan") if c == 1 else 0.0, [0, 1])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one config"):
        tuning.search(_score, [])
    with pytest.raises(ValueError, match="batch_size"):
        serving.predict(_model(), _inputs(), batch_size=0)
    with pytest.raises(RankError, match=r"trial 1 \(1\) returned NaN"):
        run(_nan_trial, 2, timeout=20)
