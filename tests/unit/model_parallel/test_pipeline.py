"""Tests for dmlbook.model_parallel.pipeline: schedules as tables, pipelined training equal to
single-process training (and to torch.distributed.pipelining) at P = 2, 3, 4, live activations
counted, and bad
input that fails fast with a clear error."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.launch import RankError, run
from dmlbook.model_parallel import pipeline as pp
from dmlbook.models import char_gpt, mlp, next_token_loss

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, SEQ = 20, 12, 8  # 12 sequences: 1, 2, 3, 4 and 6 micro-batches divide them
TOL = dict(rtol=0, atol=1e-6)  # the claim; float64 keeps the real error near 1e-15
# (schedule, micro-batches) trained at each pipeline depth; M < P and M not a multiple of P too.
CASES = {
    2: [("vanilla", 1), ("gpipe", 6), ("1f1b", 3), ("1f1b", 6)],
    3: [("vanilla", 1), ("gpipe", 3), ("gpipe", 6), ("1f1b", 2), ("1f1b", 6)],
    4: [("gpipe", 2), ("gpipe", 6), ("1f1b", 3), ("1f1b", 6)],
}
TORCH_CASES = {2: [("gpipe", 6), ("1f1b", 3)], 3: [("gpipe", 3), ("1f1b", 6)], 4: []}


def _model() -> nn.Module:
    return char_gpt(VOCAB, seed=0, n_layer=4, n_head=2, n_embd=16, block_size=SEQ).double()


def _batch(batch: int = BATCH, seq: int = SEQ, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(2))


def _stage_modules(model: nn.Module, stages: int) -> list[nn.Sequential]:
    layers = pp.layers_of(model)
    return pp.split_model(layers, pp.even_partition(len(layers), stages))


def _named(module: nn.Module, what: str) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if what == "grad" else p).detach().clone() for n, p in module.named_parameters()
    }


# ---- the single-process reference --------------------------------------------------------------


def _reference(stages: int, steps: int = 2):
    """Loss, per-stage grads of step 1 and per-stage parameters after ``steps`` Adam steps."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    split = _stage_modules(model, stages)
    x, y = _batch()
    for step in range(steps):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if step == 0:
            first_loss, grads = loss.item(), [_named(m, "grad") for m in split]
        opt.step()
    return first_loss, grads, [_named(m, "param") for m in split]


# ---- what every rank runs ----------------------------------------------------------------------


def _train_cases(cases, torch_cases):
    """On each rank: for each case, two Adam steps through our pipeline; then torch's."""
    stages, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch()
    out = {}
    for schedule, microbatches in cases:
        module = _stage_modules(_model(), stages)[rank]
        stage = pp.PipelineStage(module, rank, stages)
        opt = torch.optim.Adam(module.parameters(), lr=1e-2)
        record = {}
        for step in range(2):
            opt.zero_grad()
            result = stage.train_step(
                x if stage.is_first else None,
                y if stage.is_last else None,
                next_token_loss,
                microbatches,
                schedule,
                measure_memory=True,
            )
            if step == 0:
                record.update(loss=result.loss, grads=_named(module, "grad"))
                record.update(live=result.peak_live_activations, bytes=result.peak_saved_bytes)
                record.update(ops=[(r.op, r.microbatch) for r in result.timeline])
                record.update(timeline=result.timeline)
            opt.step()
        record["params"] = _named(module, "param")
        out[schedule, microbatches] = record
    for schedule, microbatches in torch_cases:
        out["torch", schedule, microbatches] = _torch_pipelining(schedule, microbatches, x, y)
    return out


