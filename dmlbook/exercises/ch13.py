"""Checkers for chapter 13's exercises ("Putting it together").

1. ``check_online_softmax_merge``: write ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``,
   attention over the keys of A and B together from attention over each (outputs ``(..., t,
   D)``, log-sum-exps ``(..., t)``), as ring attention folds in each block; a query that no key
   of either part reached (``lse = -inf`` on both sides) must come out as zeros, not NaN.
2. ``check_all_to_all_dispatch``: write ``dispatch(expert, n_experts, world_size) -> (order,
   send_counts)``: with experts laid out in contiguous blocks of ``n_experts / world_size`` per
   rank, the token indices in the order they are sent (grouped by expert, tokens of one expert in
   their original order) and how many go to each rank; ValueError when the experts do not divide.
3. ``check_expert_groups``: write ``expert_groups(pp, dp, cp, tp, ep) -> {"dp_cp": [...], "ep":
   [...], "edp": [...]}``: on the rank grid ``(pp, dp, cp, tp)``, ``tp`` fastest, the ranks that
   hold the same dense weights (``dp_cp``), the expert-parallel groups (``ep`` consecutive ranks
   of each ``dp_cp`` group) and the expert data-parallel groups (the ranks at the same place of
   those ``ep`` groups); each list in group-rank order, the lists in order of their first rank;
   ValueError when ``ep`` does not divide ``dp x cp``.

Each checker names in ``writes=`` the library functions that do its exercise's job (dmlbook's and
torch's); they are switched off while the learner's answer runs, so an answer that only calls
one of them is told to write the mechanism.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch

from dmlbook.advanced.composition.layout import Layout
from dmlbook.advanced.context_parallel import merge
from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code

__all__ = ["check_all_to_all_dispatch", "check_expert_groups", "check_online_softmax_merge"]


def _importable(name: str) -> bool:
    """Whether a torch-internal counterpart exists in this torch (its home moves between
    versions); a checker names it in ``writes`` only where it does."""
    module, _, rest = name.partition(":")
    try:
        owner = importlib.import_module(module)
        for attribute in rest.split("."):
            owner = getattr(owner, attribute)
    except (ImportError, AttributeError):
        return False
    return True


_TORCH_CP = "torch.distributed.tensor.experimental._context_parallel._attention"
# torch's ring attention merges each block's (output, log-sum-exp) in this method.
_TORCH_MERGE = tuple(
    f"{_TORCH_CP}.{rest}"
    for rest in ("_SDPAMerger._merge_one",)
    if _importable(f"{_TORCH_CP}:{rest}")
)


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
    # Large scores: e^800 overflows float64 (largest ~e^709), e^100 overflows float32 (~e^88).
    for dtype, big in ((torch.float64, 800.0), (torch.float32, 100.0)):
        out_a = torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype)
        out_b = torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype)
        lse_a = torch.tensor([big, big + 1.5, big - 2.0, big], dtype=dtype)
        lse_b = torch.tensor([big + 0.5, big, big + 3.0, big - 40.0], dtype=dtype)
        cases.append((out_a, lse_a, out_b, lse_b))
    return cases


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to rounding in the case's dtype (float32 cases get float32's tolerance)."""
    if got.dtype != want.dtype:
        got = got.to(want.dtype)
    tight = want.dtype == torch.float64
    rtol, atol = (1e-9, 1e-12) if tight else (1e-5, 1e-6)
    return got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=atol)


