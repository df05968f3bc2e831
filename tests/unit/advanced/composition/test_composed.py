"""Chapter 13's composed training: the 5-D Layout (groups as a table, errors that name the
dimension), train_composed equal to one process at four layouts of world size 8 (losses per step
and every parameter of every rank's shard, float64 to 1e-10), each rank's memory and traffic
measured against the planner's prediction (parameters, gradients, ZeRO-1 state, TP, PP and
dense DP bytes to the byte), bad input across ranks raising on every rank with no hang, and the
planner's ranking on a two-level network. Four world-size-8 launches in all (about 7 s each)."""

from __future__ import annotations

import functools

import pytest
import torch

from dmlbook.advanced.composition.compose import COMPOSITION_ORDER
from dmlbook.advanced.composition.layout import DEGREE_AXES, GRID_AXES, Axis, Layout
from dmlbook.advanced.composition.planner import (
    Network,
    Workload,
    layouts_of,
    predict_broadcast,
    predict_memory,
    predict_traffic,
    rank_layouts,
)
from dmlbook.advanced.composition.training import (
    PHASES,
    composed_step,
    time_layouts,
    train_composed,
)
from dmlbook.advanced.expert_parallel.moe import moe_char_gpt
from dmlbook.comm.costmodel import Link
from dmlbook.data_parallel.loop import train_reference
from dmlbook.launch import RankError, run
from dmlbook.models import GPTConfig, char_gpt

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ, BATCH, MICRO, STEPS = 16, 16, 4, 2, 3
MODEL = dict(n_layer=2, n_head=4, n_embd=16, block_size=16)
TOL = 1e-10  # float64: the sums run in other orders on other ranks, nothing else differs


def make_dense():
    return char_gpt(VOCAB, seed=0, **MODEL).double()


def make_moe():
    return moe_char_gpt(VOCAB, 0, n_experts=4, top_k=2, capacity_factor=None, **MODEL).double()


def batches(seq: int = SEQ):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (BATCH, seq), generator=g),
         torch.randint(0, VOCAB, (BATCH, seq), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip


# --------------------------------------------------------------------------- the layout


def test_group_table_of_a_2x2x2_layout():
    table = Layout(dp=2, tp=2, pp=2).group_ranks()
    assert table["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: inside a node
    assert table["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert table["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # farthest apart
    assert table["dp_cp"] == table["dp"] and table["cp"] == [[r] for r in range(8)]


def test_the_axes_are_named_once_and_every_table_reads_them():
    """One spelling: the grid, the degrees, the composition order, the group table and the
    planner's traffic all hold members of Axis, which print as their plain names."""
    every = (*GRID_AXES, *DEGREE_AXES, *COMPOSITION_ORDER)
    assert all(isinstance(a, Axis) for a in every)
    assert set(COMPOSITION_ORDER) == set(DEGREE_AXES) and set(GRID_AXES) < set(DEGREE_AXES)
    work = Workload.of(make_dense(), BATCH, SEQ, MICRO)
    assert list(predict_traffic(work, Layout(dp=2), 0).sent) == list(DEGREE_AXES)
    assert all(isinstance(a, Axis) for a in Layout(dp=2).coordinates(1))
    assert repr(COMPOSITION_ORDER) == "('tp', 'cp', 'ep', 'pp', 'dp')"
    assert f"{Axis.dp_cp}" == "dp_cp"
    assert Axis.tp == "tp" and {Axis.tp: 1}["tp"] == 1


def test_the_composed_step_is_one_straight_function():
    """composed_step reads top to bottom: forward and backward, the syncs by group, the ZeRO-1 step,
    in that order, in at most 40 lines, calling no private name."""
    import inspect
    import re

    source = inspect.getsource(composed_step)
    assert len(source.splitlines()) <= 40
    assert not re.search(r"(?<![\w.])_[a-z]\w*\(|\._[a-z]\w*", source)
    order = [source.index(s) for s in ("pipeline.train_step(", "average_gradients(", ".step()")]
    assert order == sorted(order)


@pytest.mark.parametrize("layout", layouts_of(8)[::3] + [Layout(dp=2, cp=2, tp=2, ep=4)])
def test_every_group_partitions_the_world_and_coordinates_round_trip(layout):
    table = layout.group_ranks()
    assert list(table) == list(Axis)
    for groups in table.values():
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        assert layout.rank_of(c["pp"], c["dp"], c["cp"], c["tp"]) == rank
        mine = layout.groups_of(rank)
        assert set(mine["ep"]) <= set(mine["dp_cp"]) and set(mine["edp"]) <= set(mine["dp_cp"])
        assert mine["tp"].index(rank) == c["tp"] and mine["ep"].index(rank) == c["ep"]


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Layout(dp=0), "Layout.dp"),
        (lambda: Layout(tp=2.0), "Layout.tp"),
        (lambda: Layout(dp=3, ep=2), "ep=2 must divide dp x cp"),
        (lambda: Layout(dp=2, tp=2).validate_world(8), "needs pp x dp x cp x tp"),
    ],
)
def test_bad_layouts_name_the_dimension(make, words):
    with pytest.raises(ValueError, match=words):
        make()


