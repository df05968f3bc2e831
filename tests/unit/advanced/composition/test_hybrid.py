"""Tests for chapter 9's DP x TP grid (the rank grid's 2-D case, ``Layout(dp, tp)``) and
dmlbook.advanced.composition.hybrid: the groups of 2x2, 3x1, 1x3, 2x3 and 2x2x2 grids; on real
ranks the groups hold the ranks the table says (and the ranks torch's init_device_mesh puts
together), a TP all-reduce adds exactly its row; DP x TP training of the char-GPT
(``train_hybrid`` on ``ProcessGroups``) at 2x2 on 4 ranks, 1x3 and 3x1 on 3 ranks equals
single-process training (losses and every parameter, float64); a grid that does not match the
world raises ValueError on every rank."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dmlbook.advanced.composition import hybrid
from dmlbook.advanced.composition.layout import Axis, Layout, ProcessGroups
from dmlbook.data_parallel.loop import train_reference
from dmlbook.launch import run
from dmlbook.models import char_gpt
from tests.unit.advanced.tensor_parallel import test_tensor_parallel  # a test module too

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ, BATCH, STEPS = 12, 6, 6, 2
TOL = 1e-10


def make_gpt():
    return char_gpt(VOCAB, seed=0, n_layer=1, n_head=6, n_embd=12, block_size=SEQ).double()


def batches():
    """The same batch every step, so that the loss must fall."""
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    return [batch] * STEPS


@functools.cache
def reference():
    return train_reference(make_gpt, batches(), lr=1e-2)  # Adam, one process


def test_groups_of_a_2x2_grid():
    table = Layout(dp=2, tp=2).group_ranks()
    assert (table["dp"], table["tp"]) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert table["dp_cp"] == table["dp"] and table["pp"] == [[0], [1], [2], [3]]


def test_groups_of_thin_and_3d_grids():
    def dp_tp(dp, tp):
        table = Layout(dp=dp, tp=tp).group_ranks()
        return {"dp": table["dp"], "tp": table["tp"]}

    assert dp_tp(3, 1) == {"dp": [[0, 1, 2]], "tp": [[0], [1], [2]]}
    assert dp_tp(1, 3) == {"dp": [[0], [1], [2]], "tp": [[0, 1, 2]]}
    assert dp_tp(2, 3)["tp"] == [[0, 1, 2], [3, 4, 5]]
    assert dp_tp(2, 3)["dp"] == [[0, 3], [1, 4], [2, 5]]
    groups = Layout(pp=2, dp=2, tp=2).group_ranks()
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for layout in groups.values():  # each axis's groups partition the ranks
        assert sorted(r for g in layout for r in g) == list(range(8))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Layout(dp=2, tp=0), "Layout.tp must be an integer >= 1, got 0"),
        (lambda: Layout(dp=True), "Layout.dp must be an integer >= 1, got True"),
        (lambda: Layout(dp=2).coordinates(2), "rank 2 is not a rank of layout"),
        (lambda: Layout(dp=2).rank_of(dp=2), "dp=2 is outside 0..1"),
        (lambda: ProcessGroups(Layout()).size("xp"), "no axis 'xp'"),
    ],
)
def test_bad_grids_raise_naming_the_axis(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _on_mesh(shapes, reference_result):
    """Every rank: for each grid shape, membership, a TP all-reduce and 2-D training."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    rank = dist.get_rank()
    try:
        ProcessGroups(Layout(dp=5))
    except ValueError as error:
        out["bad_world"] = str(error)
    cache: dict = {}  # the groups of both grids in one process
    for shape in shapes:
        groups = ProcessGroups(Layout(dp=shape[0], tp=shape[1]), cache)
        torch_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        found = {}
        for axis in (Axis.dp, Axis.tp):
            found[axis.value] = (
                dist.get_process_group_ranks(getattr(groups, axis.value)),
                groups.ranks[axis],
                dist.get_process_group_ranks(torch_mesh.get_group(axis.value)),
                torch_mesh.get_local_rank(axis.value),
                groups.coords[axis],
            )
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=groups.tp)
        trained = hybrid.train_hybrid(make_gpt, batches(), groups, lr=1e-2)
        expected = hybrid.shard_of(reference_result.model, groups)
        param_error = max(
            (a - b).abs().max().item()
            for a, b in zip(trained.model.parameters(), expected.parameters(), strict=True)
        )
        layout = groups.layout
        out[shape] = {
            "groups": found,
            "coordinate": {a: groups.coords[a] for a in ("dp", "tp")},
            "coordinates": [
                {a: layout.coordinates(q)[a] for a in ("dp", "tp")}
                for q in range(dist.get_world_size())
            ],
            "tp_sum": total.item(),
            "losses": trained.losses,
            "param_error": param_error,
        }
    return out


def _on_ranks(shapes, reference_result):
    """One launch serves both test modules: the tensor-parallel layer checks, then the mesh."""
    return {"layers": test_tensor_parallel._layer_checks(), **_on_mesh(shapes, reference_result)}


CASES = [(4, ((2, 2),)), (3, ((1, 3), (3, 1)))]


@functools.cache
def results(world: int) -> list[dict]:
    return run(_on_ranks, world, dict(CASES)[world], reference(), timeout=120)


@pytest.mark.parametrize("world, shapes", CASES)
def test_groups_on_real_ranks_match_the_layout_and_torch(world, shapes):
    for rank, by_shape in enumerate(results(world)):
        for shape in shapes:
            r = by_shape[shape]
            for name, (actual, ours, torchs, torch_local, local) in r["groups"].items():
                assert actual == ours == torchs, (shape, name, actual, ours, torchs)
                assert rank in actual and local == torch_local == actual.index(rank)
            assert r["coordinate"] == {"dp": rank // shape[1], "tp": rank % shape[1]}
            assert r["coordinates"] == [
                {"dp": q // shape[1], "tp": q % shape[1]} for q in range(world)
            ]
            assert r["tp_sum"] == sum(r["groups"]["tp"][0])


@pytest.mark.parametrize("world, shapes", CASES)
def test_hybrid_training_equals_single_process(world, shapes):
    ref = reference()
    for by_shape in results(world):
        for shape in shapes:
            r = by_shape[shape]
            assert max(abs(a - b) for a, b in zip(r["losses"], ref.losses, strict=True)) <= TOL
            assert r["param_error"] <= TOL, (shape, r["param_error"])
    assert ref.losses[-1] < ref.losses[0]  # it did learn something


@pytest.mark.parametrize("world, shapes", CASES)
def test_a_grid_that_does_not_match_the_world_raises_on_every_rank(world, shapes):
    for r in results(world):
        assert "needs pp x dp x cp x tp = 1 x 5 x 1 x 1 = 5 ranks" in r["bad_world"]
        assert f"the world has {world}" in r["bad_world"]


def test_single_rank_grid_without_process_group():
    groups = ProcessGroups(Layout())
    assert groups.coords[Axis.tp] == 0 and groups.tp is None and groups.size("tp") == 1
    result = hybrid.train_hybrid(make_gpt, batches(), groups, lr=1e-2)
    assert result.losses == pytest.approx(reference().losses, abs=TOL)
    with pytest.raises(ValueError, match="rank 1 is not a rank of layout"):
        groups.layout.coordinates(1)