def _nan_hint(call: str, out, lse, lse_a, lse_b) -> str:
    """Why an answer returned NaN or infinity, for each kind of row it did so in: rows no key
    reached, rows only one part reached (one lse = -inf), rows whose e^lse overflows."""
    bad = torch.isnan(lse) | ~torch.isfinite(out).all(dim=-1)
    empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    one_sided = torch.isneginf(lse_a) ^ torch.isneginf(lse_b)
    large = ~empty & ~one_sided & (torch.maximum(lse_a, lse_b) > 80)
    why = []
    if bool((bad & empty).any()):
        why.append(
            "where a row was reached by no key (lse = -inf on both sides): exp(-inf - (-inf)) "
            "is NaN; give such rows weight 0 (output zeros, lse -inf)"
        )
    if bool((bad & one_sided).any()):
        why.append(
            "where a row was reached by the keys of one part only (the other's lse = -inf): "
            "-inf - (-inf) and inf - inf are NaN; that part's weight must come out 0, the "
            "other's 1, and lse the reached part's"
        )
    if bool((bad & large).any()):
        why.append(
            f"where the log-sum-exps are large (here up to {float(lse_a.max()):.0f}): e^lse "
            f"overflows ({lse.dtype} holds at most about "
            f"e^{math.log(torch.finfo(lse.dtype).max):.0f}), and inf / inf is NaN. Never "
            "exponentiate a log-sum-exp alone: subtract the merged (or the larger) one first, "
            "e^(lse_a - lse), which is at most 1"
        )
    if bool((bad & ~empty & ~one_sided & ~large).any()):
        rows = (bad & ~empty & ~one_sided & ~large).reshape(-1).nonzero().flatten()[:4].tolist()
        why.append(
            f"in rows {rows} (flattened), where lse_a = {lse_a.reshape(-1)[rows].tolist()} and "
            f"lse_b = {lse_b.reshape(-1)[rows].tolist()}"
        )
    return f"{call} returned NaN or infinity " + "; and ".join(why)


@checker(
    "online_softmax_merge",
    writes=("dmlbook.advanced.context_parallel.ring.merge", *_TORCH_MERGE),
)
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
        if not (torch.is_tensor(out) and torch.is_tensor(lse)):
            raise ExerciseFailed(f"{call} returned {type(out).__name__}, {type(lse).__name__}; "
                                 "expected two tensors")  # fmt: skip
        if out.shape != want_out.shape or lse.shape != want_lse.shape:
            raise ExerciseFailed(
                f"{call} returned shapes {tuple(out.shape)}, {tuple(lse.shape)}; expected "
                f"{tuple(want_out.shape)}, {tuple(want_lse.shape)}"
            )
        if torch.isnan(out).any() or torch.isnan(lse).any() or not torch.isfinite(out).all():
            raise ExerciseFailed(_nan_hint(call, out, lse, lse_a, lse_b))
        if not _close(lse, want_lse):
            hint = ""
            if _close(lse, torch.maximum(lse_a, lse_b)):
                hint = (
                    ": that is the larger log-sum-exp; the denominators add, lse = log(e^a + e^b)"
                )
            elif _close(lse, lse_a + lse_b):
                hint = (
                    ": that is lse_a + lse_b, the log of the denominators' *product*; the "
                    "denominators add, lse = log(e^lse_a + e^lse_b)"
                )
            raise ExerciseFailed(f"{call}: lse\n{lse}\nexpected\n{want_lse}{hint}")
        if not _close(out, want_out):
            weight_a = (lse_a - want_lse).exp().nan_to_num(0.0).unsqueeze(-1)
            weight_b = (lse_b - want_lse).exp().nan_to_num(0.0).unsqueeze(-1)
            if _close(out, (out_a + out_b) / 2):
                hint = (
                    ": that is the plain average; weight each part by its share of the "
                    "softmax denominator, e^(lse_a - lse) and e^(lse_b - lse)"
                )
            elif _close(out, weight_b * out_a + weight_a * out_b):
                hint = (
                    ": the weights are swapped; out_a's share is e^(lse_a - lse), the part of "
                    "the denominator that A's keys contributed"
                )
            elif _close(out, out_a + out_b):
                hint = ": that is the plain sum; weight each part by e^(lse_part - lse)"
            else:
                hint = (
                    ": each part's output is a softmax-weighted average over its own keys; "
                    "rescale it by that part's share of the merged denominator, e^(lse_a - lse) "
                    "and e^(lse_b - lse), and add"
                )
            raise ExerciseFailed(f"{call}: out\n{out}\nexpected\n{want_out}{hint}")
    return (
        f"right outputs and log-sum-exps for {len(_merge_cases())} cases, empty rows and "
        "large (overflowing) log-sum-exps in float64 and float32 included"
    )


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