def _torch_pipelining(schedule: str, microbatches: int, x, y):
    """The same split, one step through torch.distributed.pipelining: loss and grads."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages, rank = dist.get_world_size(), dist.get_rank()
    module = _stage_modules(_model(), stages)[rank]
    stage = PipelineStage(module, rank, stages, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(stage, microbatches, loss_fn=next_token_loss)  # scale_grads: grads of the mean
    losses: list[torch.Tensor] = []
    if rank == 0:
        runner.step(x)
    elif rank == stages - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    loss = torch.stack(losses).mean().item() if losses else None
    return {"loss": loss, "grads": _named(module, "grad")}


@functools.cache
def _results(stages: int):
    return run(_train_cases, stages, CASES[stages], TORCH_CASES[stages], timeout=90)


@functools.cache
def _expected(stages: int):
    return _reference(stages)


def _assert_close_dicts(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=f"{what}: {name}")


# ---- schedules are tables ---------------------------------------------------------------------


def test_schedules_as_tables():
    assert pp.format_schedule(pp.gpipe_schedule(2, 3)) == (
        "stage 0: F0 F1 F2 B0 B1 B2\nstage 1: F0 F1 F2 B0 B1 B2"
    )
    assert pp.format_schedule(pp.one_f_one_b_schedule(3, 4)) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "stage 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
        "stage 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    assert pp.format_schedule(pp.vanilla_schedule(3)) == (
        "stage 0: F0 B0\nstage 1: F0 B0\nstage 2: F0 B0"
    )
    assert pp.format_schedule(pp.inference_schedule(2, 2)) == "stage 0: F0 F1\nstage 1: F0 F1"
    assert pp.stage_actions(pp.one_f_one_b_schedule(2, 2), 1)[1] == pp.Action(1, 1, "B", 0)
    assert pp.bubble_theory(3, 3) == pytest.approx(2 / 5)
    assert set(pp.SCHEDULES) == {"vanilla", "gpipe", "1f1b", "interleaved", "zb-h1"}


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_every_schedule_is_valid_and_1f1b_holds_at_most_p_minus_s(stages):
    for microbatches in range(1, 9):
        for name in ("gpipe", "1f1b"):
            actions = pp.SCHEDULES[name](stages, microbatches)
            pp.check_schedule(actions, stages, microbatches)
            for s in range(stages):
                live = peak = 0
                for a in pp.stage_actions(actions, s):
                    live += 1 if a.op == "F" else -1
                    peak = max(peak, live)
                want = microbatches if name == "gpipe" else min(stages - s, microbatches)
                assert peak == want, (name, stages, microbatches, s)


def test_check_schedule_rejects_schedules_that_would_deadlock_or_miss_work():
    good = pp.gpipe_schedule(2, 2)
    swapped = [a if a.stage == 0 else pp.Action(1, a.step, a.op, 1 - a.microbatch) for a in good]
    with pytest.raises(ValueError, match="different micro-batch orders"):
        pp.check_schedule(swapped, 2, 2)
    with pytest.raises(ValueError, match="must run B once"):
        pp.check_schedule([a for a in good if (a.op, a.microbatch) != ("B", 1)], 2, 2)
    backwards_first = [pp.Action(0, 0, "B", 0), pp.Action(0, 1, "F", 0)]
    with pytest.raises(ValueError, match="B0 before F0"):
        pp.check_schedule(backwards_first, 1, 1)
    with pytest.raises(ValueError, match="microbatches=4"):
        pp.vanilla_schedule(2, 4)
    with pytest.raises(ValueError, match="stages must be an integer"):
        pp.gpipe_schedule(0, 2)


# ---- layer split ----------------------------------------------------------------------------


def test_layer_split_shares_parameters_and_computes_the_model():
    model = _model()
    x, y = _batch()
    layers = pp.layers_of(model)
    assert len(layers) == 4 + 2  # embedding, 4 blocks, head
    stages = pp.split_model(layers, pp.even_partition(len(layers), 4))
    assert [len(s) for s in stages] == [2, 2, 1, 1]
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(x)[0], rtol=0, atol=0)
    net = mlp(seed=0, in_features=6, hidden=(5, 4), out_features=3)
    units = pp.layers_of(net)
    assert len(units) == 3
    z = torch.randn(7, 6)
    torch.testing.assert_close(nn.Sequential(*units)(z), net(z), rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        pp.even_partition(3, 4)
    with pytest.raises(ValueError, match="sum to 3"):
        pp.split_model(units, [1, 1])


# ---- pipelined training equals single-process training ------------------------------------------


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipelined_training_equals_single_process(stages):
    results, (loss, grads, params) = _results(stages), _expected(stages)
    for case in CASES[stages]:
        assert results[-1][case]["loss"] == pytest.approx(loss, abs=1e-9), case
        assert all(results[r][case]["loss"] is None for r in range(stages - 1))
        for rank in range(stages):
            _assert_close_dicts(results[rank][case]["grads"], grads[rank], f"{case} grads {rank}")
            _assert_close_dicts(results[rank][case]["params"], params[rank], f"{case} after Adam")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_1f1b_holds_at_most_p_minus_s_microbatches_where_gpipe_holds_m(stages):
    results = _results(stages)
    for schedule, microbatches in CASES[stages]:
        for s in range(stages):
            record = results[s][schedule, microbatches]
            limit = min(stages - s, microbatches) if schedule == "1f1b" else microbatches
            assert record["live"] == limit, (schedule, microbatches, s)
            assert record["ops"] == [
                (a.op, a.microbatch)
                for a in pp.stage_actions(pp.SCHEDULES[schedule](stages, microbatches), s)
            ]
    # Bytes saved for backward, counted by SavedTensorMeter: each micro-batch saves the same
    # bytes, so the peak is (micro-batches held) x (bytes per micro-batch), and 1F1B saves a
    # fraction min(P - s, M) / M of GPipe's.
    microbatches = 6
    for s in range(stages):
        gpipe = results[s]["gpipe", microbatches]["bytes"]
        one_f_one_b = results[s]["1f1b", microbatches]["bytes"]
        assert one_f_one_b * microbatches == gpipe * min(stages - s, microbatches)
        if stages - s < microbatches:
            assert one_f_one_b < gpipe


@pytest.mark.parametrize("stages", [2, 3])
def test_same_loss_and_grads_as_torch_distributed_pipelining(stages):
    results, (loss, grads, _) = _results(stages), _expected(stages)
    for schedule, microbatches in TORCH_CASES[stages]:
        key = ("torch", schedule, microbatches)
        assert results[-1][key]["loss"] == pytest.approx(loss, abs=1e-9)
        assert results[-1][key]["loss"] == pytest.approx(
            results[-1][schedule, microbatches]["loss"]
        )
        for rank in range(stages):
            _assert_close_dicts(results[rank][key]["grads"], grads[rank], f"torch {key} {rank}")


def test_timelines_are_ordered_and_the_bubble_is_a_fraction():
    results = _results(3)
    timelines = [results[s]["gpipe", 6]["timeline"] for s in range(3)]
    for timeline in timelines:
        assert all(0 <= r.start <= r.end for r in timeline)
        assert all(a.end <= b.start for a, b in zip(timeline, timeline[1:], strict=False))
    # stage 1 cannot start micro-batch 0 before stage 0 has finished it
    assert timelines[1][0].start >= timelines[0][0].end
    assert 0 < pp.measured_bubble(timelines) < 1
    busy = [pp.OpRecord("F", 0, 0.0, 1.0)], [pp.OpRecord("F", 0, 1.0, 2.0)]
    assert pp.measured_bubble(busy) == pytest.approx(0.5)
    # Packed: the same durations with instant messages can only idle less than the real run.
    packed = pp.packed_timelines(timelines)
    assert [[(r.op, r.microbatch) for r in t] for t in packed] == [
        [(r.op, r.microbatch) for r in t] for t in timelines
    ]
    assert pp.measured_bubble(packed) <= pp.measured_bubble(timelines) + 1e-12


def test_packed_timelines_close_the_gaps_that_messages_left():
    R = pp.OpRecord
    late = [  # stage 1 received F0 0.5 s late; stage 0 received B0 0.25 s late
        [R("F", 0, 0.0, 1.0), R("B", 0, 5.75, 7.75)],
        [R("F", 0, 1.5, 2.5), R("B", 0, 2.5, 5.5)],
    ]
    packed = pp.packed_timelines(late)
    assert [(r.start, r.end) for r in packed[0]] == [(0.0, 1.0), (5.0, 7.0)]
    assert [(r.start, r.end) for r in packed[1]] == [(1.0, 2.0), (2.0, 5.0)]
    assert pp.measured_bubble(packed) == pytest.approx(1 - 7 / 14)
    backwards_first = [[R("B", 0, 0, 1), R("F", 0, 1, 2)], [R("F", 0, 0, 1), R("B", 0, 1, 2)]]
    with pytest.raises(ValueError, match="cycle"):
        pp.packed_timelines(backwards_first)


# ---- shapes that change, inference, and errors --------------------------------------------------


def _shape_change_and_infer():
    """Two batch shapes in a row through one stage, then inference: returns losses and logits."""
    stages, rank = dist.get_world_size(), dist.get_rank()
    module = _stage_modules(_model(), stages)[rank]
    stage = pp.PipelineStage(module, rank, stages)
    losses = []
    for batch, seq in ((12, 8), (12, 8), (6, 5)):
        x, y = _batch(batch, seq, seed=batch + seq)
        result = stage.train_step(x, y, next_token_loss, microbatches=3, schedule="1f1b")
        losses.append(result.loss)
    x, _ = _batch(6, 5, seed=11)
    outputs = stage.infer(x, microbatches=3).outputs  # micro-batches of (2, 5): no new handshake
    return losses, outputs, stage.handshakes, result.sent_bytes


def test_a_changed_input_shape_is_handshaken_again_and_inference_matches():
    model = _model()
    results = run(_shape_change_and_infer, 3, timeout=60)
    losses, outputs, _, _ = results[-1]
    for loss, (batch, seq) in zip(losses, ((12, 8), (12, 8), (6, 5)), strict=True):
        assert loss == pytest.approx(model(*_batch(batch, seq, seed=batch + seq))[1].item())
    torch.testing.assert_close(outputs, model(_batch(6, 5, seed=11)[0])[0], **TOL)
    # Stages 1 and 2 learned the shape on the first step and again when it changed, not on the
    # repeat. In the (6, 5) step, (6, 5, 16) float64 activations went forward over each link
    # and as many gradient bytes came back.
    assert [r[2] for r in results] == [0, 2, 2]
    activation_bytes = 6 * 5 * 16 * 8
    assert [r[3] for r in results] == [activation_bytes, 2 * activation_bytes, activation_bytes]


def test_microbatches_that_do_not_divide_the_batch_raise_valueerror():
    stage = pp.PipelineStage(nn.Sequential(*pp.layers_of(_model())), 0, 1, device="cpu")
    x, y = _batch()
    with pytest.raises(ValueError, match="batch size 12, which 5 micro-batches do not divide"):
        stage.train_step(x, y, next_token_loss, microbatches=5)
    with pytest.raises(ValueError, match="vanilla .* one micro-batch"):
        stage.train_step(x, y, next_token_loss, microbatches=2, schedule="vanilla")
    with pytest.raises(ValueError, match="unknown schedule"):
        stage.train_step(x, y, next_token_loss, microbatches=2, schedule="zigzag")
    with pytest.raises(ValueError, match="targets and loss_fn"):
        stage.train_step(x, None, next_token_loss)
    result = stage.train_step(x, y, next_token_loss, microbatches=4)  # P = 1 needs no process group
    assert result.loss == pytest.approx(_model()(x, y)[1].item())
    order = [("F", 1), ("B", 1), ("F", 0), ("B", 0)]  # a schedule given as a list of actions
    custom = [pp.Action(0, step, op, mb) for step, (op, mb) in enumerate(order)]
    result = stage.train_step(x, y, next_token_loss, microbatches=2, schedule=custom)
    assert [(r.op, r.microbatch) for r in result.timeline] == order
    assert result.loss == pytest.approx(_model()(x, y)[1].item())
    with pytest.raises(ValueError, match="must run B once"):
        stage.train_step(x, y, next_token_loss, microbatches=2, schedule=custom[:3])


def _build_stage(stages: int, microbatches: int = 1):
    rank = dist.get_rank()
    module = _stage_modules(_model(), stages)[min(rank, stages - 1)]
    stage = pp.PipelineStage(module, rank, stages)
    x, y = _batch()
    return stage.train_step(x, y, next_token_loss, microbatches)


def test_distributed_bad_input_surfaces_as_rank_error_without_hanging():
    with pytest.raises(RankError, match="needs 2 ranks in its group") as wrong_world:
        run(_build_stage, 3, 2, timeout=30)
    assert isinstance(wrong_world.value.__cause__, ValueError)
    start = time.monotonic()
    with pytest.raises(RankError, match="5 micro-batches do not divide") as bad_split:
        run(_build_stage, 3, 3, 5, timeout=30)  # stage 1 waits for data that never comes
    assert isinstance(bad_split.value.__cause__, ValueError)
    assert time.monotonic() - start < 20


class _Explodes(nn.Module):
    def forward(self, x):
        raise RuntimeError("stage 1 blew up")


def _one_stage_raises():
    rank = dist.get_rank()
    module = _stage_modules(_model(), 2)[0] if rank == 0 else _Explodes()
    stage = pp.PipelineStage(module, rank, 2)
    x, y = _batch()
    return stage.train_step(x, y, next_token_loss, 3, "1f1b")


def test_a_rank_that_raises_mid_step_is_a_rank_error():
    start = time.monotonic()
    with pytest.raises(RankError, match="stage 1 blew up") as failure:
        run(_one_stage_raises, 2, timeout=30)
    assert failure.value.rank == 1
    assert time.monotonic() - start < 20  # rank 0, blocked in a receive, was not waited for


# ---- the benchmark's records ------------------------------------------------------------------


def test_held_activations_draws_each_stage_up_to_its_peak():
    import matplotlib

    matplotlib.use("Agg")
    from dmlbook.viz.pipeline import held_activations

    R = pp.OpRecord
    gpipe = [[R("F", 0, 0, 1), R("F", 1, 1, 2), R("B", 0, 2, 3), R("B", 1, 3, 4)]]
    ax = held_activations(gpipe, caps=[1], cap_label="1F1B: at most")
    line = ax.get_lines()[0]
    assert max(line.get_ydata()) == 2 and line.get_ydata()[-1] == 0  # F0 F1: 2 held, all freed
    assert "stage 0: 1F1B: at most 1" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_held_activations_draws_true_levels_and_schedule_and_held_shares_the_time_axis():
    import matplotlib

    matplotlib.use("Agg")
    from dmlbook.viz.pipeline import schedule_and_held

    schedule = pp.one_f_one_b_schedule(3, 6)
    slots = pp.packed_timelines(
        [[pp.OpRecord(a.op, a.microbatch, 0, 1) for a in pp.stage_actions(schedule, s)]
         for s in range(3)]
    )  # fmt: skip
    top, bottom = schedule_and_held(slots, "1F1B", caps=[3, 2, 1])
    lines = [line for line in bottom.get_lines() if line.get_linestyle() == "-"]
    assert [max(line.get_ydata()) for line in lines] == [3, 2, 1]  # whole micro-batches, no offset
    assert top.get_xlim() == bottom.get_xlim()


def test_the_executor_ops_are_public_and_run_one_stage():
    """One stage with no group: run_schedule's F and B leave the gradients of the mean loss."""
    model = mlp(seed=0, in_features=4, hidden=(6,), out_features=2).double()
    stage = pp.PipelineStage(model, 0, 1, device="cpu")
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    result = stage.train_step(x, y, nn.functional.mse_loss, 3, "1f1b")
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert result.loss == pytest.approx(loss.item())
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert [(r.op, r.microbatch) for r in result.timeline] == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
    ]
    assert stage.held == {} and result.peak_live_activations == 1


