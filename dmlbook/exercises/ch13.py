"""Checkers for chapter 13's exercises ("Putting it together").

1. ``check_online_softmax_merge``: write ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``,
   attention over the keys of A and B together from attention over each (outputs ``(..., t,
   D)``, log-sum-exps ``(..., t)``), as ring attention folds in each block; a query that no key
   of either part reached (``lse = -inf`` on both sides) must come out as zeros, not NaN.
2. ``check_all_to_all_dispatch``: write ``dispatch(expert, n_experts, world_size) -> (order,
   send_counts)``: with experts laid out in contiguous blocks of ``n_experts / world_size`` per
   rank, the token indices in the order they are sent (grouped by expert, tokens of one expert in
   their original order) and how many go to each rank; ValueError when the experts do not divide.
3. ``check_mesh_groups``: write ``groups(pp, dp, cp, tp) -> {"pp": [...], "dp": [...], "cp":
   [...], "tp": [...]}``: for each dimension the lists of global ranks that differ only in that
   coordinate, on the grid ``(pp, dp, cp, tp)`` with ``tp`` varying fastest, each list in
   coordinate order, the lists in order of their first rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmlbook.advanced.composition.layout import Layout
from dmlbook.advanced.context_parallel import merge
from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code

__all__ = ["check_all_to_all_dispatch", "check_mesh_groups", "check_online_softmax_merge"]


# --------------------------------------------------------------------------- 1. the merge


def _merge_cases() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(13)
    cases = []
    for shape in ((3, 4), (2, 2, 5, 3), (1, 6)):
        out_a = torch.randn(*shape, generator=g, dtype=torch.float64)
        out_b = torch.randn(*shape, generator=g, dtype=torch.float64)
        lse_a = torch.randn(*shape[:-1], generator=g, dtype=torch.float64) * 3
        lse_b = torch.randn(*shape[:-1], generator=g, dtype=torch.float64) * 3
        cases.append((out_a, lse_a, out_b, lse_b))
    out = torch.ones(3, 2, dtype=torch.float64)  # row 0: only A saw keys; row 1: only B; row 2:
    lse_a = torch.tensor([1.0, float("-inf"), float("-inf")], dtype=torch.float64)  # none
    lse_b = torch.tensor([float("-inf"), 2.0, float("-inf")], dtype=torch.float64)
    cases.append((out * 2, lse_a, out * 3, lse_b))
    return cases


@checker("online_softmax_merge")
def check_online_softmax_merge(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Check ``fn(out_a, lse_a, out_b, lse_b)`` against the online-softmax rule, on random parts
    and on rows that only one part (or neither) reached."""
    for i, (out_a, lse_a, out_b, lse_b) in enumerate(_merge_cases()):
        call = f"your merge(case {i}: outputs {tuple(out_a.shape)}, lse {tuple(lse_a.shape)})"
        with learner_code(call):
            got = fn(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
        want_out, want_lse = merge(out_a, lse_a, out_b, lse_b)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed(f"{call} returned {type(got).__name__}, not (out, lse)")
        out, lse = got
        if torch.isnan(out).any() or torch.isnan(lse).any():
            raise ExerciseFailed(
                f"{call} returned NaN where a row was reached by no key (lse = -inf on both "
                "sides): exp(-inf - (-inf)) is NaN; give such rows weight 0 (output zeros)"
            )
        if out.shape != want_out.shape or lse.shape != want_lse.shape:
            raise ExerciseFailed(
                f"{call} returned shapes {tuple(out.shape)}, {tuple(lse.shape)}; expected "
                f"{tuple(want_out.shape)}, {tuple(want_lse.shape)}"
            )
        if not torch.allclose(lse, want_lse, rtol=1e-9, atol=1e-12, equal_nan=False):
            hint = ""
            if torch.allclose(lse, torch.maximum(lse_a, lse_b)):
                hint = (
                    ": that is the larger log-sum-exp; the denominators add, lse = log(e^a + e^b)"
                )
            raise ExerciseFailed(f"{call}: lse\n{lse}\nexpected\n{want_lse}{hint}")
        if not torch.allclose(out, want_out, rtol=1e-9, atol=1e-12):
            hint = ""
            if torch.allclose(out, (out_a + out_b) / 2):
                hint = (
                    ": that is the plain average; weight each part by its share of the "
                    "softmax denominator, e^(lse_a - lse) and e^(lse_b - lse)"
                )
            raise ExerciseFailed(f"{call}: out\n{out}\nexpected\n{want_out}{hint}")
    return f"right outputs and log-sum-exps for {len(_merge_cases())} cases, empty rows included"


# --------------------------------------------------------------------------- 2. dispatch


def _expected_dispatch(expert: torch.Tensor, n_experts: int, world: int):
    per_rank = n_experts // world
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert // per_rank, minlength=world)
    return order.tolist(), counts.tolist()


def _dispatch_cases() -> list[tuple[list[int], int, int]]:
    return [
        ([3, 0, 2, 0, 1, 3, 2], 4, 2),
        ([5, 1, 1, 4, 0, 2, 5, 3, 0], 6, 3),
        ([0, 0, 0], 4, 4),  # every token to rank 0: the other ranks get nothing
        ([7, 6, 5, 4, 3, 2, 1, 0, 7, 0], 8, 2),
        ([1, 0], 2, 1),  # one rank: nothing leaves
    ]


@checker("all_to_all_dispatch")
def check_all_to_all_dispatch(fn: Callable[[torch.Tensor, int, int], tuple]) -> str:
    """Check ``fn(expert, n_experts, world_size)`` returns the send order (grouped by expert,
    stable) and the rows per destination rank, and raises ValueError when experts do not divide."""
    for expert_list, n_experts, world in _dispatch_cases():
        expert = torch.tensor(expert_list)
        call = f"your dispatch(expert={expert_list}, n_experts={n_experts}, world_size={world})"
        with learner_code(call):
            got = fn(expert.clone(), n_experts, world)
        want_order, want_counts = _expected_dispatch(expert, n_experts, world)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed(f"{call} returned {type(got).__name__}, not (order, send_counts)")
        order, counts = (list(map(int, x.tolist() if torch.is_tensor(x) else x)) for x in got)
        if counts != want_counts:
            hint = ""
            if counts == torch.bincount(expert, minlength=n_experts).tolist():
                hint = ": those are tokens per expert; the all-to-all needs rows per rank"
            elif counts == torch.bincount(expert % world, minlength=world).tolist():
                hint = (
                    ": that places expert e on rank e % world_size; each rank holds a "
                    "contiguous block of n_experts / world_size experts"
                )
            raise ExerciseFailed(f"{call} gave send_counts {counts}, expected {want_counts}{hint}")
        if order != want_order:
            hint = ""
            if sorted(order) == sorted(want_order) and [expert_list[i] for i in order] == sorted(
                expert_list
            ):
                hint = (
                    ": grouped by expert, but tokens of one expert out of their original order "
                    "(sort stably), so the combine step would return results to the wrong tokens"
                )
            raise ExerciseFailed(f"{call} gave order {order}, expected {want_order}{hint}")
    expect_value_error(
        "your dispatch(expert=[0, 1, 2], n_experts=3, world_size=2)",
        lambda: fn(torch.tensor([0, 1, 2]), 3, 2),
        "3 experts cannot be split into equal blocks over 2 ranks",
    )
    return f"right send order and counts for {len(_dispatch_cases())} routings; ValueError too"


# --------------------------------------------------------------------------- 3. mesh groups


def _mesh_cases() -> list[tuple[int, int, int, int]]:
    return [(2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (1, 3, 1, 2), (2, 1, 1, 4), (1, 1, 1, 1)]


def _order_hint(mine: list[list[int]], want: list[list[int]]) -> str:
    """Why the right groups came out in the wrong order: the groups listed out of order (a loop
    over the other coordinates nested in another order), their ranks out of order, or both."""
    members_ok = [sorted(g) == g for g in mine] == [True] * len(mine)
    listed_ok = [g[0] for g in map(sorted, mine)] == [g[0] for g in want]
    why = []
    if not listed_ok:
        why.append(
            "the groups are listed in another order (your loops over the other coordinates "
            "nest in another order than the grid's); sort the groups by their first rank"
        )
    if not members_ok:
        why.append(
            "ranks inside a group are out of order: a rank's index in its group is its "
            "coordinate along the dimension, so list each group's ranks in increasing order"
        )
    return ": the right groups, but " + "; and ".join(why)


@checker("mesh_groups")
def check_mesh_groups(fn: Callable[[int, int, int, int], dict]) -> str:
    """Check ``fn(pp, dp, cp, tp)`` returns every dimension's groups on the (pp, dp, cp, tp)
    grid, tp fastest, as :meth:`dmlbook.advanced.composition.layout.Layout.group_ranks` builds
    them."""
    for pp, dp, cp, tp in _mesh_cases():
        call = f"your groups(pp={pp}, dp={dp}, cp={cp}, tp={tp})"
        with learner_code(call):
            got = fn(pp, dp, cp, tp)
        table = Layout(dp=dp, tp=tp, pp=pp, cp=cp).group_ranks()
        if not isinstance(got, dict) or set(got) != {"pp", "dp", "cp", "tp"}:
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ExerciseFailed(f"{call} returned {keys}; expected the keys pp, dp, cp, tp")
        for name in ("tp", "cp", "dp", "pp"):
            mine = [list(map(int, g)) for g in got[name]]
            if mine == table[name]:
                continue
            hint = ""
            if sorted(map(sorted, mine)) == sorted(map(sorted, table[name])):
                hint = _order_hint(mine, table[name])
            elif name == "tp" and tp > 1 and mine and mine[0][1] - mine[0][0] != 1:
                hint = (
                    ": TP groups should be neighbouring ranks (tp varies fastest), so that "
                    "they share a machine's fast links"
                )
            raise ExerciseFailed(f"{call}[{name!r}] = {mine}, expected {table[name]}{hint}")
    return f"right groups for {len(_mesh_cases())} grids"
