"""Tests for dmlbook.advanced.speedups (chapter 12): per-rank traces of bucketed, naive and torch
DDP steps are valid Chrome traces with communication and compute events, whose breakdown adds up to
the step's wall time; the interval arithmetic on hand-made intervals; multiplexed jobs and a job
migrated from 2 ranks to 1 equal training alone; heterogeneous training with unequal
batches, gradients weighted by batch size, equals single-process SGD on the union batch at world
sizes 2, 3 (ranks 0-2 of 4) and 4, and plain averaging does not. Timings are never asserted."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dmlbook.advanced import speedups as pr
from dmlbook.launch import run

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(rtol=0, atol=1e-10)  # float64 jobs: the real error is near 1e-15
JOB = pr.Job(
    "a", seed=1, samples=96, features=8, hidden=(16,), global_batch=12, dtype=torch.float64
)
OTHER = pr.Job(
    "b",
    seed=2,
    samples=120,
    features=6,
    hidden=(8, 8),
    classes=3,
    global_batch=12,
    lr=0.1,
    momentum=0.5,
    dtype=torch.float64,
)
PLAIN = pr.Job(
    "plain",
    seed=3,
    samples=96,
    features=8,
    hidden=(16,),
    global_batch=24,
    lr=0.5,
    momentum=0.0,
    dtype=torch.float64,
)
HETERO_BATCHES = {2: [5, 19], 3: [3, 9, 12], 4: [1, 2, 8, 13]}
STEPS, MIGRATE_AT = 10, 4  # 8 steps an epoch: the migrated job crosses into epoch 2
TINY = dict(steps=2, warmup=1, batch=16, in_features=32, hidden=(64, 64), bucket_cap_mb=0.01)


def _close(a: dict, b: dict, **tol) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) for k in a)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _hetero(world: int, group=None) -> dict:
    return {
        "weighted": pr.train_heterogeneous(PLAIN, 4, batches=HETERO_BATCHES[world], group=group),
        "unweighted": pr.train_heterogeneous(
            PLAIN, 4, batches=HETERO_BATCHES[world], weighted=False, group=group
        ),
    }


def _at_four() -> dict:
    """Rank function at 4 ranks: heterogeneous checks at 4 and, in a group of ranks 0-2, at 3."""
    three = dist.new_group([0, 1, 2])  # every rank creates every group
    return {4: _hetero(4), 3: _hetero(3, three) if dist.get_rank() < 3 else None}


def _at_two(trace_dir: str, job_dir: str) -> dict:
    """Rank function at 2 ranks: traces of the three wrappers, multiplexing, the first leg of a
    job that then migrates to 1 rank, heterogeneous checks (including a measured, throttled
    split), and bad input."""
    errors = []
    for bad in (
        lambda: pr.run_multiplexed([JOB, JOB], 2),
        lambda: pr.run_alone(JOB, 0),
        lambda: pr.profile_data_parallel("gossip", trace_dir=trace_dir),
        lambda: pr.train_heterogeneous(PLAIN, 2, batches=[12, 11]),
        lambda: pr.train_heterogeneous(PLAIN, 2, slowdown=[1, 0.5]),
        lambda: pr.train_heterogeneous(JOB, 2),
    ):
        try:
            bad()
        except ValueError as error:
            errors.append(str(error))
    return {
        "profiles": {
            w: pr.profile_data_parallel(w, trace_dir=trace_dir, **TINY) for w in pr.WRAPPERS
        },
        "multiplexed": pr.run_multiplexed([JOB, OTHER], STEPS, slice_steps=3),
        "alone": [pr.run_alone(JOB, STEPS), pr.run_alone(OTHER, STEPS)],
        "leg": pr.train_job(JOB, MIGRATE_AT, job_dir),
        2: _hetero(2),
        "measured": pr.train_heterogeneous(
            PLAIN, 2, batches="proportional", slowdown=[1, 3], probe_steps=2
        ),
        "errors": errors,
    }


@functools.cache
def launches() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="dmlbook-profiling-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return {
        4: run(_at_four, 4),
        2: run(_at_two, 2, str(tmp / "traces"), str(tmp / "job")),
        "job_dir": tmp / "job",
    }


# ---- 1. interval arithmetic ------------------------------------------------------------------


def test_interval_arithmetic_on_hand_made_intervals():
    assert pr.union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    assert pr.length([(0, 2), (1, 3), (10, 11)]) == 4
    assert pr.intersection([(0, 4), (6, 10)], [(2, 7), (9, 12)]) == [(2, 4), (6, 7), (9, 10)]
    assert pr.intersection([(0, 1)], [(1, 2)]) == []  # touching is not overlapping
    assert pr.difference([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert pr.difference([(0, 1)], []) == [(0, 1)]
    # comm (0, 4) and (8, 10); backward (2, 9): 2 of 4 and 1 of 2 hidden -> 3 / 6
    assert pr.overlap_fraction([(0, 4), (8, 10)], [(2, 9)]) == pytest.approx(0.5)
    assert pr.overlap_fraction([(0, 4)], [(5, 6)]) == 0.0  # naive: after backward
    assert pr.overlap_fraction([(1, 2)], [(0, 3)]) == 1.0
    assert pr.overlap_fraction([(0, 2), (1, 3)], [(0, 3)]) == 1.0  # overlapping comm counts once
    assert pr.overlap_fraction([], [(0, 1)]) == 0.0


def test_intervals_and_splits_reject_bad_input(tmp_path):
    for bad in ([(2, 1)], [(0, float("nan"))], [(1, 2, 3)]):
        with pytest.raises(ValueError, match="interval"):
            pr.union(bad)
    with pytest.raises(ValueError, match="speeds"):
        pr.proportional_batches([1.0, 0.0], 8)
    with pytest.raises(ValueError, match="one each"):
        pr.proportional_batches([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError, match="one each"):
        pr.equal_batches(2, 3)
    with pytest.raises(ValueError, match="global_batch"):
        pr.Job("x", samples=10, global_batch=11)
    with pytest.raises(ValueError, match="traceEvents"):
        path = tmp_path / "t.json"
        path.write_text("[]")
        pr.load_trace(path)
    with pytest.raises(ValueError, match="dmlbook.step"):
        pr.analyse_trace({"traceEvents": []})


def test_proportional_batches_sum_and_follow_speed():
    assert pr.proportional_batches([1, 1], 10) == [5, 5]
    assert pr.proportional_batches([3, 1], 8) == [6, 2]
    assert pr.proportional_batches([1, 1, 1], 10) == [4, 3, 3]
    assert pr.proportional_batches([1, 2, 2], 10) == [2, 4, 4]
    assert pr.proportional_batches([1000, 1], 4) == [3, 1]  # the slow rank still gets one
    assert pr.proportional_batches([1, 1000, 1], 5) == [1, 3, 1]
    for speeds, batch in (([1.0, 2.5, 0.3], 37), ([5, 4, 3, 2], 100), ([0.7, 0.2, 0.1], 10)):
        split = pr.proportional_batches(speeds, batch)
        assert sum(split) == batch and min(split) >= 1
        exact = [batch * s / sum(speeds) for s in speeds]
        assert all(abs(b - e) < 1 for b, e in zip(split, exact, strict=True))
    assert pr.equal_batches(10, 3) == [4, 3, 3]


def test_analyse_trace_on_a_hand_made_trace():
    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}

    trace = {
        "distributedInfo": {"rank": 3},
        "traceEvents": [
            op(pr.STEP, 0, 100, cat="user_annotation"),
            op("aten::addmm", 0, 30),  # forward
            op("autograd::engine::evaluate_function: AddmmBackward0", 30, 40),
            op("aten::mm", 35, 10),  # nested: counted once
            op("c10d::allreduce_", 50, 2),  # the enqueue, on the training thread
            op("gloo:all_reduce", 52, 38, tid=2, cat="user_annotation"),  # 52..90
            op("aten::add_", 95, 5),
            op("gloo:barrier", 200, 5, tid=2),  # outside the step: ignored
        ],
    }
    p = pr.analyse_trace(trace)
    assert (p.rank, p.steps) == (3, 1)
    assert p.wall_s == pytest.approx(100e-6)
    assert p.compute_s == pytest.approx(73e-6)  # 0..50, 52..70, 95..100: the enqueue is comm
    assert p.communication_s == pytest.approx(40e-6)  # 50..90
    assert p.exposed_communication_s == pytest.approx(22e-6)  # 50..52 and 70..90
    assert p.hidden_communication_s == pytest.approx(18e-6)  # 52..70 under backward's compute
    assert p.other_s == pytest.approx(5e-6)  # 90..95
    assert p.overlap == pytest.approx(18 / 40)
    assert sum(p.breakdown(per_step=False).values()) == pytest.approx(p.wall_s)
    spans = p.step_spans(0)  # µs since the step began, for drawing
    assert spans == {
        "compute": [(0.0, 50.0), (52.0, 70.0), (95.0, 100.0)],
        "backward": [(30.0, 50.0), (52.0, 70.0)],
        "all-reduce": [(50.0, 90.0)],
        "hidden": [(52.0, 70.0)],
    }


def test_profiler_banners_are_dropped_and_other_stderr_kept(capfd):
    from dmlbook.advanced.speedups.profiling import _without_profiler_banners

    with _without_profiler_banners():
        os.write(2, b"USDT:2026 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    assert capfd.readouterr().err == "a real warning\n"


# ---- 2. real traces --------------------------------------------------------------------------


def test_traces_are_chrome_json_from_every_rank_with_comm_and_compute():
    profiles = [r["profiles"] for r in launches()[2]]
    for wrapper in pr.WRAPPERS:
        for rank in range(2):
            p = profiles[rank][wrapper]
            trace = json.loads(Path(p.trace_path).read_text())
            assert trace["distributedInfo"]["rank"] == rank == p.rank
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert pr.STEP in names
            assert any(n.startswith("gloo:all_reduce") for n in names), (wrapper, rank)
            assert any(n.startswith("aten::") for n in names)
            assert any(pr.is_backward(n) for n in names)
            assert p.steps == TINY["steps"]
            assert p.compute_s > 0 and p.communication_s > 0
            total = p.compute_s + p.exposed_communication_s + p.other_s
            assert total == pytest.approx(p.wall_s, rel=1e-9)
            assert p.other_s >= -1e-12 and p.exposed_communication_s <= p.communication_s
            assert 0.0 <= p.overlap <= 1.0
            # the naive wrapper all-reduces after backward: nothing is hidden, by construction
            if wrapper == "naive":
                assert p.hidden_communication_s == 0.0


# ---- 3. multiplexing and migration -----------------------------------------------------------


def test_multiplexed_jobs_each_equal_training_alone():
    for rank_result in launches()[2]:
        mux = rank_result["multiplexed"]
        assert [j.name for j in mux.jobs] == ["a", "b"]
        names = [name for name, _, _ in mux.slices]
        assert names[:4] == ["a", "b", "a", "b"] and len(names) == 8  # ceil(10 / 3) turns each
        for shared, alone in zip(mux.jobs, rank_result["alone"], strict=True):
            assert _close(shared.state, alone.state, rtol=0, atol=0)  # bitwise
            assert shared.losses == alone.losses
            assert shared.samples == STEPS * 12 and mux.throughput > 0
    reference = pr.job_reference(OTHER, STEPS)
    assert _close(launches()[2][0]["multiplexed"].jobs[1].state, reference, **TOL)


def test_migrated_job_equals_uninterrupted_training():
    reference, before = pr.job_reference(JOB, STEPS), pr.job_reference(JOB, MIGRATE_AT)
    first = launches()[2]
    assert all(r["leg"].resumed_from is None and r["leg"].steps == MIGRATE_AT for r in first)
    assert _close(first[0]["leg"].state, before, **TOL)
    moved = pr.train_job(JOB, STEPS, launches()["job_dir"])  # restarted here, on 1 rank
    assert moved.resumed_from == MIGRATE_AT and moved.world_size == 1
    assert moved.steps == STEPS - MIGRATE_AT and moved.throughput > 0
    assert _close(moved.state, first[0]["alone"][0].state, **TOL)  # uninterrupted, 2 ranks
    assert _close(moved.state, reference, **TOL)
    assert _max_diff(moved.state, before) > 1e-3  # it did train after the move
    with pytest.raises(ValueError, match="past steps"):
        pr.train_job(JOB, MIGRATE_AT, launches()["job_dir"])  # the checkpoint is at step 10
    with pytest.raises(ValueError, match="holds job 'a', not 'twin'"):  # same shapes, other job
        pr.train_job(dataclasses.replace(JOB, name="twin"), STEPS, launches()["job_dir"])
    with pytest.raises(ValueError, match="does not fit"):
        pr.train_job(OTHER, STEPS, launches()["job_dir"])


# ---- 4. heterogeneous workers ----------------------------------------------------------------


def test_weighted_unequal_batches_equal_single_process_and_plain_averaging_does_not():
    reference = pr.train_union_reference(PLAIN, 4)
    for world in (2, 3, 4):
        for rank_result in launches()[2 if world == 2 else 4][:world]:
            weighted, unweighted = rank_result[world]["weighted"], rank_result[world]["unweighted"]
            assert weighted.batches == HETERO_BATCHES[world]
            assert _close(weighted.state, reference, **TOL), world
            assert _max_diff(unweighted.state, reference) > 1e-3, world


def test_measured_split_follows_the_throttled_speeds():
    runs = [r["measured"] for r in launches()[2]]
    assert runs[0].batches == runs[1].batches  # every rank derived the same split
    assert runs[0].speeds == runs[1].speeds and len(runs[0].speeds) == 2
    assert sum(runs[0].batches) == PLAIN.global_batch
    assert runs[0].batches == pr.proportional_batches(runs[0].speeds, PLAIN.global_batch)
    assert _close(runs[0].state, pr.train_union_reference(PLAIN, 2), **TOL)


def test_bad_input_raises_valueerror_on_the_ranks():
    errors = launches()[2][0]["errors"]
    assert len(errors) == 6, errors
    assert "distinct names" in errors[0] and "steps=0" in errors[1]
    assert "wrapper" in errors[2] and "summing to 24" in errors[3]
    assert "slowdown" in errors[4] and "momentum" in errors[5]
