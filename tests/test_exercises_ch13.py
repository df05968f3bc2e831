"""Chapter 13's exercise checkers: right answers pass; planted bugs (a plain average of the two
outputs, the larger log-sum-exp, NaN on rows no key reached; tokens per expert instead of rows
per rank, experts placed round-robin, an unstable sort, no ValueError; TP as the slowest
dimension, groups listed out of order, ranks inside a group out of order) are caught with a
message that says so."""

import pytest
import torch

from dmlbook.exercises import ExerciseFailed, ch13


def unanswered(*args):
    raise NotImplementedError


# ---- 1. the online-softmax merge --------------------------------------------------------------


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa, wb = (lse_a - safe).exp().unsqueeze(-1), (lse_b - safe).exp().unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_max(out_a, lse_a, out_b, lse_b):
    return merge(out_a, lse_a, out_b, lse_b)[0], torch.maximum(lse_a, lse_b)


def merge_nan(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = (lse_a - lse).exp().unsqueeze(-1), (lse_b - lse).exp().unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def test_merge_passes_the_right_answer_and_not_attempted():
    assert ch13.check_online_softmax_merge(merge).status == "passed"
    assert ch13.check_online_softmax_merge(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [(merge_average, "plain average"), (merge_max, "larger log-sum-exp"), (merge_nan, "NaN")],
)
def test_merge_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch13.check_online_softmax_merge(answer)


# ---- 2. the all-to-all dispatch ---------------------------------------------------------------


def dispatch(expert, n_experts, world_size):
    if n_experts % world_size:
        raise ValueError("experts do not divide")
    order = torch.sort(expert, stable=True).indices
    return order, torch.bincount(expert // (n_experts // world_size), minlength=world_size)


def dispatch_per_expert(expert, n_experts, world_size):
    return dispatch(expert, n_experts, world_size)[0], torch.bincount(expert, minlength=n_experts)


def dispatch_round_robin(expert, n_experts, world_size):
    order = dispatch(expert, n_experts, world_size)[0]
    return order, torch.bincount(expert % world_size, minlength=world_size)


def dispatch_unstable(expert, n_experts, world_size):
    order, counts = dispatch(expert, n_experts, world_size)
    key = expert * len(expert) + (len(expert) - 1 - torch.arange(len(expert)))
    return torch.sort(key).indices, counts  # ties reversed


def dispatch_no_check(expert, n_experts, world_size):
    per = max(1, n_experts // world_size)
    order = torch.sort(expert, stable=True).indices
    return order, torch.bincount((expert // per).clamp(max=world_size - 1), minlength=world_size)


def test_dispatch_passes_the_right_answer_and_not_attempted():
    assert ch13.check_all_to_all_dispatch(dispatch).status == "passed"
    assert ch13.check_all_to_all_dispatch(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (dispatch_per_expert, "tokens per expert"),
        (dispatch_round_robin, "e % world_size"),
        (dispatch_unstable, "sort stably"),
        (dispatch_no_check, "instead of raising ValueError"),
    ],
)
def test_dispatch_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch13.check_all_to_all_dispatch(answer)


# ---- 3. mesh groups ---------------------------------------------------------------------------


def groups(pp, dp, cp, tp):
    grid = torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
    return {
        name: grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
        for d, name in enumerate(("pp", "dp", "cp", "tp"))
    }


def groups_tp_slowest(pp, dp, cp, tp):
    grid = torch.arange(pp * dp * cp * tp).reshape(tp, pp, dp, cp).permute(1, 2, 3, 0)
    return {
        name: grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
        for d, name in enumerate(("pp", "dp", "cp", "tp"))
    }


def groups_reversed(pp, dp, cp, tp):
    return {name: [g[::-1] for g in gs] for name, gs in groups(pp, dp, cp, tp).items()}


def groups_loops_nested_the_other_way(pp, dp, cp, tp):
    """The right groups, listed with the other coordinates' loops nested fastest-first (for dp
    on the 2 x 2 x 1 x 2 grid: [0, 2], [4, 6], [1, 3], [5, 7] instead of by first rank)."""
    grid = torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
    out = {}
    for d, name in enumerate(("pp", "dp", "cp", "tp")):
        moved = grid.movedim(d, -1)  # (the other three, this one)
        out[name] = moved.permute(2, 1, 0, 3).reshape(-1, grid.shape[d]).tolist()
    return out


def groups_both_orders_wrong(pp, dp, cp, tp):
    mixed = groups_loops_nested_the_other_way(pp, dp, cp, tp)
    return {name: [g[::-1] for g in gs] for name, gs in mixed.items()}


def test_mesh_groups_passes_the_right_answer_and_not_attempted():
    assert ch13.check_mesh_groups(groups).status == "passed"
    assert ch13.check_mesh_groups(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (groups_tp_slowest, "neighbouring ranks"),
        (groups_reversed, "ranks inside a group are out of order"),
        (groups_loops_nested_the_other_way, "sort the groups by their first rank"),
        (groups_both_orders_wrong, "first rank; and ranks inside a group"),
    ],
)
def test_mesh_groups_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch13.check_mesh_groups(answer)
