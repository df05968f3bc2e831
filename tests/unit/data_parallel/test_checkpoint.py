"""Chapter 3's checkpoints: atomic under SIGKILL, bitwise resume after a crash, DCP resharding.

The multi-process checks share five launches (module fixture ``runs``): a crash at world size 1,
the runs after it, a crash at world size 3, a sharded save at world size 2, and the runs after
the crash at world size 3, which also load the sharded checkpoint with three ranks.
"""

import itertools
import multiprocessing
import os
import random
import shutil
import signal
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.data_parallel import checkpoint as ck
from dmlbook.datasets import make_classification
from dmlbook.launch import RankError, run
from dmlbook.models import mlp

# The module fixture's five launches count toward the time limit of the first test that uses it.
pytestmark = pytest.mark.timeout(240)

# 120 samples / global batch 24 = 5 steps an epoch, 15 in all. Checkpoints at steps 4, 8 and 12;
# the crash after step 10 is mid-epoch (epoch 1) and two steps past the latest checkpoint.
SETTINGS = dict(global_batch=24, epochs=3, every=4, seed=5)
CRASH_AT, RESUMED_FROM, TOTAL_STEPS = 10, 8, 15


def _setup():
    x, y = make_classification(120, dim=12, classes=3, seed=1)
    model = mlp(seed=0, in_features=12, hidden=(16,), out_features=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)  # state that matters
    return model, optimizer, x, y


def _state(model, optimizer):
    momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    return {k: v.clone() for k, v in model.state_dict().items()}, momentum


def _assert_equal_states(a, b):
    (params_a, momentum_a), (params_b, momentum_b) = a, b
    assert params_a.keys() == params_b.keys() and len(momentum_a) == len(momentum_b) > 0
    for k in params_a:
        assert torch.equal(params_a[k], params_b[k]), k  # bitwise
    for ma, mb in zip(momentum_a, momentum_b, strict=True):
        assert torch.equal(ma, mb)


# --------------------------------------------------------------------------- rank functions


def _crashing_run(directory, crash):
    model, optimizer, x, y = _setup()
    crash = ck.SimulateCrash(**crash)
    config = ck.ResumableConfig(checkpoint_dir=directory, **SETTINGS)
    ck.train_resumable(model, optimizer, x, y, config, callbacks=[crash])


def _train(directory, restore_rng=True):
    model, optimizer, x, y = _setup()
    config = ck.ResumableConfig(checkpoint_dir=directory, restore_rng=restore_rng, **SETTINGS)
    done = ck.train_resumable(model, optimizer, x, y, config)
    return done, _state(model, optimizer)


def _draws():
    return torch.rand(3), random.random(), random.gauss(0, 1), np.random.standard_normal(3)


def _rng_round_trip(path):
    ck.seed_all(100 + dist.get_rank())
    random.gauss(0, 1)  # draws two, returns one, caches the other: part of the state
    np.random.standard_normal(1)  # the same in NumPy
    model, optimizer, *_ = _setup()
    ck.save(path, model=model, optimizer=optimizer, progress=ck.Progress())
    before = _draws()
    ck.load(path, model=model, optimizer=optimizer)
    return before, _draws()


def _after_crash(root, other_world_checkpoint=None):
    """The uninterrupted run, the resumed one, one resumed without its RNG, and RNG checks."""
    out = {
        "uninterrupted": _train(root / "uninterrupted"),
        "resumed": _train(root / "crashed"),
        "no_rng": _train(root / "no_rng", restore_rng=False),
        "again": _train(root / "crashed"),  # finished: a new call finds nothing left to do
        "rng": _rng_round_trip(root / "rng.pt"),
    }
    if other_world_checkpoint is not None:
        model, optimizer, *_ = _setup()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = ck.load(other_world_checkpoint, model=model, optimizer=optimizer)
        out["other_world"] = loaded.rng_restored, [str(w.message) for w in caught]
    return out


