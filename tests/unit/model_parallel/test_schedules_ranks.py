"""Interleaved 1F1B and ZB-H1 on real ranks, through the one executor
(dmlbook.model_parallel.pipeline.PipelineStage) and dmlbook.launch.run: gradients after a step
and parameters after two equal to one process in float64 to 1e-12 at P = 2, 3, 4 and several M;
the same loss and gradients as torch.distributed.pipelining's ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble; bad input a clear error on the rank, never a hang."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

from dmlbook.launch import RankError, run
from dmlbook.model_parallel import pipeline as pp
from dmlbook.models import char_gpt, next_token_loss

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, SEQ = 20, 12, 8
TOL = dict(rtol=0, atol=1e-12)
# (schedule, chunks per stage, micro-batches) per pipeline depth; ZB-H1 with M < P too
CASES = {
    2: [("interleaved", 2, 2), ("interleaved", 2, 4), ("interleaved", 3, 4), ("zb-h1", 1, 1),
        ("zb-h1", 1, 4)],
    3: [("interleaved", 2, 3), ("interleaved", 2, 6), ("zb-h1", 1, 2), ("zb-h1", 1, 6)],
    4: [("interleaved", 2, 4), ("interleaved", 2, 12), ("zb-h1", 1, 3), ("zb-h1", 1, 6)],
}  # fmt: skip
TORCH_CASES = {2: [("interleaved", 2, 4), ("zb-h1", 1, 4)], 3: [("interleaved", 2, 6)], 4: []}


def _model():
    # 8 layers (embedding, 6 blocks, head): enough for 4 stages x 2 chunks
    return char_gpt(VOCAB, seed=0, n_layer=6, n_head=2, n_embd=16, block_size=SEQ).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))


def _chunks(model, stages: int, chunks: int, rank: int) -> list:
    """Rank ``rank``'s model chunks: virtual stages rank, rank + P, rank + 2P, ..."""
    layers = pp.layers_of(model)
    parts = pp.split_model(layers, pp.even_partition(len(layers), stages * chunks))
    return [parts[c * stages + rank] for c in range(chunks)]


def _named(modules, what: str) -> dict[str, torch.Tensor]:
    return {
        f"{c}.{n}": (p.grad if what == "grad" else p).detach().clone()
        for c, module in enumerate(modules)
        for n, p in module.named_parameters()
    }


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # linear in the gradients


def _reference(stages: int, chunks: int):
    """One process: loss and per-rank grads of step 1, per-rank parameters after 2 steps."""
    model = _model()
    opt = _optimizer(model.parameters())
    x, y = _batch()
    for step in range(2):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if step == 0:
            first = loss.item()
            grads = [_named(_chunks(model, stages, chunks, r), "grad") for r in range(stages)]
        opt.step()
    return first, grads, [_named(_chunks(model, stages, chunks, r), "param") for r in range(stages)]


def _train(cases, torch_cases):
    stages, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch()
    out = {}
    for schedule, chunks, microbatches in cases:
        modules = _chunks(_model(), stages, chunks, rank)
        stage = pp.PipelineStage(modules if chunks > 1 else modules[0], rank, stages)
        opt = _optimizer(stage.module.parameters())
        record = {}
        for step in range(2):
            opt.zero_grad()
            result = stage.train_step(
                x if stage.is_first else None,
                y if stage.is_last else None,
                next_token_loss,
                microbatches,
                schedule,
            )
            if step == 0:
                record.update(loss=result.loss, grads=_named(modules, "grad"))
                record.update(live=result.peak_live_activations, held_after=len(stage.held))
                record.update(ops=[(r.op, r.microbatch, r.chunk) for r in result.timeline])
            opt.step()
        record["params"] = _named(modules, "param")
        out[schedule, chunks, microbatches] = record
    for case in torch_cases:
        out[("torch", *case)] = _torch_pipelining(*case, x, y)
    return out