@pytest.mark.parametrize(
    "layout, seq, batch, experts, words",
    [
        (Layout(tp=8), 16, 4, 0, "tp: n_head=4 is not divisible by tp=8"),
        (Layout(cp=4), 12, 4, 0, "cp: sequence length=12 is not divisible by 2 x cp=8"),
        (Layout(tp=4), 6, 4, 0, "tp: each context-parallel rank.s sequence length=6/1"),
        (Layout(dp=2, ep=2), 16, 4, 3, "ep: n_experts=3 is not divisible by ep=2"),
        (Layout(dp=2, ep=2), 16, 4, 0, "ep: ep=2 needs a mixture-of-experts"),
        (Layout(dp=8), 16, 4, 0, "dp: batch=4 is not divisible by dp=8"),
        (Layout(pp=8), 16, 4, 0, "pp: 2 blocks \\+ embedding \\+ head = 4 layers"),
    ],
)
def test_models_that_do_not_split_name_the_dimension(layout, seq, batch, experts, words):
    config = GPTConfig(vocab_size=VOCAB, **MODEL)
    with pytest.raises(ValueError, match=words):
        layout.validate_model(config, seq, batch, microbatches=1, n_experts=experts)


def test_zigzag_is_a_field_of_the_layout():
    config = GPTConfig(vocab_size=VOCAB, **MODEL)
    with pytest.raises(ValueError, match="cp: sequence length=6 is not divisible by 2 x cp=4"):
        Layout(cp=2).validate_model(config, 6, 4)  # zigzag: 2 cp chunks
    Layout(cp=2, zigzag=False).validate_model(config, 6, 4)  # contiguous: cp blocks
    assert (
        Layout(cp=2, zigzag=False) != Layout(cp=2)
        and str(Layout(cp=2)) == "dp1 x tp1 x pp1 x cp2 x ep1"
    )
    with pytest.raises(ValueError, match="Layout.zigzag must be True or False, got 1"):
        Layout(zigzag=1)


# --------------------------------------------------------------------------- equal to one process

LAYOUTS = {
    "dp2 x tp2 x pp2, dense": (Layout(dp=2, tp=2, pp=2), make_dense),
    "pp2 x cp2 x tp2, ep2 (MoE)": (Layout(pp=2, cp=2, tp=2, ep=2), make_moe),
    "dp2 x cp2 x tp2, ep4 (MoE)": (Layout(dp=2, cp=2, tp=2, ep=4), make_moe),
    "dp2 x pp4, dense": (Layout(dp=2, pp=4), make_dense),
}


@functools.cache
def composed(name: str):
    layout, make = LAYOUTS[name]
    done = train_reference(make, batches(), optimizer=torch.optim.AdamW)  # one process
    losses, state = done.losses, done.model.state_dict()
    results = run(train_composed, 8, make, batches(), layout, MICRO, 1e-2, state, True, timeout=240)
    return layout, make, losses, results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composed_training_equals_one_process(name):
    layout, _, losses, results = composed(name)
    for r in results:
        assert r.losses == pytest.approx(losses, rel=TOL, abs=TOL), (r.rank, r.losses, losses)
        assert r.max_diff < TOL, (r.rank, r.coords, r.max_diff)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_measured_memory_and_traffic_match_the_prediction(name):
    layout, make, _, results = composed(name)
    work = Workload.of(make(), BATCH, SEQ, MICRO, element_size=8)
    for r in results:
        m, memory = r.measurement, predict_memory(work, layout, r.rank)
        traffic = predict_traffic(work, layout, r.rank)
        assert (m.params, m.grads, m.optimizer) == (
            memory["params"], memory["grads"], memory["optimizer"]
        ), r.rank  # fmt: skip
        assert 0.7 < m.activations / memory["activations"] < 2.0, (r.rank, m.activations)
        assert m.sent["tp"] == traffic.sent["tp"] and m.sent["pp"] == traffic.sent["pp"], r.rank
        if layout.ep == 1:  # with EP, the all-to-all's size checks run over dp x cp ranks too
            assert m.sent["dp"] == traffic.sent["dp"], (r.rank, m.sent, traffic.sent)
            assert m.sent["cp"] == pytest.approx(traffic.sent["cp"]), r.rank
        # The router spreads tokens unevenly, and the checks add a few bytes: 25% in all.
        assert sum(m.sent.values()) == pytest.approx(sum(traffic.sent.values()), rel=0.25)
        # The kernel's TCP counters see at least what the messages carried (plus gloo's framing).
        carried = sum(m.sent.values())
        wire = m.wire["forward/backward"] + m.wire["gradient sync"]
        assert carried <= wire < 1.6 * carried + 4096, (r.rank, carried, m.wire)