def test_bench_pipeline_writes_the_promised_records(tmp_path, monkeypatch):
    import json

    from dmlbook.bench import pipeline as bench
    from dmlbook.bench.pipeline import bench_pipeline

    monkeypatch.setattr(bench, "bench_schedules", lambda: [])  # its own test follows

    path = tmp_path / "pipeline.json"
    bench_pipeline(
        microbatches=(2,), steps=3, warmup=0, width=16, depth=4, batch=8, json_path=str(path)
    )
    records = json.loads(path.read_text())
    keys = {"schedule", "stages", "microbatches", "median_step_s", "bubble_measured", "bubble_best"}
    keys |= {"bubble_theory", "bubble_packed", "wait_s", "message_s", "ratio_vs_torch"}
    keys |= {"cores_busy", "steps_s"}
    assert [(r["schedule"], r["microbatches"]) for r in records] == [
        ("vanilla", 1),
        ("gpipe", 2),
        ("1f1b", 2),
    ]
    for r in records:
        assert set(r) == keys
        assert r["stages"] == 2 and r["median_step_s"] > 0 and r["ratio_vs_torch"] > 0
        assert len(r["steps_s"]) == 3 and min(r["steps_s"]) <= r["median_step_s"]
        assert 0 <= r["bubble_best"] <= r["bubble_measured"] < 1  # least of 3 steps, median
        assert 0 <= r["bubble_packed"] <= r["bubble_measured"] + 1e-12
        assert r["wait_s"] >= 0 and r["message_s"] > 0
        assert r["bubble_theory"] == pytest.approx(1 / (r["microbatches"] + 1))
    assert len({r["cores_busy"] for r in records}) == 1 and 0 <= records[0]["cores_busy"] <= 1


