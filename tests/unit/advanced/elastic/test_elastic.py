"""Chapter 11: elastic training under torchrun's agent, adaptive PS, elastic serving.

The torchrun job runs once (functools.cache) and several tests read its timeline: two agents
(two "nodes" on this machine, ``--nnodes 1:2``, c10d rendezvous on 127.0.0.1); at step 25 the
worker of node 1 SIGKILLs its agent and then itself (the whole node is gone). The surviving agent
restarts its worker at world size 1, which resumes from the step-20 checkpoint.
"""

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dmlbook import models, netlab
from dmlbook.advanced import elastic as el
from dmlbook.data_parallel import ps
from dmlbook.datasets import load_digits
from dmlbook.launch import free_port, run
from dmlbook.models import accuracy

pytestmark = pytest.mark.usefixtures("one_thread")

KILL_STEP, EVERY = 25, 10
SAMPLES = len(load_digits("train")[0])


@functools.cache
def node_failure_job() -> tuple[Path, el.AgentRun]:
    run_dir = Path(tempfile.mkdtemp(prefix="dmlbook-elastic-"))
    atexit.register(shutil.rmtree, run_dir, True)
    args = ("--kill-step", str(KILL_STEP), "--kill", "node", "--kill-rank", "1")
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        el.torchrun_command(run_dir, *args, endpoint=endpoint, is_host=i == 0) for i in (0, 1)
    ]
    return run_dir, el.run_agents(commands, run_dir, timeout=150)


def starts_and_kill(run_dir):
    timeline = el.Timeline(run_dir)
    (kill,) = timeline.events("kill")
    starts = timeline.events("start")
    before = [s for s in starts if s["time"] < kill["time"]][-1]
    after = [s for s in starts if s["time"] > kill["time"]]
    return timeline, before, kill, after


@pytest.mark.timeout(240)  # the first one to run waits for the torchrun job
def test_node_failure_agent_restarts_resumes_rescales():
    run_dir, job = node_failure_job()
    assert job.returncodes[0] == 0, job.logs[0][-3000:]  # the surviving node finished the job
    assert job.returncodes[1] == -9  # the killed node's agent died of SIGKILL
    timeline, before, kill, after = starts_and_kill(run_dir)
    assert kill == kill | {"rank": 1, "step": KILL_STEP, "what": "node"}
    assert len(after) == 1, after  # one restart, by the agent, at the new world size
    restart = after[0]
    checkpoints = [c["step"] for c in timeline.events("checkpoint") if c["time"] < kill["time"]]
    assert checkpoints[-1] == KILL_STEP // EVERY * EVERY == 20
    assert restart["resume_step"] == checkpoints[-1]  # resumed from the last checkpoint
    assert restart["restart_count"] == 1 and restart["nodes"] == 1
    assert (before["world"], restart["world"]) == (2, 1)
    assert (before["global_batch"], restart["global_batch"]) == (32, 16)
    assert before["lr"] == pytest.approx(0.1) and restart["lr"] == pytest.approx(0.05)
    assert restart["resumed_from"] == {"world": 2, "lr": pytest.approx(0.1)}
    assert restart["position"] == 20 * 32  # the epoch resumes at a sample, not a batch
    (end,) = timeline.events("end")
    # epoch 0: 20 steps of 32, then the other 798 samples in 50 steps of 16; 2 more epochs of 90
    assert end["step"] == 20 + 50 + 2 * 90 == 250 and end["world"] == 1
    # the survivor's collective failed at once, and the agent spawned the new worker after it
    (fault,) = timeline.events("fault")
    assert fault["rank"] == 0 and fault["generation"] == 0 and "RuntimeError" in fault["error"]
    assert kill["time"] <= fault["time"] < restart["spawned"] < restart["time"]
    assert restart["spawned"] - fault["time"] >= 3  # the rendezvous' last call: 3 s (QUICK_RDZV)
    print(
        f"\nkill at +{kill['time'] - before['time']:.1f} s (step {KILL_STEP}), restart "
        f"{restart['time'] - kill['time']:.1f} s later at world {restart['world']}, resumed at "
        f"step {restart['resume_step']}, lr {before['lr']} -> {restart['lr']}, "
        f"job {job.seconds:.1f} s, accuracy {end['accuracy']:.3f}"
    )


