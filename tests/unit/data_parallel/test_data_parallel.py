"""Chapter 1's data parallelism equals single-process SGD on the global batch, and torch's DDP."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dmlbook import data_parallel as dp
from dmlbook.datasets import make_classification, shard_indices
from dmlbook.launch import run
from dmlbook.models import mlp

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4
SETTINGS = dict(global_batch=GLOBAL_BATCH, lr=0.2, epochs=2, seed=3)
TOL = dict(rtol=1e-5, atol=1e-6)  # float32; the sums are merely taken in a different order


def _data():
    return make_classification(240, dim=12, classes=3, seed=1)


def _model():
    return mlp(seed=0, in_features=12, hidden=(16,), out_features=3)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_with_torch_ddp(x, y):
    """The same loop as dp.train, with torch's DDP doing the gradient averaging."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=SETTINGS["lr"])
    local = GLOBAL_BATCH // world
    for epoch in range(SETTINGS["epochs"]):
        shard = shard_indices(len(x), rank, world, seed=SETTINGS["seed"], epoch=epoch)
        for t in range(len(x) // GLOBAL_BATCH):
            idx = shard[t * local : (t + 1) * local]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()  # DDP all-reduces (averages) the gradients in buckets here
            opt.step()
    state = _snapshot(model.module)
    del model, opt  # free DDP before the group goes away (pytorch#56297)
    return state


def all_variants():
    x, y = _data()
    out = {}
    model = _model()
    dp.train(model, x, y, dp.TrainConfig(**SETTINGS), sync=dp.GradientAveraging())
    out["ours"] = _snapshot(model)
    out["ddp"] = _train_with_torch_ddp(x, y)
    model = _model()
    dp.train(model, x, y, dp.TrainConfig(**SETTINGS), sync=dp.ModelAveraging(every=1))
    out["avg1"] = _snapshot(model)
    model, sync = _model(), dp.ModelAveraging(every=4)
    dp.train(model, x, y, dp.TrainConfig(**SETTINGS), sync=sync)
    out["avg4"], out["avg4_rounds"] = _snapshot(model), sync.rounds
    try:
        dp.train(_model(), x, y, dp.TrainConfig(global_batch=GLOBAL_BATCH + 1, lr=0.1))
    except ValueError as e:
        out["indivisible"] = str(e)
    return out


@pytest.fixture(scope="module")
def reference():
    x, y = _data()
    model = _model()
    dp.train(model, x, y, dp.TrainConfig(**SETTINGS))  # no process group: plain single-process SGD
    return _snapshot(model)


def _assert_same(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_data_parallel_equals_single_process_and_ddp(world_size, reference):
    results = run(all_variants, world_size, timeout=90)
    for r in results:  # every rank ends with the same model
        _assert_same(r["ours"], results[0]["ours"], rtol=0, atol=0)
        _assert_same(r["avg4"], results[0]["avg4"], rtol=0, atol=0)
    ours = results[0]
    _assert_same(ours["ours"], reference, **TOL)
    _assert_same(ours["ddp"], reference, **TOL)
    _assert_same(ours["ours"], ours["ddp"], **TOL)
    # with plain SGD, averaging the models after every step is averaging the gradients
    _assert_same(ours["avg1"], ours["ours"], **TOL)
    steps = SETTINGS["epochs"] * (240 // GLOBAL_BATCH)  # 20 steps: 5 averages of 4 steps
    assert ours["avg4_rounds"] == (steps // 4 if world_size > 1 else 0)
    if world_size > 1:
        assert "multiple of the world size" in ours["indivisible"]
        # local SGD drifts from synchronous SGD between averages: not the same model
        diff = max((ours["avg4"][k] - reference[k]).abs().max().item() for k in reference)
        assert diff > 1e-4


def test_model_averaging_rejects_bad_period():
    with pytest.raises(ValueError, match="every"):
        dp.ModelAveraging(every=0)


def test_bad_global_batch_single_process():
    x, y = _data()
    with pytest.raises(ValueError, match="larger than"):
        dp.train(_model(), x, y, dp.TrainConfig(global_batch=1000, lr=0.1))
    with pytest.raises(ValueError, match="positive multiple"):
        dp.train(_model(), x, y, dp.TrainConfig(global_batch=0, lr=0.1))


def test_linear_scaling_rule():
    assert dp.linear_scaling(0.1, 256, 8192) == pytest.approx(3.2)
    assert dp.linear_scaling(0.1, 256, 128) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        dp.linear_scaling(0.1, 0, 128)


def test_warmup_matches_torch_linear_lr():
    peak, steps = 0.8, 5
    ours = dp.warmup(peak, steps)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    sched = torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / steps, end_factor=1.0, total_iters=steps - 1
    )
    for step in range(12):
        assert ours(step) == pytest.approx(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert ours(0) == pytest.approx(peak / steps) and ours(100) == pytest.approx(peak)
    with pytest.raises(ValueError):
        dp.warmup(peak, 0)


def test_lr_schedule_is_applied_per_step():
    x, y = _data()
    history = dp.train(
        _model(), x, y, dp.TrainConfig(global_batch=24, lr=dp.warmup(0.4, 4), epochs=1)
    )
    assert history.lr[:5] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    assert len(history.loss) == 10


def train_on_device():
    from dmlbook.comm.groups import device

    x, y = _data()
    model = _model().to(device())
    dp.train(model, x.to(device()), y.to(device()), dp.TrainConfig(**SETTINGS))
    return {k: v.cpu() for k, v in _snapshot(model).items()}


@pytest.mark.gpu
def test_data_parallel_on_gpus_equals_cpu_reference(reference):
    results = run(train_on_device, torch.cuda.device_count(), timeout=120)
    for state in results:
        _assert_same(state, reference, rtol=1e-4, atol=1e-5)