def test_bench_schedules_sets_interleaved_and_zb_h1_beside_torch_with_equal_losses():
    from dmlbook.bench.pipeline import bench_schedules

    records = bench_schedules(stages=(2,), microbatches=(2,), steps=2, warmup=0, width=16,
                              depth=4, batch=8)  # fmt: skip
    assert [(r["schedule"], r["chunks"], r["microbatches"]) for r in records] == [
        ("1f1b", 1, 2), ("interleaved", 2, 2), ("zb-h1", 1, 2)
    ]  # fmt: skip
    for r in records:
        assert r["part"] == "beyond the book" and r["stages"] == 2
        assert r["loss"] == pytest.approx(r["torch_loss"], rel=1e-5)  # the bench asserts it too
        assert r["bubble_theory"] == pytest.approx(
            pp.bubble_theory(2, 2, r["schedule"], r["chunks"])
        )
        assert 0 <= r["bubble_packed"] <= r["bubble_measured"] + 1e-12 < 1 + 1e-12
        assert r["median_step_s"] > 0 and r["torch_median_step_s"] > 0
        assert r["peak_saved_bytes"] > 0 and r["torch_peak_saved_bytes"] > 0
        assert (r["ratio_vs_torch"] is None) == (r["schedule"] == "1f1b" or r["oversubscribed"])


