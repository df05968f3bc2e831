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
    from dmlbook.advanced.composition.layout import Layout

    layout = Layout(dp=2, tp=2, pp=2)
    ax = viz.who_holds_what([f"r{r}" for r in range(8)], layout.group_ranks()["pp"], columns=4)
    texts = [t.get_text() for t in ax.texts]
    assert texts == [f"rank {r}\ngroup {r % 4}\nr{r}" for r in range(8)]  # the tag on its own line
    assert len(ax.lines) == 0  # no line crosses the boxes between a group's ranks
    colour = [p.get_facecolor() for p in ax.patches if isinstance(p, plt.Rectangle)]
    assert [colour[r] == colour[r + 4] for r in range(4)] == [True] * 4  # a group, one colour
    assert len(set(colour[:4])) == 4  # and another colour for each group
    plt.close(ax.figure)


def test_gemm_split_colours_each_rank_block():
    from matplotlib.colors import to_rgba

    column = viz.gemm_split("column", world_size=2, n=4)
    grey = to_rgba("0.8")
    cells = [p for p in column.patches if isinstance(p, plt.Rectangle)][:48]  # X, W, Y
    x_cells = [p.get_facecolor()[:3] for p in cells[:16]]
    assert all(c == grey[:3] for c in x_cells)  # a column split: every rank holds all of X
    assert len({p.get_facecolor()[:3] for p in cells[16:32]}) == 2  # W: two ranks' columns
    row = viz.gemm_split("row", world_size=2, n=4)
    hatched = [p for p in row.patches if p.get_hatch()]
    assert len(hatched) == 32  # Y: every element a partial sum from each of the 2 ranks
    with pytest.raises(ValueError):
        viz.gemm_split("diagonal")
    plt.close("all")


def test_zero_stages_shards_one_more_part_per_stage():
    fig = viz.zero_stages([(0, 25), (25, 50), (50, 75), (75, 100)], 100)
    for stage, ax in enumerate(fig.axes[:4]):
        spans = [c.get_paths() for c in ax.collections]
        widths = [p.get_extents().width for paths in spans for p in paths]
        # each rank: 3 grey backgrounds and 3 coloured strips; `stage` strips are a quarter
        coloured = widths[1::2]
        assert sum(abs(w - 25) < 1e-6 for w in coloured) == 4 * stage
    plt.close(fig)


def test_fedavg_round_names_every_rank_and_client():
    ax = viz.fedavg_round({1: [0, 2], 2: [1, 3]})
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "rank 1\nclients 0, 2" in texts and "rank 2\nclients 1, 3" in texts
    assert "server" in texts
    plt.close(ax.figure)


def test_pairwise_masks_put_one_plus_and_one_minus_in_each_column():
    ax = viz.pairwise_masks([0, 2, 5])
    texts = [t.get_text() for t in ax.texts]
    assert sorted(t for t in texts if t.startswith(("+m", "-m"))) == sorted(
        ["+m02", "-m02", "+m05", "-m05", "+m25", "-m25"]
    )
    assert texts.count("0") == 3  # every column sums to zero
    plt.close(ax.figure)