def _sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = mlp(seed=0, in_features=12, hidden=(16,), out_features=3)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))  # ZeRO-3 style
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _whole(model, optimizer):
    """The full (unsharded) model and momentum tensors, and the shapes this rank holds."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = StateDictOptions(full_state_dict=True)
    params, optim = get_state_dict(model, optimizer, options=full)
    momentum = [optim["state"][k]["momentum_buffer"] for k in params]
    local = {k: tuple(getattr(v, "_local_tensor", v).shape) for k, v in model.state_dict().items()}
    return (params, momentum), local


def _save_sharded(directory):
    model, optimizer = _sharded_model()
    torch.manual_seed(dist.get_rank())
    for step in range(3):
        model(torch.randn(8, 12)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 1:  # the second save replaces the first
            ck.save_sharded(directory, model=model, optimizer=optimizer)
    return _whole(model, optimizer)


def _load_sharded(directory):
    model, optimizer = _sharded_model()
    ck.load_sharded(directory, model=model, optimizer=optimizer)
    return _whole(model, optimizer)


def _world_3(root, world_1_checkpoint, sharded):
    """World size 3: the runs after the crash, then load the checkpoint 2 ranks sharded."""
    return _after_crash(root, world_1_checkpoint), _load_sharded(sharded)


@pytest.fixture(autouse=True)
def _keep_this_process_rngs():
    """Loads in this process restore a saved RNG state: put the test process's back after."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint")
    out = {"root": root}
    for world in (1, 3):
        where = root / f"world{world}"
        crash = dict(at_step=CRASH_AT, rank=world - 1, hard=world > 1)  # raise / os._exit
        with pytest.raises(RankError) as crashed:
            run(_crashing_run, world, where / "crashed", crash, timeout=120)
        left = sorted(p.name for p in (where / "crashed").iterdir())
        shutil.copytree(where / "crashed", where / "no_rng")
        if world == 1:
            results = run(_after_crash, 1, where, timeout=120)
        else:
            saved = run(_save_sharded, 2, root / "sharded", timeout=120)
            world_1_checkpoint = ck.latest(root / "world1" / "crashed")
            both = run(_world_3, 3, where, world_1_checkpoint, root / "sharded", timeout=120)
            results = [r[0] for r in both]
            out["sharded"] = saved, [r[1] for r in both], root / "sharded"
        out[world] = crashed.value, left, results
    return out


# --------------------------------------------------------------------------- crash and resume


def test_crash_is_reported_and_leaves_the_last_checkpoints(runs):
    error, left, _ = runs[1]
    assert error.rank == 0 and isinstance(error.__cause__, ck.SimulatedCrash)
    error, left3, _ = runs[3]
    assert error.rank == 2 and error.exitcode == 17  # os._exit: no traceback, no cleanup
    assert left == left3 == ["step-00000004.pt", "step-00000008.pt"]  # keep=2


@pytest.mark.parametrize("world", [1, 3])
def test_resumed_run_equals_the_uninterrupted_run_bitwise(runs, world):
    results = runs[world][2]
    reference_run, reference = results[0]["uninterrupted"]
    assert reference_run.resumed_from is None
    assert reference_run.progress == ck.Progress(epoch=3, step_in_epoch=0, step=TOTAL_STEPS)
    for rank_results in results:  # every rank, parameters and momentum buffers
        resumed_run, resumed = rank_results["resumed"]
        assert resumed_run.resumed_from == RESUMED_FROM
        assert len(resumed_run.losses) == TOTAL_STEPS - RESUMED_FROM
        assert resumed_run.progress == reference_run.progress
        _assert_equal_states(resumed, reference)
        _assert_equal_states(rank_results["uninterrupted"][1], reference)


@pytest.mark.parametrize("world", [1, 3])
def test_without_the_rng_state_the_resumed_run_differs(runs, world):
    _, reference = runs[world][2][0]["uninterrupted"]
    _, (params, _) = runs[world][2][0]["no_rng"]
    assert any(not torch.equal(params[k], reference[0][k]) for k in params)


@pytest.mark.parametrize("world", [1, 3])
def test_a_finished_run_resumes_to_nothing(runs, world):
    again, state = runs[world][2][0]["again"]
    assert again.resumed_from == TOTAL_STEPS and again.losses == []
    _assert_equal_states(state, runs[world][2][0]["uninterrupted"][1])


