"""Tests for dmlbook.advanced.zero: ZeRO stages 0-3 at world sizes 1, 2, 3 and 4 (units whose sizes
do not divide by 3 or 4) give the parameters of single-process Adam, of plain data parallelism and
of torch's DDP and FSDP2; each rank holds exactly the bytes the paper's formulas say (plus padding
and one unit in flight); the collectives carry 2x the model for stages 0-2 and 3x for stage 3;
bad input raises ValueError. One launch per world size, cached across tests."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dmlbook.advanced import zero
from dmlbook.comm.groups import local_rows, padded_size
from dmlbook.launch import run
from dmlbook.models import mlp
from dmlbook.optim import adam_update_

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, BATCH, LR = 3, 12, 1e-2
CROSS_CHECK = 2  # the world size that also runs torch's DDP and FSDP2
UNITS = [7 * 10 + 10, 10 * 5 + 5, 5 * 3 + 3]  # 80, 55, 18: padded at 2, 3 and 4 ranks
TOL = dict(rtol=0, atol=1e-12)  # float64 everywhere: the real differences are near 1e-16
F64 = 8  # bytes per element


def make_model() -> torch.nn.Module:
    return mlp(3, in_features=7, hidden=(10, 5), out_features=3).double()


def batches():
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(BATCH, 7, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _errors() -> dict[str, str]:
    """The ValueErrors a rank gets for bad arguments (nothing is sent before they are raised)."""
    found = {}
    for name, kwargs in {
        "stage 4": dict(stage=4),
        "stage -1": dict(stage=-1),
        "stage True": dict(stage=True),
        "collectives": dict(stage=1, collectives="nccl"),
        "lr": dict(stage=1, lr=0.0),
        "unit": dict(stage=3, units=[torch.nn.Linear(2, 2)]),
    }.items():
        try:
            zero.zero_data_parallel(make_model(), **kwargs)
        except ValueError as error:
            found[name] = str(error)
    return found


def _everything(cross_check_torch: bool) -> dict:
    out = {"plain ddp": zero.ddp_train(make_model, batches(), LR), "errors": _errors()}
    if dist.is_initialized() and dist.get_world_size() > 1:  # rank 0 has a wider model
        wider = mlp(3, in_features=7, hidden=(11, 5), out_features=3).double()
        try:
            zero.ZeroStage3(wider if dist.get_rank() == 0 else make_model())
        except ValueError as error:
            out["errors"]["different models"] = str(error)
    for stage in zero.ZERO_STAGES:
        out[stage, "torch"] = zero.zero_train(make_model, batches(), stage, LR)
        out[stage, "dmlbook"] = zero.zero_train(
            make_model, batches(), stage, LR, collectives="dmlbook", record_sends=True
        )
    # stage 3 really lets go: after a step no parameter of the model has any storage left
    model = make_model()
    engine = zero.ZeroStage3(model, LR)
    x, y = local_rows(batches()[0])
    torch.nn.functional.cross_entropy(engine(x), y).backward()
    engine.step()
    out["storage after step"] = [p.untyped_storage().nbytes() for p in model.parameters()]
    if cross_check_torch:  # torch.optim's first step imports torch._dynamo (seconds): once
        out["torch ddp"] = zero.ddp_train(make_model, batches(), LR, torch_ddp=True)
        out["fsdp2"] = zero.fsdp2_train(make_model, batches(), LR)
        out["adam"] = _adam_on_slices_and_torch_adam()
    return out


@functools.cache
def results(world_size: int) -> list[dict]:
    if world_size == 1:  # one rank needs no process group: run it right here
        return [_everything(False)]
    return run(_everything, world_size, world_size == CROSS_CHECK, timeout=120)


@functools.cache
def single_process() -> dict[str, torch.Tensor]:
    """The reference: one process, the whole batch, Adam (:func:`~dmlbook.optim.adam_update_`,
    checked against torch.optim.Adam below; torch.optim itself would import torch._dynamo here)."""
    model = make_model()
    optimizer = zero.training._PlainAdam(list(model.parameters()), LR)
    for x, y in batches():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_stage_equals_single_process_and_plain_data_parallel(world_size):
    ranks = results(world_size)
    assert_same(ranks[0]["plain ddp"], single_process())
    for rank in ranks:
        for stage in zero.ZERO_STAGES:
            for path in ("torch", "dmlbook"):
                got = rank[stage, path]
                assert_same(got["parameters"], rank["plain ddp"])
                assert got["losses"] == ranks[0][stage, path]["losses"] or world_size > 1


def test_cross_check_against_torch_ddp_and_fsdp2():
    """Torch's DDP with torch.optim.Adam, FSDP2 and every stage agree (2 ranks: the 55-element
    unit is padded by us, and FSDP2 pads the 5-row layer's dim 0)."""
    for rank in results(CROSS_CHECK):
        assert_same(rank["torch ddp"], single_process())
        assert_same(rank["fsdp2"], rank["torch ddp"])
        for stage in zero.ZERO_STAGES:
            assert_same(rank[stage, "torch"]["parameters"], rank["fsdp2"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_per_rank_is_the_papers_formula_plus_padding_and_one_unit(world_size):
    psi = sum(UNITS)
    for rank in results(world_size):
        for stage in zero.ZERO_STAGES:
            got = rank[stage, "torch"]
            assert got["unit_sizes"] == UNITS
            peak = {part: got["peak"][part] for part in zero.PARTS}
            assert peak == zero.expected_bytes(UNITS, world_size, stage, F64), (stage, got["peak"])
            # the paper's formula (8-byte elements here, so K = 2 moments x 8 bytes) on the
            # padded count Psi', plus one unit in flight: its gradient at stages 2 and 3, and
            # its gathered parameters at stage 3
            padded = sum(padded_size(n, world_size) for n in UNITS)
            assert padded - psi <= len(UNITS) * (world_size - 1)
            paper = zero.paper_bytes(padded, world_size, stage, k=2 * F64, param_bytes=F64,
                                     grad_bytes=F64)  # fmt: skip
            largest = max(padded_size(n, world_size) for n in UNITS) * F64
            paper["parameters"] += largest if stage == 3 else 0
            paper["gradients"] += largest if stage >= 2 else 0
            assert peak == paper, (stage, peak, paper)
            if world_size == 1 and stage <= 1:
                assert peak == zero.paper_bytes(psi, 1, stage, 2 * F64, F64, F64)  # no padding
        # between steps (no unit in flight) every stage holds less than the one before; at
        # the peak, one unit in flight can cost more than a stage saves when a unit is a large
        # share of the model (here 80 of 153 parameters: at 2 ranks stage 3 peaks above stage 1)
        settled = [
            sum(got["samples"][-1][part] for part in zero.PARTS)
            for got in (rank[stage, "torch"] for stage in zero.ZERO_STAGES)
        ]
        assert all(got["samples"][-1]["where"] == "after step" for got in rank.values()
                   if isinstance(got, dict) and "samples" in got)  # fmt: skip
        if world_size > 1:
            assert settled == sorted(settled, reverse=True) and len(set(settled)) == 4, settled
    for rank in results(world_size):
        assert rank["storage after step"] == [0] * len(UNITS) * 2


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bytes_through_the_collectives(world_size):
    """Stages 0-2 move the model twice per step (all-reduce, or reduce-scatter + all-gather),
    stage 3 three times (two all-gathers and a reduce-scatter): 1.5x. Counted twice: the bytes
    handed to the collectives, and the bytes chapter 2's ring actually sent."""
    padded = sum(padded_size(n, world_size) for n in UNITS) * F64
    for rank in results(world_size):
        for path in ("torch", "dmlbook"):
            passed = [rank[stage, path]["passed_bytes"] for stage in zero.ZERO_STAGES]
            assert passed[0] == {"all_reduce": padded, "reduce_scatter": 0, "all_gather": 0}
            for stage in (1, 2):
                assert passed[stage] == {"all_reduce": 0, "reduce_scatter": padded,
                                         "all_gather": padded}  # fmt: skip
            assert passed[3] == {"all_reduce": 0, "reduce_scatter": padded,
                                 "all_gather": 2 * padded}  # fmt: skip
        for stage in zero.ZERO_STAGES:
            sent = rank[stage, "dmlbook"]["sent_bytes"]
            assert sent == zero.comm_bytes_per_step(padded // F64, world_size, stage, F64)
        if world_size > 1:
            assert rank[3, "dmlbook"]["sent_bytes"] == 1.5 * rank[1, "dmlbook"]["sent_bytes"]


def _adam_on_slices_and_torch_adam():
    g = torch.Generator().manual_seed(5)
    param = torch.randn(11, dtype=torch.float64, generator=g)
    ours, theirs = param.clone(), torch.nn.Parameter(param.clone())
    optimizer = torch.optim.Adam([theirs], lr=0.1, weight_decay=0.01)
    moments = torch.zeros(11, dtype=torch.float64), torch.zeros(11, dtype=torch.float64)
    for step in range(1, 6):
        grad = torch.randn(11, dtype=torch.float64, generator=g)
        theirs.grad = grad.clone()
        optimizer.step()
        for part in (slice(0, 4), slice(4, 11)):
            adam_update_(ours[part], grad[part], moments[0][part], moments[1][part], step,
                              0.1, 0.9, 0.999, 1e-8, weight_decay=0.01)  # fmt: skip
    return ours, theirs.detach()


def test_adam_step_on_slices_equals_torch_adam():
    """Adam is elementwise: stepping two slices separately equals torch.optim.Adam on the whole
    (run on the ranks, where torch.optim is imported anyway)."""
    ours, theirs = results(CROSS_CHECK)[0]["adam"]
    torch.testing.assert_close(ours, theirs, **TOL)


def test_bad_input_raises_valueerror():
    for world_size in (2, 3):  # a different model on rank 0: every rank refuses, none hangs
        for rank in results(world_size):
            assert "ranks passed different models" in rank["errors"]["different models"]
    errors = results(2)[0]["errors"]
    assert set(errors) == {"stage 4", "stage -1", "stage True", "collectives", "lr", "unit",
                           "different models"}  # fmt: skip
    assert "stage must be one of (0, 1, 2, 3)" in errors["stage 4"]
    assert "nccl" in errors["collectives"]
    for bad in (zero.paper_bytes, zero.comm_bytes_per_step):
        with pytest.raises(ValueError, match="stage"):
            bad(10, 2, 5)
    with pytest.raises(ValueError, match="stage"):
        zero.expected_bytes([10], 2, 7)
    with pytest.raises(ValueError, match="nothing measured"):
        _ = zero.MemoryMeter().peak


@pytest.mark.gpu
def test_every_stage_on_a_gpu_equals_single_process():
    """One GPU, no process group (world size 1): the flat buffers, hooks and freed storages work
    on CUDA tensors too. GPU and CPU matmuls round differently, hence the looser tolerance."""
    want = single_process()
    for stage in zero.ZERO_STAGES:
        engine = zero.zero_data_parallel(make_model().cuda(), stage, lr=LR)
        for x, y in batches():
            engine.zero_grad()
            torch.nn.functional.cross_entropy(engine(x.cuda()), y.cuda()).backward()
            engine.step()
        got = {name: p.cpu() for name, p in engine.full_parameters().items()}
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-9, msg=name)


def test_flat_buffer_makes_the_parameters_views_of_one_padded_buffer():
    unit = torch.nn.Linear(3, 2)
    weight, bias = unit.weight.detach().clone(), unit.bias.detach().clone()
    flat = zero.flat_buffer(list(unit.parameters()), world_size=3)
    assert flat.numel() == padded_size(8, 3) == 9
    assert torch.equal(flat, torch.cat([weight.reshape(-1), bias, torch.zeros(1)]))
    assert torch.equal(unit.weight, weight) and torch.equal(unit.bias, bias)
    with torch.no_grad():
        flat[0] = 7.0  # the parameter reads the buffer
    assert unit.weight[0, 0] == 7.0
    flat.untyped_storage().resize_(0)  # stage 3's free: the views have no bytes behind them
    assert unit.weight.untyped_storage().nbytes() == 0