# --------------------------------------------------------------------------- bad input, no hang


def _mismatched_sequence(make, all_batches, layout):
    """Rank 1 passes sequences of another length: every rank must say so."""
    import torch.distributed as dist

    mine = all_batches if dist.get_rank() == 0 else [(i[:, :8], t[:, :8]) for i, t in all_batches]
    return train_composed(make, mine, layout, 1)


@pytest.mark.timeout(120)
def test_mismatched_shapes_and_worlds_raise_on_every_rank_without_a_hang():
    with pytest.raises(RankError, match="cp/tp: sequence lengths differ across ranks"):
        run(_mismatched_sequence, 2, make_dense, batches(), Layout(tp=2), timeout=60)
    with pytest.raises(RankError, match="needs pp x dp x cp x tp = 1 x 4 x 1 x 1 = 4 ranks"):
        run(train_composed, 2, make_dense, batches(), Layout(dp=4), timeout=60)


# --------------------------------------------------------------------------- timing


@pytest.mark.timeout(120)
def test_time_layouts_gives_each_step_and_its_parts_on_the_slowest_rank():
    """Chapter 13 times layouts on the network lab this way: per layout, each timed step and
    the slowest rank's forward/backward, gradient sync and ZeRO-1 step within it, which add up
    to its step."""
    layouts = [Layout(dp=2), Layout(tp=2)]
    times = run(time_layouts, 2, make_dense, batches(), layouts, 1, 1, timeout=90)
    assert times[0] == times[1]  # every rank returns the slowest rank's times
    for layout in layouts:
        row = times[0][str(layout)]
        assert set(row) == {"step", *PHASES} and all(len(v) == STEPS - 1 for v in row.values())
        for step, *parts in zip(row["step"], *(row[p] for p in PHASES), strict=True):
            assert all(t >= 0 for t in parts) and abs(sum(parts) - step) < 1e-6


# --------------------------------------------------------------------------- the planner


def test_planner_keeps_the_chatty_dimensions_inside_a_node():
    work = Workload.of(make_dense(), batch=8, seq=16, microbatches=2)
    fast, slow = Link.from_bandwidth(1e-5, 100.0), Link.from_bandwidth(1e-4, 0.1)
    ranking = rank_layouts(work, 8, Network(fast, slow, gpus_per_node=4))
    costs = [c["total"] for _, c in ranking]
    assert costs == sorted(costs) and len(ranking) == len(layouts_of(8, work))
    by_layout = dict((str(lay), c) for lay, c in ranking)
    # dp2 x tp4 keeps its TP groups inside nodes of 4 ranks; with nodes of 2 they span nodes.
    inside = by_layout[str(Layout(dp=2, tp=4))]["tp"]
    spread = dict(
        (str(lay), c) for lay, c in rank_layouts(work, 8, Network(fast, slow, gpus_per_node=2))
    )[str(Layout(dp=2, tp=4))]["tp"]
    assert spread > 10 * inside
    assert predict_traffic(work, Layout(dp=8), 0).sent["tp"] == 0


def test_predict_broadcast_is_each_owned_parameter_once_to_every_other_group_rank():
    """ZeRO-1's broadcasts: over a group, every parameter leaves its owner once per other rank,
    so the group's ranks together send (n - 1) x the stage's parameters; no group, nothing."""
    work = Workload.of(make_dense(), BATCH, SEQ, MICRO, element_size=8)
    for layout, n in ((Layout(dp=2), 2), (Layout(dp=4), 4), (Layout(dp=2, cp=2), 4)):
        total = sum(predict_broadcast(work, layout, r) for r in range(n))
        assert total == (n - 1) * predict_memory(work, layout, 0)["params"]
    assert predict_broadcast(work, Layout(tp=2), 0) == 0