def test_each_rank_gets_its_own_rng_state_back(runs):
    draws = [r["rng"] for r in runs[3][2]]
    for before, after in draws:  # torch, random (with a cached Gaussian), numpy
        assert torch.equal(before[0], after[0]) and before[1:3] == after[1:3]
        assert np.array_equal(before[3], after[3])
    assert len({before[1] for before, _ in draws}) == 3  # ranks drew different numbers


def test_loading_at_another_world_size_restores_what_exists_and_warns(runs):
    other = [r["other_world"] for r in runs[3][2]]  # world 3 loads a world-1 checkpoint
    assert [restored for restored, _ in other] == [True, False, False]
    assert any("saved by 1 ranks and is loaded by 3" in m for m in other[0][1])
    assert any("not restored" in m for m in other[2][1])
    # In this process (world size 1), a checkpoint saved by 3 ranks: rank 0's state exists.
    model, optimizer, *_ = _setup()
    path = ck.latest(runs["root"] / "world3" / "crashed")
    with pytest.warns(RuntimeWarning, match="saved by 3 ranks and is loaded by 1"):
        loaded = ck.load(path, model=model, optimizer=optimizer)
    assert loaded.rng_restored and loaded.world_size == 3 and loaded.progress.step == TOTAL_STEPS


@pytest.mark.gpu
def test_the_cuda_rng_state_is_restored_too(tmp_path):
    model, optimizer, *_ = _setup()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.rand(3, device="cuda")  # CUDA in use: its generator is part of the state
        ck.save(tmp_path / "a.pt", model=model, optimizer=optimizer, progress=ck.Progress())
        before = torch.rand(3, device="cuda")
        ck.load(tmp_path / "a.pt", model=model)
        assert torch.equal(before, torch.rand(3, device="cuda"))


def test_the_file_is_plain_data_with_every_ranks_rng_state(runs):
    path = ck.latest(runs["root"] / "world3" / "crashed")
    saved = torch.load(path, weights_only=True)  # no pickled objects: safe to load
    assert saved["world_size"] == 3 and len(saved["rng"]) == 3
    assert saved["progress"] == {"epoch": 3, "step_in_epoch": 0, "step": TOTAL_STEPS}
    torch_states = [rng["torch"] for rng in saved["rng"]]
    assert not torch.equal(torch_states[0], torch_states[1])  # seeded seed + rank


def test_resuming_with_other_settings_is_refused(runs):
    model, optimizer, x, y = _setup()
    settings = SETTINGS | dict(global_batch=12)  # another batch: another position in the epoch
    config = ck.ResumableConfig(checkpoint_dir=runs["root"] / "world1" / "crashed", **settings)
    with pytest.raises(ValueError, match="resume with the same ones"):
        ck.train_resumable(model, optimizer, x, y, config)
    with pytest.raises(ValueError, match="every=0, keep=2 and epochs=3 must be >= 1"):
        ck.ResumableConfig(checkpoint_dir="x", **SETTINGS | dict(every=0))


# --------------------------------------------------------------------------- atomic saves


def _save_forever(path, first_version):
    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP threads
    model = nn.Linear(1024, 2048)  # about 8 MB a save
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for version in itertools.count(first_version):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(version)
        ck.save(path, model=model, optimizer=optimizer, progress=ck.Progress(step=version))


def _complete_version(path, model):
    """Load ``path``; it must be one whole save: every parameter holds its version number."""
    version = ck.load(path, model=model).progress.step
    assert all(bool((p == version).all()) for p in model.parameters()), "a mixed checkpoint"
    return version