def _torch_pipelining(schedule: str, chunks: int, microbatches: int, x, y):
    """The same chunks through torch.distributed.pipelining: one step's loss and grads."""
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    stages, rank = dist.get_world_size(), dist.get_rank()
    modules = _chunks(_model(), stages, chunks, rank)
    theirs = [
        PipelineStage(m, c * stages + rank, stages * chunks, torch.device("cpu"))
        for c, m in enumerate(modules)
    ]
    kind = {"interleaved": ScheduleInterleaved1F1B, "zb-h1": ScheduleInterleavedZeroBubble}
    runner = kind[schedule](theirs, microbatches, loss_fn=next_token_loss)
    losses: list[torch.Tensor] = []
    if rank == 0:
        runner.step(x)
    elif rank == stages - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    loss = torch.stack(losses).mean().item() if losses else None
    return {"loss": loss, "grads": _named(modules, "grad")}


@functools.cache
def _results(stages: int):
    return run(_train, stages, CASES[stages], TORCH_CASES[stages], timeout=120)


def _assert_close_dicts(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=f"{what}: {name}")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_interleaved_and_zb_h1_equal_one_process(stages):
    results = _results(stages)
    for schedule, chunks, microbatches in CASES[stages]:
        case = (schedule, chunks, microbatches)
        loss, grads, params = _reference(stages, chunks)
        assert results[-1][case]["loss"] == pytest.approx(loss, abs=1e-12), case
        assert all(results[r][case]["loss"] is None for r in range(stages - 1))
        for rank in range(stages):
            _assert_close_dicts(results[rank][case]["grads"], grads[rank], f"{case} grads {rank}")
            _assert_close_dicts(results[rank][case]["params"], params[rank], f"{case} params")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_each_rank_ran_its_table_and_held_what_the_table_says(stages):
    results = _results(stages)
    for schedule, chunks, microbatches in CASES[stages]:
        if schedule == "interleaved":
            actions = pp.interleaved_schedule(stages, microbatches, chunks)
        else:
            actions = pp.zb_h1_schedule(stages, microbatches)
        for s in range(stages):
            record = results[s][schedule, chunks, microbatches]
            mine = pp.stage_actions(actions, s)
            assert record["ops"] == [(a.op, a.microbatch, a.chunk) for a in mine]
            assert record["held_after"] == 0  # every graph released by the step's end
            if schedule == "zb-h1":  # held from F to W: 1F1B's peak, min(P, M), on every stage
                assert record["live"] == min(stages, microbatches)
            else:  # (micro-batch, chunk) pairs: 1F1B's warm-up plus a round per further chunk
                want = min(stages - s + (chunks - 1) * stages, microbatches * chunks)
                assert record["live"] == want


@pytest.mark.parametrize("stages", [2, 3])
def test_same_loss_and_grads_as_torch_interleaved_and_zero_bubble(stages):
    results = _results(stages)
    for schedule, chunks, microbatches in TORCH_CASES[stages]:
        loss, grads, _ = _reference(stages, chunks)
        key = ("torch", schedule, chunks, microbatches)
        ours = results[-1][schedule, chunks, microbatches]["loss"]
        assert results[-1][key]["loss"] == pytest.approx(ours, abs=1e-12)
        for rank in range(stages):
            _assert_close_dicts(results[rank][key]["grads"], grads[rank], f"torch {key} {rank}")


def _bad(stages: int, chunks, microbatches: int, schedule: str):
    rank = dist.get_rank()
    modules = _chunks(_model(), stages, max(chunks, 1), rank)[:chunks]
    stage = pp.PipelineStage(modules, rank, stages)
    x, y = _batch()
    return stage.train_step(x, y, next_token_loss, microbatches, schedule)


def test_bad_input_is_a_clear_error_on_the_rank_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankError, match="M = 6 micro-batches is not a multiple of P = 4") as e:
        run(_bad, 4, 4, 2, 6, "interleaved", timeout=60)
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(RankError, match="empty list of model chunks") as e:
        run(_bad, 2, 2, 0, 4, "interleaved", timeout=60)
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(RankError, match="holds 2 model chunks, which the 'zb-h1' schedule"):
        run(_bad, 2, 2, 2, 4, "zb-h1", timeout=60)
    assert time.monotonic() - start < 40