class _TiesReversed:
    """While the learner's dispatch runs, a sort not asked to be stable returns ties in reversed
    order: a valid answer of an unstable sort (torch promises nothing about ties unless
    ``stable=True``, and on a GPU, or another build, they do come back shuffled), so an answer
    that relies on ties keeping their order fails here as it would there."""

    def __init__(self) -> None:
        self.saved = {}

    def __enter__(self):
        sort = torch.sort

        def fake_sort(input, dim=-1, descending=False, stable=None, *, out=None):
            if stable or out is not None or input.dim() != 1:
                return sort(input, dim=dim, descending=descending, stable=bool(stable), out=out)
            values, indices = sort(input.flip(0), descending=descending, stable=True)
            return torch.return_types.sort((values, len(input) - 1 - indices))

        def fake_argsort(input, dim=-1, descending=False, stable=False):
            return fake_sort(input, dim=dim, descending=descending, stable=stable).indices

        def method(fn):
            return lambda self, *args, **kwargs: fn(self, *args, **kwargs)

        for owner, name, fake in ((torch, "sort", fake_sort), (torch, "argsort", fake_argsort),
                                  (torch.Tensor, "sort", method(fake_sort)),
                                  (torch.Tensor, "argsort", method(fake_argsort))):  # fmt: skip
            self.saved[(owner, name)] = getattr(owner, name)
            setattr(owner, name, fake)
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)