# ---- GPU ------------------------------------------------------------------------------------


def _train_on_gpu(stages: int):
    x, y = _batch()
    rank = dist.get_rank()
    module = _stage_modules(_model(), stages)[rank]
    stage = pp.PipelineStage(module, rank, stages)  # device: cuda:<local rank> under NCCL
    assert stage.device.type == "cuda"
    result = stage.train_step(x, y, next_token_loss, 4, "1f1b")
    return result.loss, {n: g.cpu() for n, g in _named(module, "grad").items()}


@pytest.mark.gpu
def test_pipeline_on_gpus_equals_single_process():
    stages = min(torch.cuda.device_count(), 4)
    loss, grads, _ = _reference(stages, steps=1)
    if stages >= 2:
        results = run(_train_on_gpu, stages, stages, backend="nccl", timeout=120)
    else:  # one GPU: a one-stage pipeline on cuda:0, no process group needed
        module = _stage_modules(_model(), 1)[0]
        stage = pp.PipelineStage(module, 0, 1, device="cuda:0")
        result = stage.train_step(*_batch(), next_token_loss, 4, "1f1b")
        results = [(result.loss, {n: g.cpu() for n, g in _named(module, "grad").items()})]
    assert results[-1][0] == pytest.approx(loss, abs=1e-9)
    for rank, (_, got) in enumerate(results):
        _assert_close_dicts(got, grads[rank], f"gpu grads {rank}")
