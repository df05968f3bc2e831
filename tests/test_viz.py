"""Tests for dmlbook.viz: the plots draw what they are given (bar heights, stacking, totals)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dmlbook import viz  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_bars_draw_one_bar_per_value():
    ax = viz.bars({"a": 1.0, "b": 3.5}, "units")
    assert [p.get_height() for p in ax.patches] == [1.0, 3.5]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]


def test_stacked_bars_stack_parts_and_annotate_totals():
    parts = {"one": {"x": 1.0, "y": 2.0}, "two": {"y": 4.0, "z": 0.5}}
    ax = viz.stacked_bars(parts, "MB", limit=(5.0, "device"))
    # the parts in first-seen order x, y, z; each drawn for both bars (0 where missing)
    heights = [(p.get_x(), p.get_y(), p.get_height()) for p in ax.patches]
    assert [h[2] for h in heights] == [1.0, 0.0, 2.0, 4.0, 0.0, 0.5]
    assert [h[1] for h in heights] == [0.0, 0.0, 1.0, 0.0, 3.0, 4.0]  # each part on the last
    assert [t.get_text() for t in ax.texts] == ["3", "4.5"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["device", "x", "y", "z"]


def test_who_holds_what_colours_each_group_and_labels_each_rank():
    from dmlbook.advanced.layout import Layout

    layout = Layout(dp=2, tp=2, pp=2)
    ax = viz.who_holds_what([f"r{r}" for r in range(8)], layout.group_ranks()["pp"], columns=4)
    texts = [t.get_text() for t in ax.texts]
    assert texts == [f"rank {r}\nr{r}" for r in range(8)]
    assert len(ax.lines) == 4  # one line joins the two ranks of each pipeline group
    plt.close(ax.figure)


def test_all_to_all_dispatch_colours_each_choice_by_the_rank_holding_its_expert():
    experts = [[[2, 0], [1, 3]], [[0, 1], [3, 2]]]  # 2 ranks, 2 tokens each, top-2
    ax = viz.all_to_all_dispatch(experts, [(0, 2), (2, 4)])
    cells = [(t.get_text(), t.get_position()) for t in ax.texts]
    assert [c[0] for c in cells] == ["e2", "e1", "e0", "e3", "e0", "e3", "e1", "e2"]
    colours = [p.get_facecolor()[:3] for p in ax.patches]
    to_rank = [0 if int(text[1:]) < 2 else 1 for text, _ in cells]
    for colour, rank in zip(colours, to_rank, strict=True):  # one colour per destination
        assert colour == colours[to_rank.index(rank)]
    assert colours[to_rank.index(0)] != colours[to_rank.index(1)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["to rank 0 (experts 0-1)", "to rank 1 (experts 2-3)"]


def test_ring_attention_blocks_name_the_ring_step_of_each_block():
    from dmlbook.advanced.context_parallel import AttentionBlock

    layout = [[(0, 2)], [(2, 4)]]  # two ranks, contiguous, causal
    blocks = [
        [AttentionBlock((0, 2), (0, 2), 4)],  # rank 0: its own block at step 0 only
        [AttentionBlock((2, 4), (2, 4), 4), AttentionBlock((2, 4), (0, 2), 4)],
    ]
    ax = viz.ring_attention_blocks(blocks, layout)
    found = {(t.get_position(), t.get_text()) for t in ax.texts}
    # (key chunk, query chunk) -> step: rank 1 meets rank 0's keys one step round the ring
    assert found == {((0, 0), "s0"), ((1, 1), "s0"), ((0, 1), "s1")}
    assert len(ax.patches) == 3  # the future block (query 0-1, key 2-3) is never computed


def test_rank_grid_places_tp_fastest_and_joins_each_group():
    from dmlbook.advanced.layout import Layout

    layout = Layout(pp=2, cp=2, tp=2)
    ax = viz.rank_grid(layout, "cp")
    texts = [t.get_text() for t in ax.texts]
    assert texts[5] == "rank 5\npp1 dp0\ncp0 tp1"
    assert len(ax.lines) == 4  # one line per CP group
    xs = {tuple(line.get_xdata()) for line in ax.lines}
    ys = {len(set(line.get_ydata())) for line in ax.lines}
    assert ys == {1} and all(a != b for a, b in xs)  # CP groups run along the row
