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


def test_message_schedule_draws_one_arrow_per_message_in_its_step_column():
    from dmlbook.comm.trace import Send

    sends = [
        Send("all_reduce", "reduce", 0, 1, 0, 8),
        Send("all_reduce", "reduce", 0, 3, 2, 8),
        Send("all_reduce", "reduce", 0, 3, 2, 8),  # the same message recorded twice: one arrow
        Send("all_reduce", "reduce", 5, 2, 0, 4),
    ]
    ax = viz.message_schedule(sends, 4, tensor_bytes=16)
    arrows = sorted((a.xyann, a.xy) for a in ax.texts if hasattr(a, "xyann"))
    # from (column, src) to (column, dst): step 0's two messages side by side, step 5 in column 1
    assert arrows == [((-0.125, 1), (-0.125, 0)), ((0.125, 3), (0.125, 2)), ((1.0, 2), (1.0, 0))]
    assert sorted(t.get_text() for t in ax.texts if t.get_text()) == ["0.25n", "0.5n", "0.5n"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]


def test_checkpoint_segments_keeps_each_segment_input_and_the_whole_last_segment():
    ax = viz.checkpoint_segments([range(0, 3), range(3, 6), range(6, 10)])
    boxes = sorted((p.get_x(), p.get_alpha()) for p in ax.patches)
    assert [x for x, _ in boxes] == list(range(10))
    kept = [x for x, alpha in boxes if alpha == 1.0]
    assert kept == [0, 3, 6, 7, 8, 9]  # segment inputs, then all of the last segment