@pytest.mark.timeout(240)  # the first one to run waits for the torchrun job
def test_no_step_before_the_checkpoint_is_repeated_or_lost():
    run_dir, _ = node_failure_job()
    timeline, before, kill, (restart,) = starts_and_kill(run_dir)
    events = timeline.events("step")
    steps = [e["step"] for e in events]
    resume = restart["resume_step"]
    first_run = [e["step"] for e in events if e["time"] < restart["time"]]  # up to the kill
    assert first_run == list(range(1, len(first_run) + 1)) and len(first_run) >= KILL_STEP - 1
    assert steps[len(first_run) :] == list(range(resume + 1, 251))  # resumed right after it
    # only the steps after the checkpoint ran twice: the work the failure cost
    twice = sorted({s for s in steps if steps.count(s) > 1})
    assert twice == list(range(resume + 1, len(first_run) + 1))


@pytest.mark.timeout(240)  # the first one to run waits for the torchrun job
def test_every_sample_once_per_epoch_across_the_resize():
    run_dir, _ = node_failure_job()
    trained = el.samples_trained(run_dir)
    assert sorted(trained) == list(range(1, 251))
    for step, entry in trained.items():
        assert len(entry["ranks"]) == (2 if step <= 20 else 1), step  # re-partitioned for 1 rank
        assert entry["generation"] == (0 if step <= 20 else 1)
    for epoch in range(3):
        seen = [i for e in trained.values() if e["epoch"] == epoch for r in e["ranks"].values()
                for i in r]  # fmt: skip
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples lost or repeated"


@pytest.mark.timeout(240)  # the first one to run waits for the torchrun job
def test_accuracy_within_noise_of_an_uninterrupted_run():
    run_dir, _ = node_failure_job()
    (end,) = el.Timeline(run_dir).events("end")
    reference, _ = el.uninterrupted_run(el.ElasticConfig(run_dir=str(run_dir)), world_size=2)
    uninterrupted = accuracy(reference, *load_digits("test"))
    print(f"\naccuracy {end['accuracy']:.3f} after the failure, {uninterrupted:.3f} without")
    assert abs(end["accuracy"] - uninterrupted) < 0.03 and end["accuracy"] > 0.9
    final = torch.load(run_dir / "final.pt", weights_only=True)
    model = models.mlp()
    model.load_state_dict(final["model"])
    assert accuracy(model, *load_digits("test")) == end["accuracy"]  # what was saved is it


@pytest.mark.timeout(240)  # the first one to run waits for the torchrun job
def test_no_process_left_behind():
    run_dir, job = node_failure_job()
    assert len(job.worker_pids) == 3  # 2 workers, then 1 restarted
    assert not [p for p in job.agent_pids + job.worker_pids if el.alive(p)]


def test_a_job_past_its_timeout_leaves_no_process_behind(tmp_path):
    cmd = el.torchrun_command(tmp_path, "--step-delay", "1", max_restarts=0)

    def until_a_worker_runs():
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    job = el.run_agents([cmd], tmp_path, timeout=0.1, during=until_a_worker_runs)
    assert job.timed_out and job.returncodes[0] != 0 and len(job.worker_pids) == 1
    assert not [p for p in job.agent_pids + job.worker_pids if el.alive(p)]


# --------------------------------------------------------------------------- pure pieces