@checker(
    "all_to_all_dispatch",
    writes=(
        "dmlbook.advanced.expert_parallel.moe.Routing.order",
        "dmlbook.advanced.expert_parallel.layer.ExpertParallelMoE.dispatch",
        "dmlbook.comm.alltoall.all_to_all_single",
        "dmlbook.comm.alltoall.differentiable_all_to_all",
        "torch.distributed.all_to_all_single",
        "torch.distributed.all_to_all",
    ),
)
def check_all_to_all_dispatch(fn: Callable[[torch.Tensor, int, int], tuple]) -> str:
    """Check ``fn(expert, n_experts, world_size)`` returns the send order (grouped by expert,
    stable) and the rows per destination rank, and raises ValueError when experts do not divide."""
    for expert_list, n_experts, world in _dispatch_cases():
        expert = torch.tensor(expert_list)
        call = f"your dispatch(expert={expert_list}, n_experts={n_experts}, world_size={world})"
        with learner_code(call):
            try:
                with _TiesReversed():
                    got = fn(expert.clone(), n_experts, world)
            except ValueError as error:
                raise ExerciseFailed(
                    f"{call} raised ValueError ({error}), but {n_experts} experts divide over "
                    f"{world} ranks ({n_experts // world} each): raise only when n_experts % "
                    "world_size is not 0"
                ) from error
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
            per_rank = n_experts // world
            rank_order = torch.sort(expert // per_rank, stable=True).indices.tolist()
            if sorted(order) != list(range(len(expert_list))):
                hint = ": order must list every token index exactly once"
            elif [expert_list[i] for i in order] == sorted(expert_list):
                hint = (
                    ": grouped by expert, but tokens of one expert out of their original order. "
                    "Sort with stable=True: without it torch may return equal keys in any order "
                    "(a GPU sort may), and then the rows no longer line up with the tokens "
                    "the combine step adds them back to"
                )
            elif order == rank_order or [expert_list[i] // per_rank for i in order] == sorted(
                e // per_rank for e in expert_list
            ):
                hint = (
                    ": grouped by destination rank, but not by expert inside it; the receiving "
                    "rank runs its experts one after another on consecutive rows, so expert e's "
                    "rows must all come before expert e + 1's"
                )
            else:
                hint = ": list the tokens sorted by expert, each expert's tokens by index"
            raise ExerciseFailed(f"{call} gave order {order}, expected {want_order}{hint}")
    expect_value_error(
        "your dispatch(expert=[0, 1, 2], n_experts=3, world_size=2)",
        lambda: _with_ties_reversed(fn, torch.tensor([0, 1, 2]), 3, 2),
        "3 experts cannot be split into equal blocks over 2 ranks",
    )
    return f"right send order and counts for {len(_dispatch_cases())} routings; ValueError too"


def _with_ties_reversed(fn, *args):
    with _TiesReversed():
        return fn(*args)


# --------------------------------------------------------------------------- 3. expert groups


def _expert_cases() -> list[tuple[int, int, int, int, int]]:
    """(pp, dp, cp, tp, ep): ep over cp, over part of cp, over dp, over dp and cp, odd sizes,
    none (not the layouts the chapter prints: their groups are on the page)."""
    return [
        (1, 2, 2, 1, 2),  # ep inside each dp row of cp ranks
        (2, 1, 4, 2, 2),  # ep = 2 of cp = 4: two ep groups per dp_cp group
        (1, 4, 1, 1, 2),
        (2, 2, 2, 1, 4),  # ep spans dp and cp
        (1, 3, 2, 1, 3),  # odd sizes: ep=3 of dp x cp = 6
        (1, 2, 1, 2, 1),  # no expert parallelism: ep groups of one rank
    ]


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


_EXPERT_NAMES = ("dp_cp", "ep", "edp")


def _expert_hint(name: str, mine: list[list[int]], table: dict[str, list[list[int]]]) -> str:
    """Why ``mine`` is not the ``name`` groups: the other EP group, groups spanning tp or pp,
    or the right groups in the wrong order."""
    want = table[name]
    as_sets = sorted(map(sorted, mine))
    if as_sets == sorted(map(sorted, want)):
        return _order_hint(mine, want)
    other = {"ep": "edp", "edp": "ep"}.get(name)
    if other and as_sets == sorted(map(sorted, table[other])):
        return (
            f": those are the {other} groups. An ep group is ep *consecutive* ranks of the dp x cp "
            "ranks (number them i = dp_index * cp + cp_index); edp joins the ranks at the same "
            "place i % ep of different ep groups"
        )
    if mine and any(len(g) != len(w) for g, w in zip(mine, want, strict=False)):
        return (
            f": each {name} group has {len(want[0])} ranks, yours {sorted({len(g) for g in mine})}"
        )
    return (
        ": every group's ranks share pp and tp (the same layers, the same weight slices); only "
        "the dp and cp coordinates vary inside dp_cp"
    )


@checker(
    "expert_groups",
    writes=(
        "dmlbook.advanced.composition.layout.Layout.grid_groups",
        "dmlbook.advanced.composition.layout.Layout.group_ranks",
        "dmlbook.advanced.composition.layout.Layout.groups_of",
        "dmlbook.advanced.composition.layout.Layout.coordinates",
        "dmlbook.advanced.composition.layout.Layout.rank_of",
        "torch.distributed.device_mesh.init_device_mesh",
    ),
)
def check_expert_groups(fn: Callable[[int, int, int, int, int], dict]) -> str:
    """Check ``fn(pp, dp, cp, tp, ep)`` returns the ``dp_cp``, ``ep`` and ``edp`` groups of the
    (pp, dp, cp, tp) grid as :meth:`dmlbook.advanced.composition.layout.Layout.group_ranks`
    builds them, and raises ValueError when ``ep`` does not divide ``dp x cp``."""
    for pp, dp, cp, tp, ep in _expert_cases():
        call = f"your expert_groups(pp={pp}, dp={dp}, cp={cp}, tp={tp}, ep={ep})"
        with learner_code(call):
            try:
                got = fn(pp, dp, cp, tp, ep)
            except ValueError as error:
                why = ""
                if dp % ep and not (dp * cp) % ep:
                    why = (
                        f" You seem to test dp % ep ({dp} % {ep}): an ep group may span both dp "
                        "and cp, so the test is whether ep divides dp x cp"
                    )
                raise ExerciseFailed(
                    f"{call} raised ValueError ({error}), but ep={ep} divides dp x cp = "
                    f"{dp * cp}: this grid has {dp * cp // ep} ep group(s) per dp_cp group.{why}"
                ) from error
        table = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).group_ranks()  # library on again
        if not isinstance(got, dict) or set(got) != set(_EXPERT_NAMES):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ExerciseFailed(f"{call} returned {keys}; expected the keys dp_cp, ep, edp")
        for name in _EXPERT_NAMES:
            mine = [list(map(int, g)) for g in got[name]]
            if mine != table[name]:
                hint = _expert_hint(name, mine, table)
                raise ExerciseFailed(f"{call}[{name!r}] = {mine}, expected {table[name]}{hint}")
    expect_value_error(
        "your expert_groups(pp=1, dp=3, cp=1, tp=1, ep=2)",
        lambda: fn(1, 3, 1, 1, 2),
        "ep=2 does not divide dp x cp = 3, so the experts' groups cannot tile the ranks",
    )
    return f"right dp_cp, ep and edp groups for {len(_expert_cases())} grids; ValueError too"
