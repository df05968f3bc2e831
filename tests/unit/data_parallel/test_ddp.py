"""Chapter 3's DDP: BucketedDDP and NaiveDDP equal torch's DDP and single-process training.

One launch per world size runs every check (each launch costs seconds here); the tests below
read its results. Tolerance for float32 parameters: rtol = atol = 1e-6 (the sums over ranks and
samples are taken in a different order, nothing else differs).
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dmlbook import data_parallel as dp
from dmlbook.comm import compression
from dmlbook.datasets import make_classification
from dmlbook.launch import run
from dmlbook.models import accuracy, char_gpt, cnn, mlp

WORLD_SIZES = [1, 2, 3, 4]
TOL = dict(rtol=1e-6, atol=1e-6)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
MICRO_BATCHES = 3  # gradient accumulation: micro-batches per optimizer step


# --------------------------------------------------------------------------- models and data


def _classify(model, x, y):
    return F.cross_entropy(model(x), y)


def _next_char(model, idx, targets):
    return model(idx, targets)[1]


# name -> (build the model, make a global batch from a seed, loss, bucket cap in MiB)
MODELS = {
    "mlp": (
        lambda: mlp(seed=0, in_features=12, hidden=(16, 16), out_features=3),
        lambda s: make_classification(GLOBAL_BATCH, dim=12, classes=3, seed=s),
        _classify,
        0.001,  # 2 buckets
    ),
    "cnn": (
        lambda: cnn(seed=0, classes=3, width=4),
        lambda s: make_classification(GLOBAL_BATCH, dim=64, classes=3, seed=s),
        _classify,
        0.0015,  # 2 buckets
    ),
    "gpt": (
        lambda: char_gpt(16, seed=0, block_size=8, n_layer=2, n_head=2, n_embd=16),
        lambda s: tuple(torch.randint(16, (2, GLOBAL_BATCH, 8), generator=_gen(s))),
        _next_char,
        0.004,  # 7 buckets
    ),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _batches(name, steps, first_seed=100):
    return [MODELS[name][1](first_seed + s) for s in range(steps)]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(model, loss_fn, batches, rank=0, world=1):
    """SGD with momentum; each rank takes every world-th sample of each global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in batches:
        loss = loss_fn(model, x[rank::world], y[rank::world])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # a DDP wrapper averages the gradients here
        opt.step()


def _train_accumulating(model, loss_fn, batches, rank, world):
    """Each batch in MICRO_BATCHES micro-batches: all but the last under no_sync."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        pieces = zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES), strict=True)
        micro = [(xm[rank::world], ym[rank::world]) for xm, ym in pieces]
        with model.no_sync():
            for xm, ym in micro[:-1]:
                (loss_fn(model, xm, ym) / MICRO_BATCHES).backward()  # local only
        xm, ym = micro[-1]
        (loss_fn(model, xm, ym) / MICRO_BATCHES).backward()  # averages the accumulated .grad
        opt.step()


class Branchy(nn.Module):
    """A trunk and two heads; ``head_b`` (defined between the others) takes part on request."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head_b = nn.Linear(8, 3)
        self.head_a = nn.Linear(8, 3)

    def forward(self, x, use_b):
        h = torch.relu(self.trunk(x))  # (N, 8)
        return self.head_a(h) + self.head_b(h) if use_b else self.head_a(h)  # (N, 3)


def _branchy():
    torch.manual_seed(0)
    return Branchy()


def _uses_b(step, rank):
    # step 0: nobody; 1: rank 0 only; 2: odd ranks only (nobody at world size 1); 3: everyone
    return [False, rank == 0, rank % 2 == 1, True][step]