def test_sigkill_at_any_moment_leaves_a_complete_checkpoint(tmp_path):
    path, model = tmp_path / "model.pt", nn.Linear(1024, 2048)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ck.save(path, model=model, optimizer=optimizer, progress=ck.Progress(step=0))
    fork, moments = multiprocessing.get_context("fork"), random.Random(3)
    version, killed_mid_save = 0, 0
    for kill in range(1, 7):
        first = 1000 * kill  # this child saves versions first, first + 1, ...
        child = fork.Process(target=_save_forever, args=(path, first), daemon=True)
        child.start()
        deadline = time.monotonic() + moments.uniform(0.05, 0.4)
        while time.monotonic() < deadline:  # a reader never sees half a file either
            now = _complete_version(path, model)
            assert now == version or (now > version and now >= first)
            version = now
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        temporaries = list(tmp_path.glob(".model.pt.*.tmp"))  # what the killed save left
        killed_mid_save += bool(temporaries)
        now = _complete_version(path, model)
        assert now == version or (now > version and now >= first)
        version = now
        # the killed save's temporary names a dead writer, so it is recognised and removed
        assert sorted(ck.remove_killed_saves(tmp_path)) == sorted(temporaries)
        assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert killed_mid_save > 0  # at least one kill interrupted a save


class _Endless:
    """Pickling this never ends: a save of it stays mid-write, its temporary file open."""

    def __reduce__(self):
        time.sleep(600)


def _save_big_forever(path):
    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP threads
    big = torch.ones(8 << 20)  # 32 MB a save: long enough to be killed in the middle
    while True:
        ck.atomic_save({"v": big}, path)


def _wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_save_removes_what_killed_saves_left_but_never_a_live_save(tmp_path):
    path, fork = tmp_path / "model.pt", multiprocessing.get_context("fork")
    temporaries = lambda: set(tmp_path.glob(".model.pt.*.tmp"))  # noqa: E731
    for _ in range(5):  # until a round leaves 4 files (a kill lands between saves now and then)
        # Four savers at once: while they all live, none removes another's file. Once each is
        # in the middle of a save, all four are killed together.
        savers = [fork.Process(target=_save_big_forever, args=(path,), daemon=True) for _ in "1234"]
        for s in savers:
            s.start()
        pids = {str(s.pid) for s in savers}
        _wait_for(
            lambda pids=pids: pids <= {p.name.split(".")[3].split("-")[0] for p in temporaries()}
        )
        for s in savers:
            os.kill(s.pid, signal.SIGKILL)
        for s in savers:
            s.join()
        killed = temporaries()
        if len(killed) == 4:
            break
    assert len(killed) == 4, killed
    print(f"4 killed saves left {sum(p.stat().st_size for p in killed) / 1e6:.0f} MB")
    # a live concurrent save in another process, stuck in the middle of its write
    live = fork.Process(target=ck.atomic_save, args=(_Endless(), path), daemon=True)
    live.start()
    try:
        _wait_for(lambda: temporaries() - killed)
        (live_file,) = temporaries() - killed
        # a pid the kernel reused is not its old owner: same pid as this process, another start
        me = ck.files.Owner.me()
        reused = tmp_path / f".model.pt.{me.pid}-{me.start + 1}@{me.host}.0123abcd.tmp"
        elsewhere = tmp_path / f".model.pt.{me.pid}-{me.start + 1}@another-host.0123abcd.tmp"
        reused.touch()
        elsewhere.touch()

        ck.atomic_save({"v": torch.arange(3)}, path)  # one ordinary save
        assert temporaries() == {live_file, elsewhere}  # the killed ones and the reused pid's
        assert torch.equal(torch.load(path, weights_only=True)["v"], torch.arange(3))
        assert live.is_alive()  # the live save was left alone, and still runs
    finally:
        os.kill(live.pid, signal.SIGKILL)
        live.join()
    assert ck.remove_killed_saves(tmp_path) == [live_file]  # now its writer is dead
    elsewhere.unlink()  # (another host's file is that host's to judge)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


# --------------------------------------------------------------------------- bad input


