"""Chapter 2's parameter server: sync equals single-process SGD and DDP; async and bounded
staleness converge and respect their bound; shards balance; bytes are counted exactly; a dead
worker ends the run with a clear error and leaves the server with whole updates only."""

import dataclasses
import functools
import math
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dmlbook import data_parallel as dp
from dmlbook.data_parallel import ps
from dmlbook.datasets import load_digits, make_classification, shard_indices
from dmlbook.launch import RankError, run
from dmlbook.models import accuracy, mlp
from dmlbook.runtime import errors as runtime_errors

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4 workers
SETTINGS = dict(global_batch=GLOBAL_BATCH, lr=0.2, epochs=2, seed=3)
STEPS = 2 * (240 // GLOBAL_BATCH)
TOL = dict(rtol=1e-5, atol=1e-6)  # float32; the same sums, taken in a different order
HEADER, REPLY_HEADER = 24, 16  # bytes of a request [kind, clock, version], of a reply header


def _data():
    return make_classification(240, dim=12, classes=3, seed=1)


def _model():
    return mlp(seed=0, in_features=12, hidden=(16,), out_features=3)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


def _sgd_steps(steps):
    """Single-process SGD on the global batch, the first ``steps`` steps of epoch 0."""
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=SETTINGS["lr"])
    order = shard_indices(len(x), 0, 1, seed=SETTINGS["seed"], epoch=0)
    for t in range(steps):
        idx = order[t * GLOBAL_BATCH : (t + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return _state(model)


@pytest.fixture(scope="module")
def reference():
    x, y = _data()
    model = _model()
    dp.train(model, x, y, dp.TrainConfig(**SETTINGS))  # no process group: plain single-process SGD
    return _state(model)


def _ddp_on(worker_ranks):
    """Train the same model with torch's DDP on ``worker_ranks``; every rank must call this."""
    group = dist.new_group(ranks=worker_ranks)
    rank = dist.get_rank()
    if rank not in worker_ranks:
        return None
    x, y = _data()
    me, world = worker_ranks.index(rank), len(worker_ranks)
    model = DDP(_model(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=SETTINGS["lr"])
    local = GLOBAL_BATCH // world
    for epoch in range(SETTINGS["epochs"]):
        shard = shard_indices(len(x), me, world, seed=SETTINGS["seed"], epoch=epoch)
        for t in range(len(x) // GLOBAL_BATCH):
            idx = shard[t * local : (t + 1) * local]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    state = _state(model.module)
    del model, opt  # free DDP before the group goes away (pytorch#56297)
    return state


def sync_runs(layouts):
    """Synchronous PS training for each (servers, sharding), and DDP on each set of workers."""
    x, y = _data()
    world = dist.get_world_size()
    out = {}
    for servers, sharding in layouts:
        config = ps.PSConfig(servers=servers, sharding=sharding, **SETTINGS)
        out[servers, sharding] = ps.train_parameter_server(_model, x, y, config)
    for servers in sorted({s for s, _ in layouts}):
        out["ddp", servers] = _ddp_on(list(range(servers, world)))
    return out


def _results(per_rank, key):
    return [r[key] for r in per_rank]


def _check_traffic(results, servers, workers):
    """Every byte accounted for: payloads and headers, per rank, in a synchronous run."""
    numel = sum(p.numel() for p in _model().parameters())
    for r in results[:servers]:
        shard_bytes = 4 * sum(b - a for a, b in r.ranges)
        assert r.traffic.payload_received == STEPS * workers * shard_bytes  # W shards per step
        assert r.traffic.payload_sent == STEPS * workers * shard_bytes
        assert r.traffic.header_received == workers * (2 * STEPS + 1) * HEADER  # pull, push; done
        assert r.traffic.header_sent == workers * STEPS * REPLY_HEADER
        assert r.traffic.received == r.traffic.payload_received + r.traffic.header_received
    for r in results[servers:]:
        assert r.traffic.payload_sent == r.traffic.payload_received == STEPS * 4 * numel
        assert r.traffic.header_sent == servers * (2 * STEPS + 1) * HEADER
        assert r.traffic.header_received == servers * STEPS * REPLY_HEADER
    paper = ps.bytes_per_step(4 * numel, servers, workers)
    assert results[-1].traffic.payload_sent / STEPS == paper["worker_sent"]
    for r in results[:servers]:  # flat shards differ by at most one element
        per_step = r.traffic.payload_received / STEPS
        assert abs(per_step - paper["server_received"]) <= 4 * workers


LAYOUTS = {  # world size -> (servers, sharding) runs; workers are the other ranks
    2: [(1, "flat")],  # (S, W) = (1, 1)
    3: [(1, "flat"), (2, "flat"), (2, "tensor")],  # (1, 2), (2, 1)
    5: [(2, "flat"), (1, "flat"), (3, "tensor")],  # (2, 3), (1, 4), (3, 2)
}


def all_checks(world):
    """Everything one launch checks; the world of 3 also runs the digits and the bad arguments."""
    out = {"sync": sync_runs(LAYOUTS[world])}
    if world == 3:
        out["digits"] = digits_runs(straggler_delay=0.01)
        out["bad"] = bad_arguments()
    return out


@functools.cache
def _launch(world):
    """One launch per world size, shared by the tests that read it (each launch costs seconds)."""
    return run(all_checks, world, world, timeout=60)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_sync_equals_single_process_and_ddp(world, reference):
    per_rank = [r["sync"] for r in _launch(world)]
    for servers, sharding in LAYOUTS[world]:
        workers = world - servers
        results = _results(per_rank, (servers, sharding))
        model = ps.assemble_model(_model(), results)
        _assert_same(_state(model), reference, **TOL)
        _assert_same(per_rank[servers]["ddp", servers], reference, **TOL)
        for r in results[:servers]:
            assert isinstance(r, ps.ServerResult) and r.updates == STEPS
            assert set(r.staleness) == {0} and set(r.clock_gap) == {0}
        for i, r in enumerate(results[servers:]):
            assert isinstance(r, ps.WorkerResult) and (r.worker, r.steps) == (i, STEPS)
        if sharding == "flat":
            _check_traffic(results, servers, workers)


def test_assign_shards_balances_load():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [
            rng.choice([1, 10, 100, 1000]) * rng.randint(1, 9) for _ in range(rng.randint(1, 12))
        ]
        servers = rng.randint(1, 6)
        owner = ps.assign_shards(sizes, servers)
        load = [sum(n for n, s in zip(sizes, owner, strict=True) if s == k) for k in range(servers)]
        assert sum(load) == sum(sizes) and all(0 <= s < servers for s in owner)
        assert max(load) <= sum(sizes) / servers + max(sizes)  # greedy's guarantee
    sizes = [p.numel() for p in mlp().parameters()]  # [8192, 128, 1280, 10]: one layer dominates
    assert ps.assign_shards(sizes, 2) == [0, 1, 1, 1]
    flat = ps.shard_ranges(sizes, 2)
    assert flat == [[(0, 4805)], [(4805, 9610)]]  # the flat split balances to one element
    assert ps.shard_ranges(sizes, 2, "tensor") == [
        [(0, 8192)],
        [(8192, 8320), (8320, 9600), (9600, 9610)],
    ]
    with pytest.raises(ValueError, match="servers"):
        ps.assign_shards(sizes, 0)
    with pytest.raises(ValueError, match="sharding"):
        ps.shard_ranges(sizes, 2, "rows")


def digits_runs(straggler_delay):
    """One server, one slow worker and the rest fast: async, then bounded staleness 2 and 0."""
    x, y = load_digits("train")
    workers = dist.get_world_size() - 1
    delay = [straggler_delay] + [0.0] * (workers - 1)
    common = dict(servers=1, global_batch=48, lr=0.5, epochs=2)
    config = lambda consistency: ps.PSConfig(consistency=consistency, **common)  # noqa: E731
    return {
        "async": ps.train_parameter_server(mlp, x, y, config(ps.Asynchronous()), delay=delay),
        "ssp2": ps.train_parameter_server(mlp, x, y, config(ps.BoundedStaleness(2)), delay=delay),
        "ssp0": ps.train_parameter_server(mlp, x, y, config(ps.BoundedStaleness(0)), delay=delay),
    }


@pytest.mark.timeout(90)
def test_async_and_bounded_staleness_converge_within_their_bound():
    per_rank = [r["digits"] for r in _launch(3)]
    x_test, y_test = load_digits("test")
    for name, bound in [("async", None), ("ssp2", 2), ("ssp0", 0)]:
        results = _results(per_rank, name)
        server, workers = results[0], results[1:]
        model = ps.assemble_model(mlp(), results)
        assert accuracy(model, x_test, y_test) > 0.85, name  # chance is 0.1
        assert server.updates == sum(w.steps for w in workers) == 2 * 2 * (1438 // 48)
        gaps = server.clock_gap + [g for w in workers for g in w.clock_gap]
        if bound is None:  # the fast worker runs far ahead of the straggler
            assert max(gaps) > 2
        else:
            assert max(gaps) <= bound
            # Between a worker's pull and its push, each other worker pushes at most 2k + 1 times.
            assert max(server.staleness) <= (2 * bound + 1) * (len(workers) - 1)
        # The server's timeline: every step of every worker, a pull, its answer and a push; the
        # fast workers' pulls held back under a bound (they wait for the straggler), none async.
        for w in workers:
            kinds = [k for v, k, _ in server.timeline if v == w.rank]
            assert [kinds.count(k) for k in ("pull", "reply", "push")] == [w.steps] * 3
        held = server.held_pulls()
        fast_held = [h for h in held if h[0] != workers[0].rank]
        assert held == [] if bound is None else len(fast_held) > 0
        assert all(seconds >= 0 for _, _, seconds in held)


def test_held_pulls_are_those_answered_after_other_requests():
    timeline = [
        (1, "pull", 0.0),
        (1, "reply", 0.001),  # answered at once
        (2, "pull", 0.002),
        (1, "push", 0.010),
        (2, "reply", 0.011),  # answered only after worker 1's push: held 9 ms
        (2, "push", 0.020),
    ]
    result = ps.ServerResult(0, [(0, 1)], torch.zeros(1), 2, [0, 0], [0, 0], ps.Traffic(), 0.0)
    result.timeline = timeline
    (held,) = result.held_pulls()
    assert held[:2] == (2, 0) and held[2] == pytest.approx(0.009)


def dying_worker(report, die_at):
    """Worker rank 2 dies (os._exit) while computing step ``die_at``; the server reports."""
    calls = 0

    def loss_fn(out, target):
        nonlocal calls
        if dist.get_rank() == 2 and calls == die_at:
            os._exit(7)
        calls += 1
        return torch.nn.functional.cross_entropy(out, target)

    x, y = _data()
    try:
        return ps.train_parameter_server(
            _model, x, y, ps.PSConfig(servers=1, **SETTINGS), loss_fn=loss_fn
        )
    except ps.WorkerLost as e:  # the server: keep what it held, for the test to inspect
        torch.save(dict(message=str(e), updates=e.updates, shard=e.shard), report + ".tmp")
        os.replace(report + ".tmp", report)
        raise


@pytest.mark.timeout(60)
def test_dead_worker_ends_the_run_and_leaves_whole_updates(tmp_path, monkeypatch):
    report, die_at = str(tmp_path / "server.pt"), 5
    # The launcher stops the other ranks FAILURE_GRACE_S after the first failure; give the server
    # ample time to write its report even on a loaded machine (the outcome does not depend on it).
    monkeypatch.setattr(runtime_errors, "FAILURE_GRACE_S", 2.0)
    start = time.monotonic()
    with pytest.raises(RankError) as failure:
        run(dying_worker, 3, report, die_at, timeout=30)
    assert failure.value.rank == 2 and failure.value.exitcode == 7  # the dead worker is named
    assert time.monotonic() - start < 15  # well before the timeout: nothing waited for it
    seen = torch.load(report)
    assert "lost worker rank 2 after 5 gradients" in seen["message"]
    # Worker 1 may have pushed step 5 already; the server applied exactly the 5 whole steps.
    assert seen["updates"] == die_at
    model = _model()
    model.load_state_dict(_sgd_steps(die_at))
    expected = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(seen["shard"], expected, **TOL)


def bad_arguments():
    """Each bad call's ValueError message, on a world of 3 ranks."""
    x, y = _data()
    one_tensor = lambda: torch.nn.Linear(12, 3, bias=False)  # noqa: E731
    cases = {
        "no servers": dict(servers=0),
        "no workers": dict(servers=3),
        "indivisible batch": dict(servers=1, global_batch=3),  # 2 workers
        "too large batch": dict(servers=1, global_batch=1000),
        "a string for consistency": dict(servers=1, consistency="ssp"),
        "a class for consistency": dict(servers=1, consistency=ps.BoundedStaleness),
        "bad delay": dict(servers=1, delay=[0.1]),
        "empty delay pattern": dict(servers=1, delay=[0.0, []]),
        "bad lr": dict(servers=1, lr=float("nan")),
        "empty server": dict(servers=2, sharding="tensor", model_fn=one_tensor),
        "buffers": dict(servers=1, model_fn=lambda: torch.nn.BatchNorm1d(12)),
        "round without workers": dict(servers=1, epochs=1, members=[[1], []]),
        "a server in a round": dict(servers=1, epochs=1, members=[[0, 2]]),
        "a worker twice": dict(servers=1, epochs=1, members=[[2, 2]]),
        "members async": dict(servers=1, epochs=1, consistency=ps.Asynchronous(), members=[[1]]),
    }
    messages = {}
    for name, kwargs in cases.items():
        args = {**SETTINGS, "model_fn": _model, **kwargs}
        options = {k: args.pop(k) for k in ("model_fn", "delay", "members") if k in args}
        try:
            ps.train_parameter_server(x=x, y=y, config=ps.PSConfig(**args), **options)
        except (TypeError, ValueError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


@pytest.mark.timeout(90)
def test_bad_arguments_are_clear_errors_on_every_rank():
    per_rank = [r["bad"] for r in _launch(3)]
    assert per_rank[0] == per_rank[1] == per_rank[2]  # every rank refuses alike: nobody waits
    expected = {
        "no servers": "ValueError: servers must be",
        "no workers": "ValueError: no workers",
        "indivisible batch": "ValueError: global_batch=3 must be a positive multiple of the 2",
        "too large batch": "ValueError: global_batch=1000 is larger than",
        "a string for consistency": "TypeError: consistency must be one of Synchronous(), "
        "BoundedStaleness(k) with k >= 0, or Asynchronous() (from dmlbook.data_parallel.ps), "
        "got 'ssp'",
        "a class for consistency": "TypeError: consistency must be one of Synchronous(), "
        "BoundedStaleness(k) with k >= 0, or Asynchronous() (from dmlbook.data_parallel.ps), "
        "got the class BoundedStaleness; create one: "
        "BoundedStaleness(k)",
        "bad delay": "ValueError: delay needs 2",
        "empty delay pattern": "ValueError: delay needs 2 entries",
        "bad lr": "ValueError: lr must be",
        "empty server": "ValueError: the 36 parameters leave a server empty",
        "buffers": "ValueError: ps.train_parameter_server serves parameters only",
        "round without workers": "ValueError: round 1 has no worker",
        "a server in a round": "ValueError: round 0 lists workers [0, 2]: each must appear once "
        "and be a worker rank in 1..2 (ranks 0..0 serve)",
        "a worker twice": "ValueError: round 0 lists workers [2, 2]",
        "members async": "ValueError: members needs consistency=Synchronous() and no epochs "
        "(got Asynchronous(), epochs=1)",
    }
    assert per_rank[0].keys() == expected.keys()
    for name, text in expected.items():
        assert text in per_rank[0][name], (name, per_rank[0][name])


def test_consistency_objects_know_their_bound_and_check_it():
    """The three consistency models: the bound the server enforces, and when it applies."""
    kinds = [ps.Synchronous(), ps.BoundedStaleness(3), ps.BoundedStaleness(0), ps.Asynchronous()]
    assert [c.bound for c in kinds] == [0, 3, 0, math.inf]
    assert [c.on_arrival for c in kinds] == [False, True, True, True]
    assert ps.BoundedStaleness(2) == ps.BoundedStaleness(bound=2) != ps.BoundedStaleness(3)
    assert ps.BoundedStaleness(0) != ps.Synchronous()  # same bound, applied differently
    with pytest.raises(dataclasses.FrozenInstanceError):
        ps.BoundedStaleness(2).bound = 5
    for bad in (1.5, True, "2", None):
        with pytest.raises(TypeError, match=r"BoundedStaleness\(k\) needs a whole number of "):
            ps.BoundedStaleness(bad)
    with pytest.raises(ValueError, match=r"needs k >= 0 steps, got -1$"):
        ps.BoundedStaleness(-1)
    with pytest.raises(TypeError):  # k is required: no silent default
        ps.BoundedStaleness()


def test_train_needs_a_process_group():
    x, y = _data()
    with pytest.raises(RuntimeError, match="launch.run"):
        ps.train_parameter_server(_model, x, y, ps.PSConfig(servers=1, **SETTINGS))


def test_assemble_model_needs_every_shard():
    shard = ps.ServerResult(0, [(0, 10)], torch.zeros(10), 0, [], [], ps.Traffic(), 0.0)
    with pytest.raises(ValueError, match="cover 10 of 259"):
        ps.assemble_model(_model(), [shard])


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_sync_on_gpus_equals_cpu_reference(reference):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a server and a worker on GPUs of their own (2 GPUs)")
    x, y = _data()
    results = run(
        ps.train_parameter_server,
        torch.cuda.device_count(),
        _model,
        x,
        y,
        ps.PSConfig(**SETTINGS),
        timeout=90,
    )
    model = ps.assemble_model(_model(), results)
    _assert_same(_state(model), reference, rtol=1e-4, atol=1e-5)
