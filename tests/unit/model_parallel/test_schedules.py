"""Interleaved 1F1B and ZB-H1 as data (dmlbook.model_parallel.schedules): their tables, proved
complete and deadlock-free by check_schedule at P = 1..5 and many M, their bubble with equal op
times equal to bubble_theory's formula, what each stage holds, and bad input."""

from __future__ import annotations

import pytest

from dmlbook.model_parallel import pipeline as pp


def _unit_ops(actions, stages):
    """Every op one unit long, packed: the schedule's own timing with equal op times."""
    timelines = [
        [pp.OpRecord(a.op, a.microbatch, 0.0, 1.0, a.chunk) for a in pp.stage_actions(actions, s)]
        for s in range(stages)
    ]
    return pp.packed_timelines(timelines)


def _peak_held(actions, stage):
    """Most (micro-batch, chunk) pairs held at once: from F to B, or to W where there are Ws."""
    mine = pp.stage_actions(actions, stage)
    release = "W" if any(a.op == "W" for a in mine) else "B"
    live = peak = 0
    for a in mine:
        live += 1 if a.op == "F" else -1 if a.op == release else 0
        peak = max(peak, live)
    return peak


def _renumber(actions):
    steps: dict[int, int] = {}
    out = []
    for a in actions:
        steps[a.stage] = steps.get(a.stage, -1) + 1
        out.append(pp.Action(a.stage, steps[a.stage], a.op, a.microbatch, a.chunk))
    return out