def test_bad_input_gets_clear_errors(tmp_path):
    model, optimizer, *_ = _setup()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ck.load(tmp_path / "nope.pt", model=model)
    path = ck.save(tmp_path / "a.pt", model=model, optimizer=optimizer, progress=ck.Progress())
    other = mlp(seed=0, in_features=12, hidden=(16, 8), out_features=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit this model") as e:
        ck.load(path, model=other)
    assert "missing from the checkpoint: ['layers.4.bias', 'layers.4.weight']" in str(e.value)
    assert "layers.2.weight: (3, 16) saved, (8, 16) here" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched
    two_groups = torch.optim.SGD([{"params": [p]} for p in model.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer parameter groups hold \[4\] saved"):
        ck.load(path, model=model, optimizer=two_groups)
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="for a bare state_dict use"):
        ck.load(tmp_path / "bare.pt", model=model)
    torch.save({"format": ck.FORMAT, "code": nn.ReLU()}, tmp_path / "unsafe.pt")  # a pickle
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        ck.load(tmp_path / "unsafe.pt", model=model)
    with pytest.raises(TypeError, match=r"extra\['schedule'\] is a ReLU"):
        ck.save(
            tmp_path / "b.pt",
            model=model,
            optimizer=optimizer,
            progress=ck.Progress(),
            extra={"schedule": nn.ReLU()},
        )
    assert not (tmp_path / "b.pt").exists()


def test_a_save_that_fails_keeps_the_old_file(tmp_path):
    path = ck.atomic_save({"v": torch.ones(2)}, tmp_path / "a.pt")
    with pytest.raises(Exception, match="pickle"):
        ck.atomic_save({"v": lambda: 0}, path)  # torch.save cannot pickle a lambda
    assert os.listdir(tmp_path) == ["a.pt"]  # and no temporary left behind
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.ones(2))


def test_the_chapter_3_exercise_accepts_atomic_save_s_code():
    """The library's atomic_save meets every check of chapter 3's exercise: its own code, run as
    a learner's function (the library function itself is refused as a back door)."""
    import types

    from dmlbook.exercises import ch03

    same_code = types.FunctionType(ck.atomic_save.__code__, ck.atomic_save.__globals__)
    same_code.__defaults__ = ck.atomic_save.__defaults__
    same_code.__kwdefaults__ = ck.atomic_save.__kwdefaults__
    assert ch03.check_atomic_save(same_code).status == "passed"


def test_latest_picks_the_highest_step_and_ignores_the_rest(tmp_path):
    assert ck.latest(tmp_path / "missing") is None and ck.latest(tmp_path) is None
    for name in ["step-00000009.pt", "step-00000010.pt", ".step-00000011.pt.ab12.tmp", "x.pt"]:
        (tmp_path / name).touch()
    (tmp_path / "step-00000012.pt.bak").touch()
    assert ck.latest(tmp_path) == ck.checkpoint_path(tmp_path, 10)


# --------------------------------------------------------------------------- sharded, DCP


def test_sharded_checkpoint_loads_at_world_sizes_3_and_1(runs):
    saved, loaded, directory = runs["sharded"]
    reference, local_at_2 = saved[0]
    assert local_at_2["layers.0.weight"] == (8, 12)  # each of 2 ranks holds half of 16 rows
    assert sorted(p.name for p in directory.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # one file per rank
    assert [p.name for p in directory.parent.glob(".sharded.*")] == []  # no .partial / .old
    for whole, _ in loaded:  # world size 3: 16 rows split 6, 6, 4
        _assert_equal_states(whole, reference)
    assert [local["layers.0.weight"][0] for _, local in loaded] == [6, 6, 4]
    # World size 1, in this process, into a plain model that nobody sharded.
    model = mlp(seed=0, in_features=12, hidden=(16,), out_features=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ck.load_sharded(directory, model=model, optimizer=optimizer)
    momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    _assert_equal_states((model.state_dict(), momentum), reference)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the saved hyper-parameters too


def test_sharded_bad_input(runs, tmp_path):
    model = mlp(seed=0, in_features=12, hidden=(16,), out_features=3)
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        ck.load_sharded(tmp_path, model=model)
    other = mlp(seed=0, in_features=12, hidden=(32,), out_features=3)
    with pytest.raises(ValueError, match=r"model.layers.0.weight: \(16, 12\) saved, \(32, 12\)"):
        ck.load_sharded(runs["sharded"][2], model=other)
    ck.save_sharded(tmp_path / "model_only", model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="no optimizer state was saved"):
        ck.load_sharded(tmp_path / "model_only", model=model, optimizer=optimizer)