def _train_branchy(model, rank, world):
    """Returns the parameters, and after each backward which parameters have no .grad."""
    x, y = make_classification(4 * GLOBAL_BATCH, dim=6, classes=3, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    no_grad = []
    for step in range(4):
        part = slice(step * GLOBAL_BATCH + rank, (step + 1) * GLOBAL_BATCH, world)
        loss = F.cross_entropy(model(x[part], _uses_b(step, rank)), y[part])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        no_grad.append([p.grad is None for p in model.parameters()])
        opt.step()
    return _params(model), no_grad


class Boom(torch.autograd.Function):
    """Identity in forward; in backward, raises while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if Boom.armed:
            raise ValueError("boom")
        return grad


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.last(Boom.apply(self.first(x)))


def _fragile():
    torch.manual_seed(0)
    return Fragile()


def _test_set():
    return make_classification(37, dim=12, classes=3, seed=11, noise=3.0)  # 37: a prime


def _train_settings():
    return dict(
        global_batch=GLOBAL_BATCH,
        lr=dp.warmup(dp.linear_scaling(0.05, 4, GLOBAL_BATCH), 4),
        epochs=2,
        seed=5,
        momentum=MOMENTUM,
        eval_every=3,
    )


# --------------------------------------------------------------------------- on every rank


def _on_rank():
    torch.set_num_threads(1)  # tiny models: extra threads only spin when the machine is busy
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # 1. Every model under each DDP, several buckets each.
    for name, (build, _, loss_fn, cap) in MODELS.items():
        batches = _batches(name, STEPS)
        for impl, wrap in {
            "bucketed": lambda m, cap=cap: dp.BucketedDDP(m, bucket_cap_mb=cap),
            "hook": lambda m, cap=cap: dp.BucketedDDP(m, bucket_cap_mb=cap),
            "naive": dp.NaiveDDP,
            "torch": lambda m, cap=cap: TorchDDP(m, bucket_cap_mb=cap),
        }.items():
            model = build()
            ddp = wrap(model)
            if impl == "hook":  # the default average, as a communication hook
                ddp.register_comm_hook(compression.CompressionState(), compression.allreduce_hook)
            _train(ddp, loss_fn, batches, rank, world)
            out[name, impl] = _params(model)
            if impl == "bucketed":
                out[name, "buckets"] = len(ddp._buckets)
                out[name, "stats"] = ddp.stats
            del ddp  # before the process group goes away (pytorch#56297)
    # 2. Gradient accumulation with no_sync.
    build, _, loss_fn, cap = MODELS["mlp"]
    batches = [make_classification(3 * GLOBAL_BATCH, dim=12, classes=3, seed=s) for s in (1, 2)]
    for impl, wrap in {
        "bucketed": lambda m: dp.BucketedDDP(m, bucket_cap_mb=cap),
        "naive": dp.NaiveDDP,
        "torch": TorchDDP,
    }.items():
        model = build()
        ddp = wrap(model)
        _train_accumulating(ddp, loss_fn, batches, rank, world)
        out["accumulate", impl] = _params(model)
        if impl != "torch":
            out["accumulate", impl, "stats"] = ddp.stats
        del ddp
    # 3. Parameters that sit out some steps, and the error when that is not allowed.
    for impl, wrap in {
        "bucketed": lambda m: dp.BucketedDDP(m, bucket_cap_mb=0.0002, find_unused_parameters=True),
        "naive": lambda m: dp.NaiveDDP(m, find_unused_parameters=True),
        "torch": lambda m: TorchDDP(m, find_unused_parameters=True),
    }.items():
        ddp = wrap(_branchy())
        out["unused", impl] = _train_branchy(ddp, rank, world)
        del ddp
    x, y = make_classification(GLOBAL_BATCH, dim=6, classes=3, seed=7)
    for impl, wrap in {
        "bucketed": lambda m: dp.BucketedDDP(m, 0.0001),
        "naive": dp.NaiveDDP,
    }.items():
        ddp = wrap(_branchy())
        try:
            F.cross_entropy(ddp(x, use_b=False), y).backward()
        except RuntimeError as e:
            out["unused error", impl] = str(e)
        one = torch.ones(1)
        dist.all_reduce(one)  # the group still works: no rank is left inside a collective
        out["unused error", impl, "group ok"] = one.item() == world
        del ddp
    # 4. Sharded evaluation, and the training loop with a DDP wrapper.
    x_test, y_test = _test_set()
    out["sharded accuracy"] = dp.sharded_accuracy(MODELS["mlp"][0](), x_test, y_test)
    x, y = make_classification(10 * GLOBAL_BATCH, dim=12, classes=3, seed=3)
    for impl, wrap in {"bucketed": dp.BucketedDDP, "naive": dp.NaiveDDP, "torch": TorchDDP}.items():
        model = MODELS["mlp"][0]()
        ddp = wrap(model)
        config = dp.TrainConfig(progress=impl == "bucketed", **_train_settings())
        history = dp.train(ddp, x, y, config, test=_test_set())
        out["train", impl] = (_params(model), history)
        if impl == "bucketed":
            try:
                dp.train(
                    ddp, x, y, dp.TrainConfig(global_batch=12, lr=0.1), sync=dp.GradientAveraging()
                )
            except ValueError as e:
                out["train", "sync error"] = str(e)
        del ddp
    # 5. A backward that fails half-way, after a bucket was launched, leaves no trace.
    x, y = make_classification(GLOBAL_BATCH, dim=4, classes=2, seed=rank)
    plain = _fragile()
    F.cross_entropy(plain(x), y).backward()
    for p in plain.parameters():
        dist.all_reduce(p.grad)  # the average, the hard way
        p.grad /= world
    ddp = dp.BucketedDDP(_fragile(), bucket_cap_mb=0)  # one bucket per tensor
    Boom.armed = True
    try:
        F.cross_entropy(ddp(x), y).backward()  # last's buckets launch, then first's never do
    except ValueError:
        out["after failure", "launched"] = ddp.stats.collectives
    Boom.armed = False
    ddp.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()
    out["after failure"] = [p.grad for p in ddp.parameters()], [p.grad for p in plain.parameters()]
    del ddp
    # 6. torch's fp16 compression hook, on ours and on torch's DDP, over the MLP's 2 buckets.
    build, _, loss_fn, cap = MODELS["mlp"]
    batches = _batches("mlp", STEPS)
    for impl, wrap in {"bucketed": dp.BucketedDDP, "torch": TorchDDP}.items():
        model = build()
        position = {p: i for i, p in enumerate(model.parameters())}
        seen = []

        def recording_fp16_hook(state, bucket, seen=seen, position=position):
            grads, params = bucket.gradients(), bucket.parameters()
            shapes = all(g.shape == p.shape for g, p in zip(grads, params, strict=True))
            seen.append((bucket.index(), bucket.is_last(), [position[p] for p in params], shapes))
            return fp16_compress_hook(state, bucket)

        ddp = wrap(model, bucket_cap_mb=cap)
        ddp.register_comm_hook(None, recording_fp16_hook)
        # torch lays its buckets out in definition order in its first backward, then re-buckets
        # in the order the gradients arrived: the reverse, as ours. From 3 ranks on, fp16 sums
        # taken in another order round differently, so one backward (gradients dropped) first.
        loss_fn(ddp, *batches[0]).backward()
        model.zero_grad(set_to_none=True)
        seen.clear()
        _train(ddp, loss_fn, batches, rank, world)
        out["fp16", impl] = _params(model), seen
        del ddp
    return out


# --------------------------------------------------------------------------- in this process

_LAUNCHES: dict[int, tuple[list[dict], str]] = {}


def launched(world_size):
    """The ranks' results at ``world_size`` and what they printed on stderr (one launch each)."""
    if world_size not in _LAUNCHES:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            results = run(_on_rank, world_size, timeout=90)
        _LAUNCHES[world_size] = results, err.getvalue()
    return _LAUNCHES[world_size]


@pytest.fixture(scope="module")
def single_process():
    """Every reference, trained in this process on the whole global batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    ref = {}
    for name, (build, _, loss_fn, _) in MODELS.items():
        model = build()
        _train(model, loss_fn, _batches(name, STEPS))
        ref[name] = _params(model)
    build, _, loss_fn, _ = MODELS["mlp"]
    model = build()
    batches = [make_classification(3 * GLOBAL_BATCH, dim=12, classes=3, seed=s) for s in (1, 2)]
    _train(model, loss_fn, batches)  # one batch of 36 = the union of the micro-batches
    ref["accumulate"] = _params(model)
    ref["accuracy"] = accuracy(build(), *_test_set())
    model = build()
    x, y = make_classification(10 * GLOBAL_BATCH, dim=12, classes=3, seed=3)
    history = dp.train(model, x, y, dp.TrainConfig(**_train_settings()), test=_test_set())
    ref["train"] = (_params(model), history)
    torch.set_num_threads(threads)
    return ref


def _assert_close(ours, theirs, **tol):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_bucketed_and_naive_equal_torch_ddp_and_single_process(world_size, name, single_process):
    results, _ = launched(world_size)
    ours = results[0]
    for r in results:  # the ranks agree bit for bit
        _assert_close(r[name, "bucketed"], ours[name, "bucketed"], rtol=0, atol=0)
    _assert_close(ours[name, "bucketed"], ours[name, "torch"])
    _assert_close(ours[name, "naive"], ours[name, "torch"])
    _assert_close(ours[name, "hook"], ours[name, "torch"])
    _assert_close(ours[name, "bucketed"], single_process[name])
    buckets = ours[name, "buckets"]
    assert buckets >= 2
    stats = ours[name, "stats"]
    assert (stats.syncs, stats.collectives) == (STEPS, STEPS * buckets)
    assert stats.bytes == STEPS * 4 * sum(p.numel() for p in single_process[name])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_sync_accumulation_equals_single_process_on_the_union(world_size, single_process):
    ours = launched(world_size)[0][0]
    for impl in ("bucketed", "naive", "torch"):
        _assert_close(ours["accumulate", impl], single_process["accumulate"])
    _assert_close(ours["accumulate", "bucketed"], ours["accumulate", "torch"])
    # Communication only in the last backward of each step: never under no_sync.
    buckets = ours["mlp", "buckets"]
    assert ours["accumulate", "bucketed", "stats"].syncs == 2
    assert ours["accumulate", "bucketed", "stats"].collectives == 2 * buckets
    assert ours["accumulate", "naive", "stats"].collectives == 2 * 6  # 6 parameters


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_find_unused_parameters_matches_torch(world_size):
    results, _ = launched(world_size)
    for r in results:
        theirs_params, theirs_no_grad = r["unused", "torch"]
        for impl in ("bucketed", "naive"):
            params, no_grad = r["unused", impl]
            _assert_close(params, theirs_params)
            assert no_grad == theirs_no_grad  # .grad stays None where no rank used it
    no_grad = results[0]["unused", "bucketed"][1]
    head_b = [2, 3]  # head_b.weight, head_b.bias
    assert all(no_grad[0][i] for i in head_b)  # step 0: no rank used head_b
    assert not any(no_grad[1][i] for i in head_b)  # step 1: rank 0 did, so every rank averages


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unused_parameter_without_find_unused_is_a_clear_error(world_size):
    for r in launched(world_size)[0]:
        for impl in ("bucketed", "naive"):
            message = r["unused error", impl]
            assert "head_b.weight, head_b.bias" in message
            assert "find_unused_parameters=True" in message
            assert r["unused error", impl, "group ok"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_evaluation_and_train_loop(world_size, single_process):
    results, stderr = launched(world_size)
    ref_params, ref_history = single_process["train"]
    for r in results:
        assert r["sharded accuracy"] == single_process["accuracy"]  # exact: 37 samples
        for impl in ("bucketed", "naive", "torch"):
            params, history = r["train", impl]
            _assert_close(params, ref_params)
            assert history.lr == ref_history.lr  # linear scaling with warm-up
            assert history.eval_steps == ref_history.eval_steps == [3, 6, 9, 12, 15, 18]
            assert history.accuracy == ref_history.accuracy
        assert "pass no sync" in r["train", "sync error"]
    bars = [line for line in stderr.split("\n") if "train: 100%" in line]  # tqdm writes \r too
    assert bars and all(line.startswith("[rank 0]") for line in bars)  # a bar on rank 0 only


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_fp16_compress_hook_runs_on_bucketed_ddp(world_size, single_process):
    ours = launched(world_size)[0][0]
    (params, seen), (theirs, theirs_seen) = ours["fp16", "bucketed"], ours["fp16", "torch"]
    _assert_close(params, theirs)
    pairs = zip(params, single_process["mlp"], strict=True)
    assert max((a - b).abs().max() for a, b in pairs) > 0  # fp16 rounding shows: the hook ran
    # Our GradBucket tells the hook what torch's does: index, is_last, parameters, gradients.
    buckets = [(0, False, [5, 4, 3, 2], True), (1, True, [1, 0], True)]
    assert seen == theirs_seen == buckets * STEPS


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_backward_that_failed_half_way_leaves_no_trace(world_size):
    for r in launched(world_size)[0]:
        assert r["after failure", "launched"] == 2  # last.bias, last.weight
        ours, expected = r["after failure"]
        _assert_close(ours, expected)


def test_assign_buckets_last_parameter_first():
    params = [torch.zeros(n) for n in (10, 20, 30, 40, 100)]  # 40, 80, 120, 160, 400 bytes
    # a bucket closes once it holds 300 bytes or more, as torch's do
    assert dp.assign_buckets(params, 300) == [[4], [3, 2, 1], [0]]
    assert dp.assign_buckets(params, 10**6) == [[4, 3, 2, 1, 0]]
    assert dp.assign_buckets(params, 1) == [[4], [3], [2], [1], [0]]
    mixed = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4)]
    assert dp.assign_buckets(mixed, 10**6) == [[2], [1], [0]]  # one dtype per bucket


def test_ddp_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group"):
        dp.BucketedDDP(nn.Linear(2, 2))