def test_the_tables():
    assert pp.format_schedule(pp.interleaved_schedule(2, 4, chunks=2)) == (
        "stage 0: F0.0 F1.0 F0.1 F1.1 B0.1 F2.0 B1.1 F3.0 B0.0 F2.1 B1.0 F3.1 B2.1 B3.1 B2.0 B3.0\n"
        "stage 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    )
    assert pp.format_schedule(pp.zb_h1_schedule(3, 4)) == (
        "stage 0: F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3\n"
        "stage 1: F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3\n"
        "stage 2: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"
    )
    # One chunk per stage: interleaving is 1F1B
    for stages, microbatches in ((2, 4), (3, 6), (4, 8)):
        assert pp.interleaved_schedule(stages, microbatches, chunks=1) == (
            pp.one_f_one_b_schedule(stages, microbatches)
        )
    assert pp.virtual_stage(1, 1, 4) == 5 and pp.Action(0, 0, "F", 0).chunk == 0


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_interleaved_is_complete_deadlock_free_and_divides_the_bubble_by_v(stages):
    for microbatches in range(stages, 4 * stages + 1, stages):
        for chunks in (1, 2, 3):
            actions = pp.interleaved_schedule(stages, microbatches, chunks)
            pp.check_schedule(actions, stages, microbatches, chunks=chunks)
            bubble = pp.measured_bubble(_unit_ops(actions, stages))
            theory = pp.bubble_theory(stages, microbatches, "interleaved", chunks)
            assert bubble == pytest.approx(theory, abs=1e-12), (stages, microbatches, chunks)
            assert theory == pytest.approx((stages - 1) / (chunks * microbatches + stages - 1))
            for s in range(stages):  # 1F1B's warm-up plus one round of P per further chunk
                want = min(stages - s + (chunks - 1) * stages, microbatches * chunks)
                assert _peak_held(actions, s) == want, (stages, microbatches, chunks, s)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_zb_h1_is_complete_deadlock_free_and_its_bubble_a_third_of_1f1b(stages):
    for microbatches in range(1, 13):
        actions = pp.zb_h1_schedule(stages, microbatches)
        pp.check_schedule(actions, stages, microbatches)
        for s in range(stages):
            mine = pp.stage_actions(actions, s)
            assert [a.microbatch for a in mine if a.op == "W"] == list(range(microbatches))
            # without its Ws, each stage runs 1F1B's order (chapter 6 says so)
            assert [(a.op, a.microbatch) for a in mine if a.op != "W"] == [
                (a.op, a.microbatch)
                for a in pp.stage_actions(pp.one_f_one_b_schedule(stages, microbatches), s)
            ]
            # held from F to W: at most min(P, M) on every stage, 1F1B's peak (its stage 0)
            assert _peak_held(actions, s) == min(stages, microbatches)
        if microbatches < stages:
            with pytest.raises(ValueError, match="needs M >= P"):
                pp.bubble_theory(stages, microbatches, "zb-h1")
            continue
        bubble = pp.measured_bubble(_unit_ops(actions, stages))
        theory = pp.bubble_theory(stages, microbatches, "zb-h1")
        assert bubble == pytest.approx(theory, abs=1e-12), (stages, microbatches)
        # 1F1B with the same unit ops (its B is B + W: two units) idles three times as long
        schedule = pp.one_f_one_b_schedule(stages, microbatches)
        rows = [
            [pp.OpRecord(a.op, a.microbatch, 0.0, 1.0 if a.op == "F" else 2.0) for a in
             pp.stage_actions(schedule, s)]
            for s in range(stages)
        ]  # fmt: skip
        idle_1f1b = pp.measured_bubble(pp.packed_timelines(rows)) * (3 * microbatches)
        idle_1f1b /= 1 - pp.measured_bubble(pp.packed_timelines(rows))
        idle_zb = theory * (3 * microbatches) / (1 - theory)
        assert idle_zb == pytest.approx(idle_1f1b / 3), (stages, microbatches)


def test_check_schedule_catches_what_would_deadlock_mispair_or_miss_work():
    good = pp.interleaved_schedule(2, 2, chunks=2)
    pp.check_schedule(good, 2, 2, chunks=2)
    chunk_0_only = [a for a in good if a.chunk == 0]
    with pytest.raises(ValueError, match="stage 0 chunk 1 must run F once"):
        pp.check_schedule(_renumber(chunk_0_only), 2, 2, chunks=2)
    with pytest.raises(ValueError, match="model chunk outside"):
        pp.check_schedule(good, 2, 2, chunks=1)
    # stage 1's chunk 0 takes micro-batches 1, 0: its activations and gradients would mispair
    swapped = [
        a if (a.stage, a.chunk) != (1, 0) else pp.Action(1, a.step, a.op, 1 - a.microbatch, 0)
        for a in good
    ]
    with pytest.raises(ValueError, match="different micro-batch orders"):
        pp.check_schedule(swapped, 2, 2, chunks=2)
    # Messages in matching orders, yet each stage waits for the other: stage 0 wants B0's
    # gradient before it sends F1; stage 1 wants F1 before it runs B0.
    order = {0: ["F0", "B0", "F1", "B1"], 1: ["F0", "F1", "B0", "B1"]}
    deadlock = [pp.Action(s, k, op[0], int(op[1])) for s in order for k, op in enumerate(order[s])]
    with pytest.raises(
        ValueError, match="deadlocks: every stage waits .stage 0 at B0, stage 1 at F1"
    ):
        pp.check_schedule(deadlock, 2, 2)
    zb = pp.zb_h1_schedule(2, 2)
    with pytest.raises(ValueError, match="must run W once"):
        pp.check_schedule([a for a in zb if (a.op, a.microbatch) != ("W", 1)], 2, 2)
    w_first = [pp.Action(0, 0, "F", 0), pp.Action(0, 1, "W", 0), pp.Action(0, 2, "B", 0)]
    with pytest.raises(ValueError, match="runs W0 before B0"):
        pp.check_schedule(w_first, 1, 1)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="M = 6 micro-batches is not a multiple of P = 4"):
        pp.interleaved_schedule(4, 6, chunks=2)
    for chunks in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunks .* must be an integer >= 1"):
            pp.interleaved_schedule(2, 4, chunks=chunks)
    with pytest.raises(ValueError, match="one model chunk per stage"):
        pp.bubble_theory(2, 4, "1f1b", chunks=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        pp.bubble_theory(2, 4, "zigzag")


def test_gantt_draws_w_and_names_chunks_and_held_counts_until_w():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook.viz.pipeline import gantt, held_activations, idle_gaps

    interleaved = _unit_ops(pp.interleaved_schedule(2, 2, chunks=2), 2)
    ax = gantt(interleaved)
    assert "0.1" in {t.get_text() for t in ax.texts}  # micro-batch 0 on chunk 1
    plt.close(ax.figure)
    zb = _unit_ops(pp.zb_h1_schedule(3, 4), 3)
    ax = gantt(zb)
    # a split backward's colours name its halves; an unsplit one is "backward"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "B: input gradient", "W: weight gradient"], legend
    plt.close(ax.figure)
    ax = gantt(_unit_ops(pp.one_f_one_b_schedule(3, 4), 3))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]
    plt.close(ax.figure)
    ax = idle_gaps(_unit_ops(pp.zb_h1_schedule(2, 4), 2), unit="slot")  # P - 1 = 1 slot each
    idle = [t.get_text() for t in ax.texts if "idle" in t.get_text()]
    assert idle == [" 1 slot idle"] * 2, idle
    plt.close(ax.figure)
    ax = held_activations(zb)
    assert [max(line.get_ydata()) for line in ax.get_lines()] == [3, 3, 3]  # min(P, M)
    plt.close(ax.figure)