def _given_flags(cmd: list[str]) -> dict[str, str]:
    """Each ``--flag value`` pair of a torchrun line (flags without a value map to "")."""
    script = cmd.index(el.SCRIPT)
    words, given = cmd[1:script], {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else "--"
            given[word] = "" if nxt.startswith("--") else nxt
    return given


def test_torchrun_commands_parse_with_torchruns_own_parser(tmp_path):
    """Every line torchrun_command builds runs in a shell as the chapter prints it: torch's own
    parser reads it, and no option is given an empty value (the chapter once printed
    ``--rdzv-conf`` with nothing after it, which a shell then drops)."""
    import shlex

    from torch.distributed.run import get_args_parser

    one = el.torchrun_command("runs/job", "--kill-step", "25", nproc_per_node=2)
    several = el.torchrun_command("/shared/runs/job", nproc_per_node=2, nnodes="1:4",
                                  max_restarts=3, endpoint="HOST0:29400", rdzv_conf="")  # fmt: skip
    host, guest = (
        el.torchrun_command(tmp_path, "--kill", "node", endpoint="127.0.0.1:29400", is_host=h)
        for h in (True, False)
    )
    defaults = el.torchrun_command(tmp_path, endpoint="127.0.0.1:29400")
    for cmd in (one, several, host, guest, defaults):
        assert cmd[0] == "torchrun"
        printed = " ".join(cmd)  # how the chapter prints it
        assert shlex.split(printed) == cmd, f"a shell splits {printed!r} differently"
        args = get_args_parser().parse_args(shlex.split(printed)[1:])
        for flag in _given_flags(cmd):
            parsed = getattr(args, flag[2:].replace("-", "_"))
            if isinstance(parsed, str):
                assert parsed.strip(" ,") != "", f"{flag} is given an empty value in {printed!r}"
        assert args.training_script == el.SCRIPT and args.max_restarts >= 1
    assert get_args_parser().parse_args(one[1:]).standalone and "--nnodes" not in one
    parsed = get_args_parser().parse_args(several[1:])
    assert (parsed.nnodes, parsed.rdzv_endpoint, parsed.rdzv_id) == (
        "1:4",
        "HOST0:29400",
        "elastic",
    )
    assert "--rdzv-conf" not in several  # torchrun's defaults on real machines
    assert _given_flags(host)["--rdzv-conf"] == el.agents.QUICK_RDZV + ",is_host=1"
    assert _given_flags(guest)["--rdzv-conf"].endswith(",is_host=0")
    assert _given_flags(defaults)["--rdzv-conf"] == el.agents.QUICK_RDZV
    bare = el.torchrun_command(tmp_path, endpoint="h:1", rdzv_conf="", is_host=True)
    assert _given_flags(bare)["--rdzv-conf"] == "is_host=1"


def test_resume_starts_from_scratch_or_where_the_checkpoint_left_off(tmp_path):
    model = models.mlp(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert el.resume(tmp_path, model, optimizer, 0.1) == el.ResumePoint()  # the first start
    batches = list(el.elastic_batches(37, seed=0, local_batch=4, rank=0, world_size=2, epochs=1))
    from dmlbook.data_parallel import checkpoint as ckpt

    batch = batches[2]  # three steps of 8 samples done
    ckpt.save(ckpt.checkpoint_path(tmp_path, 3), model=model, optimizer=optimizer,
              progress=ckpt.progress_after(batch, 3),
              extra={"lr": 0.1, "position": el.position_after(batch)})  # fmt: skip
    fresh = models.mlp(seed=1)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    start = el.resume(tmp_path, fresh, fresh_optimizer, 0.05)
    assert start == el.ResumePoint(epoch=0, position=24, step=3, saved_world=1, saved_lr=0.1)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.05  # this world's, not the saved one
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # the rest of the epoch at world size 3, from sample 24: every sample once
    rest = [
        list(b.samples)
        for r in range(3)
        for b in el.elastic_batches(
            37,
            seed=0,
            local_batch=4,
            rank=r,
            world_size=3,
            epochs=1,
            start=(start.epoch, start.position),
        )  # fmt: skip
    ]
    assert sorted(i for part in rest for i in part) == sorted(el.epoch_order(37, 0, 0)[24:])


def test_rank_batch_repartitions_without_loss_or_repeat():
    order = list(range(100, 137))  # 37 samples
    for world in (1, 2, 3, 4):
        for position in (0, 5, 30, 36):
            parts = [el.rank_batch(order, position, 4, r, world) for r in range(world)]
            batch = order[position : position + 4 * world]
            assert [i for p in parts for i in p] == batch
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert el.lr_for(3, base_lr=0.1, base_batch=32, local_batch=16) == pytest.approx(0.15)


def test_bad_input_errors_clearly():
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        el.rank_batch(list(range(10)), 0, 2, 2, 2)
    with pytest.raises(ValueError, match="position"):
        el.rank_batch(list(range(10)), 10, 2, 0, 2)
    with pytest.raises(ValueError, match="epochs, local_batch"):
        el.ElasticConfig(run_dir="x", local_batch=0)
    with pytest.raises(ValueError, match="kill must be"):
        el.ElasticConfig(run_dir="x", kill="rack")
    with pytest.raises(ValueError, match="base_lr"):
        el.ElasticConfig(run_dir="x", base_lr=float("nan"))
    with pytest.raises(RuntimeError, match="runs under torchrun"):
        el.train_worker(el.ElasticConfig(run_dir="x"))
    model, x = models.mlp(), load_digits("test")[0]
    with pytest.raises(ValueError, match="min_workers"):
        el.Autoscaler(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="target_utilization"):
        el.Autoscaler(target_utilization=1.5)
    assert el.Autoscaler().workers_for(150, 0.02) == 4  # 150 x 0.02 / 0.7 = 4.3: capped at 4
    assert el.Autoscaler().workers_for(20, 0.02) == 1  # 0.57 -> 1
    assert el.FixedPool(workers=2).workers_for(150, 0.02) == 2
    assert el.request_schedule([(1, 2), (0.5, 4)]) == [(0, 2), (0.5, 2), (1, 4), (1.25, 4)]
    with pytest.raises(ValueError, match="phases"):
        el.serve_elastic(model, x, [(1, -5)])
    with pytest.raises(ValueError, match=r"cannot answer a request of shape \(1, 10\)"):
        el.serve_elastic(model, torch.zeros(5, 10), [(1, 10)])


# --------------------------------------------------------------------------- adaptive PS

MEMBERS = [[1], [1, 2], [1, 2, 3], [2, 3], [3], [1, 3]] * 3  # join, join, leave, leave, rejoin


def adaptive_ps():
    x, y = load_digits("train")
    config = ps.PSConfig(global_batch=60, lr=0.1)
    return ps.train_parameter_server(lambda: models.mlp(seed=0), x, y, config, members=MEMBERS)


def test_ps_workers_join_and_leave_and_sgd_stays_exact():
    results = run(adaptive_ps, 4)
    server, workers = results[0], results[1:]
    assert server.members == MEMBERS
    for w in workers:  # each worker worked exactly in its rounds ...
        assert w.rounds == [r for r, ids in enumerate(MEMBERS) if w.rank in ids]
    x, y = load_digits("train")
    model = models.mlp(seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    per_epoch = SAMPLES // 60
    losses = ps.global_losses(results, 60)
    for r in range(len(MEMBERS)):  # ... and together they computed SGD on each global batch
        epoch, k = divmod(r, per_epoch)
        batch = el.epoch_order(SAMPLES, 0, epoch)[k * 60 : (k + 1) * 60]
        parts = [w.samples[w.rounds.index(r)] for w in workers if r in w.rounds]
        assert sorted(i for p in parts for i in p) == sorted(batch)
        loss = F.cross_entropy(model(x[batch]), y[batch])
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        assert losses[r] == pytest.approx(loss.item(), rel=1e-5)
    trained = ps.assemble_model(models.mlp(seed=0), results)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[k], v, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- elastic serving


def test_serving_pool_follows_the_rate_and_answers_like_the_model():
    model, x = models.mlp(seed=1), load_digits("test")[0]
    phases = [(0.8, 20), (1.6, 150), (1.4, 20)]
    scaling = el.Autoscaler(max_workers=4, interval=0.15, window=0.5)
    report = el.serve_elastic(model, x, phases, service_s=0.02, scaling=scaling)
    with torch.no_grad():
        expected = model(x[[i % len(x) for i in range(len(report.latency))]])
    torch.testing.assert_close(report.answers, expected)  # every answer is the model's
    assert all(lat == lat and lat > 0 for lat in report.latency)  # measured, none lost
    sizes = [(t, n) for t, _, n in report.pool]
    peak = max(n for t, n in sizes if 0.8 < t < 2.6)
    assert peak >= 3  # 150 req/s x 0.02 s / 0.7 -> 4.3, capped at 4
    assert max(n for t, n in sizes if t < 0.7) == 1  # 20 req/s: one worker is enough
    assert sizes[-1][1] <= 2  # and it shrank back after the burst
    assert len({p for p in report.worker_of}) >= 3  # the new workers really served requests
    time.sleep(0.2)
    assert not [p for p in report.pids if el.alive(p)]


def test_two_pools_side_by_side_and_their_queues():
    model, x = models.mlp(seed=1), load_digits("test")[0]
    phases = [(0.3, 10), (0.6, 60), (0.3, 10)]
    elastic, fixed = el.serve_side_by_side(
        model, x, phases, [el.Autoscaler(max_workers=5), el.FixedPool(workers=1)], service_s=0.05
    )
    with torch.no_grad():
        expected = model(x[[i % len(x) for i in range(len(fixed.latency))]])
    for report in (elastic, fixed):
        torch.testing.assert_close(report.answers, expected)
        assert report.waiting(-1.0) == 0 and report.waiting(100.0) == 0  # before and after
    assert {n for _, _, n in fixed.pool} == {1}
    # one worker at 20 req/s against 60: its queue at the end of the burst holds most of it
    assert fixed.waiting(0.9) >= 15


def test_the_serving_pool_picture_draws_live_workers_and_free_slots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook import viz

    ax = viz.serving_pool(workers=2, max_workers=5)
    texts = [t.get_text() for t in ax.texts]
    assert sum(t.startswith("worker ") for t in texts) == 2
    assert texts.count("(can start)") == 3
    assert any("max_workers = 5" in t for t in texts)
    plt.close(ax.figure)


@pytest.mark.timeout(120)
def test_serving_from_a_script_without_a_main_guard_says_so(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(
        "from dmlbook import models\n"
        "from dmlbook.advanced import elastic as el\n"
        "from dmlbook.datasets import load_digits\n"
        "el.serve_elastic(models.mlp(), load_digits('test')[0], [(0.2, 10)])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=110)  # fmt: skip
    assert done.returncode != 0
    assert 'if __name__ == "__main__"' in done.stderr, done.stderr[-2000:]


# --------------------------------------------------------------------------- a whole host dies

PREFIX = f"e{os.getpid() % 100000}"


@pytest.mark.netns
@pytest.mark.timeout(240)
@pytest.mark.skipif(netlab.available() is not None, reason=str(netlab.available()))
def test_netns_host_killed_agent_recovers_on_the_other_host(tmp_path):
    lab = netlab.Lab(2, prefix=PREFIX)
    try:
        lab.up()
        endpoint = f"{lab.address(0)}:29400"
        commands = [
            el.torchrun_command(
                tmp_path,
                "--epochs",
                "1",
                "--step-delay",
                "0.03",
                endpoint=endpoint,
                is_host=h == "h0",
                local_addr=lab.address(h),
            )  # fmt: skip
            for h in lab.names
        ]
        timeline, killed = el.Timeline(tmp_path), {}

        def kill_h1_after_a_checkpoint():
            deadline = time.monotonic() + 120
            while not timeline.events("checkpoint") and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.15)  # a few steps past the checkpoint: mid-epoch
            killed["time"], killed["pids"] = time.time(), lab.kill("h1")

        job = el.run_agents(
            commands,
            tmp_path,
            timeout=150,
            popen=lambda i, argv, **kw: lab.popen(lab.names[i], argv, **kw),
            during=kill_h1_after_a_checkpoint,
        )
    finally:
        lab.down()
    assert netlab.down(PREFIX) == []
    assert killed["pids"], "nothing ran on h1"
    assert job.returncodes[0] == 0, job.logs[0][-3000:]
    starts = timeline.events("start")
    before = [s for s in starts if s["time"] < killed["time"]][-1]
    (restart,) = [s for s in starts if s["time"] > killed["time"]]
    checkpoints = [c["step"] for c in timeline.events("checkpoint") if c["time"] < killed["time"]]
    assert (before["world"], restart["world"]) == (2, 1)
    assert restart["resume_step"] == checkpoints[-1] and restart["restart_count"] == 1
    assert restart["lr"] == pytest.approx(before["lr"] / 2)
    (end,) = timeline.events("end")
    assert end["accuracy"] > 0.6  # one epoch, half of it on one host: far above chance (0.1)
    assert not [p for p in job.agent_pids + job.worker_pids if el.alive(p)]
    print(
        f"\nh1 killed, h0 restarted at world 1 after {restart['time'] - killed['time']:.1f} s, "
        f"resumed at step {restart['resume_step']}; job {job.seconds:.1f} s"
    )


# --------------------------------------------------------------------------- the pictures


def test_agents_and_workers_draws_each_generation_with_its_ranks():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook import viz

    ax = viz.agents_and_workers(
        [viz.Generation([0, 1, 2], 2, fails=2, note="machine 2 fails"), viz.Generation([0, 1], 2)]
    )
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("torchrun agent") == 3 + 2  # one agent per live machine
    assert sum("worker\nrank" in t for t in texts) == 6 + 4
    assert "generation 0: world size 6" in texts and "generation 1: world size 4" in texts
    assert "machine 2 (gone)" in texts and "machine 2 fails" in texts
    plt.close("all")


def test_epoch_by_generation_draws_a_box_per_step_in_the_window():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook import viz

    rows = {"g0": [(0, 32, 1, False), (32, 64, 2, True)], "g1": [(32, 48, 2, False)]}
    ax = viz.epoch_by_generation(rows, window=(16, 64), marks={"checkpoint": 32})
    assert [t.get_text() for t in ax.texts] == ["1", "2", "2"]
    hatched = [p for p in ax.patches if p.get_hatch() and p.get_width() > 0]
    assert len(hatched) == 1 and hatched[0].get_x() == 32  # the lost step
    assert ax.get_xlim() == (16, 64)
    plt.close("all")
