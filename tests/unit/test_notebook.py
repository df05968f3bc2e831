"""dmlbook.notebook: the helpers chapters share."""

import pytest
import torch

from dmlbook.models import mlp
from dmlbook.notebook import digits_mlp, max_difference


def test_digits_mlp_is_the_64_64_10_mlp_of_its_seed():
    model = digits_mlp()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(64, 64), (64,), (10, 64), (10,)]
    again, other = digits_mlp(0), digits_mlp(1)
    assert max_difference(again.state_dict(), model.state_dict()) == 0
    assert max_difference(other.state_dict(), model.state_dict()) > 0
    assert max_difference(mlp(seed=0, hidden=(64,)).state_dict(), model.state_dict()) == 0


def test_max_difference_is_the_largest_gap_and_refuses_missing_keys():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    b = {"w": torch.tensor([1.0, 2.25]), "b": torch.tensor([-0.5])}
    assert max_difference(a, b) == 1.0
    with pytest.raises(KeyError):
        max_difference({"w": a["w"]}, b)
    with pytest.raises(ValueError, match="empty"):
        max_difference(a, {})