def test_spans_draw_one_row_per_list():
    ax = viz.spans({"one": [(0, 2), (3, 4)], "two": [(1, 3)]}, shade=[(0, 4)], unit=2)
    widths = [p.get_extents().width for c in ax.collections for p in c.get_paths()]
    assert widths == [1.0, 0.5, 1.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["one", "two"]
    plt.close(ax.figure)


def test_idle_gaps_hatches_each_stage_idle_time_and_totals_it():
    from dmlbook.model_parallel.schedules import OpRecord as R

    # GPipe, 2 stages x 2 micro-batches, one slot per op: each stage idles 2 of 6 slots
    timelines = [
        [R("F", 0, 0, 1), R("F", 1, 1, 2), R("B", 0, 4, 5), R("B", 1, 5, 6)],
        [R("F", 0, 1, 2), R("F", 1, 2, 3), R("B", 0, 3, 4), R("B", 1, 4, 5)],
    ]
    ax = viz.idle_gaps(timelines, unit="slot")
    hatched = [
        (p.get_y() + p.get_height() / 2, p.get_x(), p.get_width())
        for p in ax.patches
        if p.get_hatch()
    ]
    assert sorted(hatched) == [(0.0, 2.0, 2.0), (1.0, 0.0, 1.0), (1.0, 5.0, 1.0)]
    assert [t.get_text() for t in ax.texts if "idle" in t.get_text()] == [
        " 2 slots idle",
        " 2 slots idle",
    ]
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "idle"
    with pytest.raises(ValueError, match="nothing ran"):
        viz.idle_gaps([[], []])


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


def test_rank_grid_places_tp_fastest_and_colours_each_group():
    from dmlbook.advanced.composition.layout import Layout

    layout = Layout(pp=2, cp=2, tp=2)
    ax = viz.rank_grid(layout, "cp")
    texts = [t.get_text() for t in ax.texts]
    assert texts[5] == "rank 5\npp1 dp0\ncp0 tp1\ncp group 3"  # of [0, 2] [1, 3] [4, 6] [5, 7]
    assert len(ax.lines) == 0  # no line crosses the boxes between a group's ranks
    boxes = [p for p in ax.patches if isinstance(p, plt.Rectangle)]
    colour = [b.get_facecolor() for b in boxes]
    y = [b.get_y() for b in boxes]
    for group in layout.group_ranks()["cp"]:  # CP groups run along the row, one colour each
        assert len({colour[r] for r in group}) == 1 and len({y[r] for r in group}) == 1
    assert len({colour[g[0]] for g in layout.group_ranks()["cp"]}) == 4
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


def test_ps_timeline_draws_a_wait_a_compute_and_a_pause_bar_per_step():
    timeline = [
        (1, "pull", 10.0), (1, "reply", 10.5), (1, "push", 12.0),
        (2, "pull", 10.0), (2, "reply", 10.0), (2, "push", 11.0),
    ]  # fmt: skip
    ax = viz.collectives.ps_timeline(timeline, [[1.0], [0.0]])
    bars = sorted((round(p.get_x(), 3), round(p.get_width(), 3), round(p.get_y() + 0.25, 3))
                  for p in ax.patches)  # fmt: skip
    # worker 0 (rank 1): held 0.5, then computing 1.5 of which the last 1.0 a pause; worker 1
    # (rank 2): never held (a bar of width 0), computing 1.0
    assert bars == [(0.0, 0.0, 1.0), (0.0, 0.5, 0.0), (0.0, 1.0, 1.0), (0.5, 1.5, 0.0),
                    (1.0, 1.0, 0.0)]  # fmt: skip
    assert sorted(t.get_text() for t in ax.texts if t.get_text().isdigit()) == ["1", "1"]


def test_moe_round_trip_draws_each_row_at_each_stage():
    """2 ranks, 2 tokens each, top-1 over 2 experts (one per rank): rank 0's t1 goes to rank 1's
    expert; every token is drawn at route and combine, every row once sent and once received."""
    experts = [[[0], [1]], [[1], [1]]]
    weights = [[[1.0], [1.0]], [[1.0], [1.0]]]
    sent = [[(0, 0), (1, 0)], [(0, 0), (1, 0)]]  # sorted by expert: e0 first
    ax = viz.layouts.moe_round_trip(experts, weights, sent, [[1, 1], [0, 2]], n_experts=2)
    texts = [t.get_text() for t in ax.texts]
    assert sum(t.startswith("t") and " -> " in t for t in texts) == 4  # route
    assert sum(" for e" in t for t in texts) == 4  # sent
    assert sorted(t for t in texts if t.startswith("e") and "'s t" in t) == [
        "e0: rank 0's t0", "e1: rank 0's t1", "e1: rank 1's t0", "e1: rank 1's t1",
    ]  # fmt: skip
    assert "counts sent to e0-e1: 1 1" in texts and "counts received from ranks 0-1: 1 2" in texts
    plt.close(ax.figure)


def test_bench_figures_draw_a_bar_per_torch_comparison_and_a_curve_per_algorithm():
    # records as `python -m dmlbook.bench all --json` writes them, one or two per bench
    forked = "launch + all-reduce, 2 ranks, forked"
    records = [
        {"bench": "launch", "name": forked, "median": 0.08, "baseline_median": 2.4, "ratio": 1 / 3},
        {"bench": "launch", "what": "launch tail", "world_size": 4, "median": 0.14},
        {"bench": "data-parallel", "name": "DP step, flat, MLP 256x2, ws 2", "ratio": 0.9},
        {"bench": "ddp", "implementation": "bucketed", "model": "deep_mlp", "ratio_vs_torch": 1.0},
        {"bench": "ddp", "implementation": "torch", "model": "deep_mlp", "ratio_vs_torch": 1.0},
        {"bench": "recompute", "model": "mlp", "implementation": "ours", "step_s": 0.2},
        {"bench": "recompute", "model": "mlp", "implementation": "torch", "step_s": 0.25},
        {"bench": "pipeline", "schedule": "GPipe", "microbatches": 4, "ratio_vs_torch": 1.05},
        {"bench": "netlab", "link": "100mbit", "measured_Mbps": 96.0, "setting_Mbps": 100.0},
    ]
    for algorithm, ratio in (("ring", 1.2), ("shm", 0.5)):
        for nbytes, gloo_s in ((1 << 16, 4e-4), (1 << 20, 9e-4), (1 << 24, 8e-3)):
            records.append(
                {
                    "bench": "allreduce",
                    "algorithm": algorithm,
                    "world_size": 2,
                    "bytes": nbytes,
                    "median_s": ratio * gloo_s,
                    "baseline_median_s": gloo_s,
                    "ratio": ratio,
                }
            )
    figures = viz.bench_figures(records)
    assert set(figures) == {"ratios", "allreduce"}
    ratios = figures["ratios"].axes[0]
    assert [t.get_text() for t in ratios.get_yticklabels()] == [
        "launch: 2 ranks, forked",
        "data-parallel: flat, MLP 256x2, ws 2",
        "ddp: deep_mlp, bucketed",
        "pipeline: GPipe, M=4",
        "recompute: mlp, checkpointed step",
    ]
    widths = [p.get_width() for p in ratios.patches]
    assert widths == pytest.approx([1 / 3, 0.9, 1.0, 1.05, 0.8])
    times, over_gloo = figures["allreduce"].axes
    assert [line.get_label() for line in times.get_lines()] == ["gloo (torch)", "ring", "shm"]
    assert list(over_gloo.get_lines()[1].get_ydata()) == pytest.approx([0.5, 0.5, 0.5])
    assert viz.bench_figures([]) == {}
