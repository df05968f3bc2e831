"""Chapter 13's exercise checkers: right answers pass; planted bugs are caught with a message
that says so: a plain average of the two outputs, the larger log-sum-exp, lse_a + lse_b, swapped
weights, NaN on rows no key (or one part's keys only) reached, e^lse overflowing; tokens per
expert instead of rows per rank, experts placed round-robin, an unstable sort (torch.argsort
without stable=True), grouping by rank only, a ValueError for a valid split or none; the ep and
edp groups swapped, tp ranks inside dp_cp, ranks inside a group out of order, testing dp % ep,
no ValueError. Answers that only call the library are refused."""

import math

import pytest
import torch

from dmlbook.advanced import context_parallel
from dmlbook.advanced.composition.layout import Layout
from dmlbook.advanced.expert_parallel.moe import Routing
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


def merge_unshifted(out_a, lse_a, out_b, lse_b):
    """Right for small scores; e^lse overflows for large ones."""
    ea, eb = lse_a.exp(), lse_b.exp()
    total = ea + eb
    wa = torch.where(total > 0, ea / total, torch.zeros_like(total)).unsqueeze(-1)
    wb = torch.where(total > 0, eb / total, torch.zeros_like(total)).unsqueeze(-1)
    return wa * out_a + wb * out_b, torch.logaddexp(lse_a, lse_b)


def merge_sum(out_a, lse_a, out_b, lse_b):
    return merge(out_a, lse_a, out_b, lse_b)[0], lse_a + lse_b


def merge_swapped(out_a, lse_a, out_b, lse_b):
    out, lse = merge(out_b, lse_a, out_a, lse_b)
    return out, lse


def merge_sigmoid(out_a, lse_a, out_b, lse_b):
    """The sigmoid form, right except that rows no key reached come out NaN."""
    wa = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return wa * out_a + (1 - wa) * out_b, lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)


def test_merge_passes_the_right_answer_and_not_attempted():
    assert ch13.check_online_softmax_merge(merge).status == "passed"
    assert ch13.check_online_softmax_merge(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (merge_average, "plain average"),
        (merge_max, "larger log-sum-exp"),
        (merge_nan, "reached by no key"),
        (merge_unshifted, "overflows"),
        (merge_sum, "product"),
        (merge_swapped, "weights are swapped"),
        (merge_sigmoid, "one part only"),
    ],
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


def dispatch_argsort(expert, n_experts, world_size):
    """torch.argsort without stable=True: ties in any order torch likes."""
    order, counts = dispatch(expert, n_experts, world_size)
    return torch.argsort(expert), counts


def dispatch_method_sort(expert, n_experts, world_size):
    order, counts = dispatch(expert, n_experts, world_size)
    return expert.sort().indices, counts


def dispatch_by_rank(expert, n_experts, world_size):
    order, counts = dispatch(expert, n_experts, world_size)
    return torch.sort(expert // (n_experts // world_size), stable=True).indices, counts


def dispatch_raises_always(expert, n_experts, world_size):
    raise ValueError("no")


def test_dispatch_passes_the_right_answer_and_not_attempted():
    assert ch13.check_all_to_all_dispatch(dispatch).status == "passed"
    assert ch13.check_all_to_all_dispatch(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (dispatch_per_expert, "tokens per expert"),
        (dispatch_round_robin, "e % world_size"),
        (dispatch_unstable, "stable=True"),
        (dispatch_argsort, "stable=True"),
        (dispatch_method_sort, "stable=True"),
        (dispatch_by_rank, "not by expert inside it"),
        (dispatch_raises_always, "raise only when"),
        (dispatch_no_check, "instead of raising ValueError"),
    ],
)
def test_dispatch_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch13.check_all_to_all_dispatch(answer)


# ---- 3. the expert groups --------------------------------------------------------------------


def expert_groups(pp, dp, cp, tp, ep):
    if (dp * cp) % ep:
        raise ValueError("ep must divide dp x cp")
    grid = torch.arange(pp * dp * cp * tp).reshape(pp, dp * cp // ep, ep, tp)
    along = lambda dims: (
        grid.permute(  # noqa: E731
            *[d for d in range(4) if d not in dims], *dims
        )
        .reshape(-1, math.prod(grid.shape[d] for d in dims))
        .tolist()
    )
    return {"dp_cp": along((1, 2)), "ep": along((2,)), "edp": along((1,))}


def expert_groups_swapped(pp, dp, cp, tp, ep):
    right = expert_groups(pp, dp, cp, tp, ep)
    return {**right, "ep": right["edp"], "edp": right["ep"]}


def expert_groups_over_tp(pp, dp, cp, tp, ep):
    """dp_cp taken as every rank of a pipeline stage: tp ranks mixed in."""
    grid = torch.arange(pp * dp * cp * tp).reshape(pp, dp * cp * tp)
    return {**expert_groups(pp, dp, cp, tp, ep), "dp_cp": grid.tolist()}


def expert_groups_reversed(pp, dp, cp, tp, ep):
    return {name: [g[::-1] for g in gs] for name, gs in expert_groups(pp, dp, cp, tp, ep).items()}


def expert_groups_no_check(pp, dp, cp, tp, ep):
    if (dp * cp) % ep:
        return {"dp_cp": [], "ep": [], "edp": []}
    return expert_groups(pp, dp, cp, tp, ep)


def expert_groups_dp_check(pp, dp, cp, tp, ep):
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}")
    return expert_groups(pp, dp, cp, tp, ep)


def test_expert_groups_passes_the_right_answer_and_not_attempted():
    assert ch13.check_expert_groups(expert_groups).status == "passed"
    assert ch13.check_expert_groups(unanswered).status == "not attempted"


@pytest.mark.parametrize(
    "answer, message",
    [
        (expert_groups_swapped, "those are the edp groups"),
        (expert_groups_over_tp, "has 4 ranks"),
        (expert_groups_reversed, "ranks inside a group are out of order"),
        (expert_groups_no_check, "instead of raising ValueError"),
        (expert_groups_dp_check, "divides dp x cp"),
    ],
)
def test_expert_groups_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch13.check_expert_groups(answer)


# ---- answers that only call the library: each is refused (test_back_doors.py) ---


def _routing_of(expert, n_experts):
    n = len(expert)
    return Routing(expert[:, None], torch.ones(n, 1), torch.ones(n, 1, dtype=torch.bool),
                   torch.bincount(expert, minlength=n_experts), n, torch.zeros(()))  # fmt: skip


DELEGATING_ANSWERS = {
    "online_softmax_merge": lambda out_a, lse_a, out_b, lse_b: context_parallel.merge(
        out_a, lse_a, out_b, lse_b
    ),
    "all_to_all_dispatch": lambda expert, n_experts, world_size: (
        _routing_of(expert, n_experts).order()[0],
        torch.bincount(expert // (n_experts // world_size), minlength=world_size),
    ),
    "expert_groups": lambda pp, dp, cp, tp, ep: {
        name: groups
        for name, groups in Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).group_ranks().items()
        if name in ("dp_cp", "ep", "edp")
    },
}


def test_a_hand_made_grid_is_not_a_back_door():
    """The right answer builds its own grid: it passes with the library switched off."""
    assert ch13.check_expert_groups(expert_groups).status == "passed"
