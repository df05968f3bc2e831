"""Tests for dmlbook.model_parallel.pipeline_workflows: pipelined training, fine-tuning and serving
at world sizes 1 (no process group), 2 and 3 (even, uneven and balanced splits; one and several
micro-batches; GPipe and 1F1B; two trainers taking turns) equal the single-process reference;
bad input raises ValueError, on every rank, without hanging."""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dmlbook.datasets import CharVocab, char_corpus
from dmlbook.launch import run
from dmlbook.model_parallel import pipeline as pp
from dmlbook.model_parallel import pipeline_workflows as pw
from dmlbook.model_parallel import stage_balancing as sb
from dmlbook.models import char_gpt

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, SEQ, STEPS = 20, 12, 8, 3
TOL = dict(rtol=0, atol=1e-10)  # float64 everywhere: the real error is near 1e-15


def gpt() -> torch.nn.Module:
    return char_gpt(VOCAB, seed=0, n_layer=3, n_head=2, n_embd=16, block_size=SEQ).double()


def wide_then_narrow() -> torch.nn.Module:
    return pw.unbalanced_mlp((96, 8, 8, 8), dim=8, classes=5, seed=1).double()


def gpt_batches(seed: int = 1, steps: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
        for _ in range(steps)
    ]


def mlp_batches():
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def requests():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(7)]


def pretrained_state():
    return pw.train_unsplit(gpt, gpt_batches(seed=9), lr=1e-2).state


def balanced_counts(stages: int) -> list[int]:
    """The balancer's split of the MLP by parameter count (a closed-form cost)."""
    costs = [
        sum(p.numel() for p in layer.parameters()) for layer in pp.layers_of(wide_then_narrow())
    ]
    return sb.linear_partition(costs, stages)


def gpt_counts(stages: int) -> list[int] | None:
    return {1: None, 2: [1, 4], 3: None}[stages]  # 5 layers: uneven [1, 4]; even [2, 2, 1]


# ---- what every rank runs --------------------------------------------------------------------


def _workflows(pretrained):
    stages = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    try:  # a split for another number of ranks: every rank refuses before sending anything
        pw.train_pipelined(gpt, [5] * (stages + 1), gpt_batches())
    except ValueError as error:
        out["wrong split"] = str(error)
    for schedule, microbatches in (("gpipe", 1), ("gpipe", 3), ("1f1b", 4)):
        out["gpt", schedule, microbatches] = pw.train_pipelined(
            gpt, gpt_counts(stages), gpt_batches(), microbatches, schedule, lr=1e-2
        )
    out["mlp"] = pw.train_pipelined(
        wide_then_narrow, balanced_counts(stages), mlp_batches(), 2, "1f1b", lr=1e-2,
        optimizer=torch.optim.SGD, steps=5,
    )  # fmt: skip
    out["finetune"] = pw.train_pipelined(
        pw.with_weights(gpt, pretrained), None, gpt_batches(seed=4), 2, lr=1e-2
    )
    for in_flight in (1, 3):
        out["serve", in_flight] = pw.serve_pipelined(gpt, None, requests(), in_flight)
    # two trainers taking turns on the same ranks do not disturb each other
    turns = {
        "gpt": pw.PipelinedTrainer(gpt, None, 2, "1f1b", lr=1e-2),
        "mlp": pw.PipelinedTrainer(
            wide_then_narrow, balanced_counts(stages), 1, lr=1e-2, optimizer=torch.optim.SGD
        ),
    }
    for step in range(5):
        for name, trainer in turns.items():
            trainer.step(*{"gpt": gpt_batches(), "mlp": mlp_batches()}[name][step % STEPS])
    out["turns"] = {name: trainer.result() for name, trainer in turns.items()}
    out["burst"] = pw.cpu_wait_in_burst(0.05)
    return out


@functools.cache
def results(stages: int):
    if stages == 1:  # one stage needs no process group: run it right here
        return [_workflows(pretrained_state())]
    return run(_workflows, stages, pretrained_state(), timeout=90)


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


@functools.cache
def reference(which: str):
    if which == "gpt":
        return pw.train_unsplit(gpt, gpt_batches(), lr=1e-2)
    if which == "mlp":
        return pw.train_unsplit(
            wide_then_narrow, mlp_batches(), lr=1e-2, optimizer=torch.optim.SGD, steps=5
        )
    return pw.train_unsplit(pw.with_weights(gpt, pretrained_state()), gpt_batches(seed=4), 1e-2)


# ---- pipelined equals single-process ---------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipelined_training_equals_single_process(stages):
    ranks = results(stages)
    want = reference("gpt")
    for key in [k for k in ranks[0] if k[0] == "gpt"]:
        last = ranks[-1][key]
        assert last.losses == pytest.approx(want.losses, abs=1e-12), key
        assert all(r[key].losses is None for r in ranks[:-1])  # only the last stage has a loss
        assert_same_state(pw.merge_states([r[key] for r in ranks]), want.state)
        assert [r[key].stage for r in ranks] == list(range(stages))
        assert len(pw.step_times([r[key] for r in ranks])) == STEPS
    counts = ranks[0]["gpt", "gpipe", 1].counts
    assert counts == (gpt_counts(stages) or pp.even_partition(5, stages))
    # Each stage holds exactly its own layers' parameters.
    layers = pp.split_model(pp.layers_of(gpt()), counts)
    for rank, layer in enumerate(layers):
        names = pw.merge_states([ranks[rank]["gpt", "gpipe", 1]]).keys()
        assert len(names) == len(list(layer.parameters()))


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_balanced_split_and_finetuning_equal_single_process(stages):
    ranks = results(stages)
    assert ranks[0]["mlp"].counts == balanced_counts(stages)
    for key in ("mlp", "finetune"):
        want = reference(key)
        assert ranks[-1][key].losses == pytest.approx(want.losses, abs=1e-12), key
        assert_same_state(pw.merge_states([r[key] for r in ranks]), want.state)
    # fine-tuning started from the pre-trained weights, not from the seed
    x, y = gpt_batches(seed=4)[0]
    pretrained = pw.with_weights(gpt, pretrained_state())()
    assert ranks[-1]["finetune"].losses[0] == pytest.approx(pretrained(x, y)[1].item(), abs=1e-12)
    assert abs(ranks[-1]["finetune"].losses[0] - gpt()(x, y)[1].item()) > 1e-3


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_trainers_taking_turns_equal_single_process(stages):
    ranks = results(stages)
    want = {
        "gpt": pw.train_unsplit(gpt, gpt_batches(), lr=1e-2, steps=5),
        "mlp": reference("mlp"),
    }
    for name in ("gpt", "mlp"):
        got = [r["turns"][name] for r in ranks]
        assert got[-1].losses == pytest.approx(want[name].losses, abs=1e-12), name
        assert_same_state(pw.merge_states(got), want[name].state)
        assert len(pw.step_times(got)) == 5
    for rank in ranks:  # one reading per step of the time spent ready but without a CPU
        assert len(rank["turns"]["gpt"].cpu_waits) == 5
        # and each op's CPU time, one per op of the step's timeline
        result = rank["turns"]["gpt"]
        assert [len(c) for c in result.op_cpu] == [len(t) for t in result.timelines]
        assert all(c >= 0 for step in result.op_cpu for c in step)
        assert pw.busy_cpu_s(result) >= 0
    ideal = pw.ideal_steps([r["turns"]["gpt"] for r in ranks])
    assert len(ideal) == 4  # 5 steps, the first left out
    for step, k in zip(ideal, range(1, 5), strict=True):
        # the same ops, each lasting its CPU time, no stage doing two at once
        for s, timeline in enumerate(step):
            assert [(r.op, r.microbatch) for r in timeline] == [
                (r.op, r.microbatch) for r in ranks[s]["turns"]["gpt"].timelines[k]
            ]
            cpu = ranks[s]["turns"]["gpt"].op_cpu[k]
            assert [r.end - r.start for r in timeline] == pytest.approx(cpu, abs=1e-12)
            assert all(b.start >= a.end - 1e-12 for a, b in itertools.pairwise(timeline))
        assert pw.span_s(step) <= sum(sum(ranks[s]["turns"]["gpt"].op_cpu[k]) for s in
                                      range(stages)) + 1e-12  # fmt: skip
    burst = ranks[0]["burst"]  # the largest share over the ranks: every rank gets the same
    assert 0 <= burst <= 1 and all(r["burst"] == burst for r in ranks)


def test_cpu_wait_fraction_is_the_slowest_ranks_share_of_the_step_time():
    def result(times, waits):
        return pw.TrainResult(0, [1], None, times, {}, cpu_waits=waits)

    ranks = [result([9.0, 1.0, 2.0], [9.0, 0.1, 0.0]), result([9.0, 0.5, 3.0], [0.0, 0.0, 0.6])]
    # steps 1 and 2 (step 0 warms up): slowest stage 1.0 and 3.0 s, most waited 0.1 and 0.6 s
    assert pw.cpu_wait_fraction(ranks) == pytest.approx(0.7 / 4.0)


def test_cpu_wait_counts_threads_that_are_ready_but_have_no_core():
    """More compute threads than cores must wait in the run queue: with cores + 2 threads each
    multiplying matrices (GIL released) for 0.5 s, together they wait at least about 1 s beyond
    what this process waited before. The reading would stay flat if it measured nothing.

    It is read while the threads still run: /proc/self/task forgets a thread, and its wait, once
    it exits (read after join, this measured -0.2 to 0.6 s, quiet or loaded)."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    done = threading.Event()

    def busy():
        a = torch.rand(512, 512)
        while not done.is_set():
            a @ a

    workers = [threading.Thread(target=busy) for _ in range(cores + 2)]
    try:
        before = pw.cpu_wait_s()
        for w in workers:
            w.start()
        time.sleep(0.5)
        waited = pw.cpu_wait_s() - before
    finally:
        done.set()
        for w in workers:
            w.join()
        torch.set_num_threads(threads)
    # (cores + 2) threads x 0.5 s of demand on `cores` cores: about 1 s of waiting at the least
    # (measured 1.8-2.5 s in fresh processes, quiet and under two CPU-bound processes)
    assert waited > 0.5, waited


def test_scheduler_clock_counts_the_threads_it_is_given():
    """The calling thread's CPU time grows while it computes; a thread id this process does not
    have counts nothing (chapter 4 reads gloo's transport thread this way)."""
    from dmlbook.cpu_wait import scheduler_clock

    me = [threading.get_native_id()]
    on, _ = scheduler_clock(me)
    a, start = torch.rand(256, 256), time.thread_time()
    while time.thread_time() - start < 0.2:
        a @ a
    assert scheduler_clock(me)[0] - on > 0.1
    assert scheduler_clock([2**31 - 1]) == (0.0, 0.0)
    assert scheduler_clock()[0] >= scheduler_clock(me)[0]  # the whole process, this thread too


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipelined_serving_equals_the_model(stages):
    ranks = results(stages)
    want = pw.serve_reference(gpt(), requests())
    for in_flight in (1, 3):
        last = ranks[-1]["serve", in_flight]
        assert len(last.outputs) == len(last.latencies) == 7  # 7 requests: windows of 3, 3, 1
        for got, expected in zip(last.outputs, want.outputs, strict=True):
            torch.testing.assert_close(got, expected, **TOL)
        assert all(r["serve", in_flight].outputs is None for r in ranks[:-1])
        assert all(0 < latency <= last.total_s for latency in last.latencies)
        windows = ranks[0]["serve", in_flight].timelines
        assert [len(t) for t in windows] == ([1] * 7 if in_flight == 1 else [3, 3, 1])
        served = [r["serve", in_flight] for r in ranks]
        assert [len(c) for c in served[0].op_cpu] == [len(t) for t in windows]
        ideal = pw.ideal_steps(served, skip=0)  # one per window, forwards only
        assert len(ideal) == len(windows)
        assert all(r.op == "F" for window in ideal for tl in window for r in tl)


def test_the_protocol_sends_activations_forward_and_gradients_back():
    ranks = results(2)
    stage0, stage1 = (r["gpt", "1f1b", 4] for r in ranks)
    activation = BATCH * SEQ * 16 * 8  # (B, T, C) float64, over all micro-batches
    assert stage0.sent_bytes == activation  # forward: activations to stage 1
    assert stage1.sent_bytes == activation  # backward: their gradients to stage 0
    assert [(op.op, op.microbatch) for op in stage1.timeline] == [
        (a.op, a.microbatch) for a in pp.stage_actions(pp.one_f_one_b_schedule(2, 4), 1)
    ]


# ---- single process, no process group: P = 1 is plain training -------------------------------


def test_one_stage_without_a_process_group_is_plain_training():
    got = pw.train_pipelined(gpt, None, gpt_batches(), microbatches=3, lr=1e-2)
    want = reference("gpt")
    assert got.losses == pytest.approx(want.losses, abs=1e-12)
    assert_same_state(got.state, want.state)
    served = pw.serve_pipelined(gpt, [5], requests(), in_flight=4)
    for a, b in zip(served.outputs, pw.serve_reference(gpt(), requests()).outputs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_bad_input_raises_valueerror():
    with pytest.raises(ValueError, match="name 2 stages, but the group has 1"):
        pw.train_pipelined(gpt, [2, 3], gpt_batches())
    with pytest.raises(ValueError, match="batches is empty"):
        pw.train_pipelined(gpt, None, [])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        pw.train_unsplit(gpt, gpt_batches(), steps=0)
    with pytest.raises(ValueError, match="in_flight must be >= 1"):
        pw.serve_pipelined(gpt, None, requests(), in_flight=0)
    with pytest.raises(ValueError, match="same shape"):
        pw.serve_pipelined(gpt, None, [torch.zeros(2, 4).long(), torch.zeros(3, 4).long()])
    with pytest.raises(ValueError, match="no requests"):
        pw.serve_reference(gpt(), [])


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_split_for_another_number_of_ranks_raises_on_every_rank(stages):
    for rank in results(stages):
        assert rank["wrong split"] == (
            f"counts {[5] * (stages + 1)} name {stages + 1} stages, but the group has {stages}"
        )


# ---- fine-tuning data -----------------------------------------------------------------------


def test_finetune_text_is_a_second_offline_text():
    text = pw.finetune_text()
    assert len(text) > 20_000 and text == pw.finetune_text()  # deterministic
    assert text[:2000] not in char_corpus()
    vocab = CharVocab(char_corpus() + text)
    batches = pw.lm_batches(vocab.encode(text), block_size=8, batch_size=4, steps=3, seed=0)
    assert len(batches) == 3 and batches[0][0].shape == (4, 8)
    torch.testing.assert_close(batches[0][0][:, 1:], batches[0][1][:, :-1], rtol=0, atol=0)
    model = char_gpt(len(vocab), seed=0, n_layer=1, n_head=2, n_embd=8, block_size=8)
    assert pw.lm_loss(model, batches) == pytest.approx(math.log(len(vocab)), rel=0.05)


# ---- GPU ------------------------------------------------------------------------------------


def _train_and_serve_on_gpus():
    stages = dist.get_world_size()
    assert pp.PipelineStage(torch.nn.Identity(), dist.get_rank(), stages).device.type == "cuda"
    trained = pw.train_pipelined(gpt, gpt_counts(stages), gpt_batches(), 3, "1f1b", lr=1e-2)
    return trained, pw.serve_pipelined(gpt, None, requests(), in_flight=3)


@pytest.mark.gpu
def test_pipelined_training_and_serving_on_gpus_equal_single_process():
    stages = min(torch.cuda.device_count(), 2)
    ranks = run(_train_and_serve_on_gpus, stages, backend="nccl", timeout=120)
    want = reference("gpt")
    assert ranks[-1][0].losses == pytest.approx(want.losses, abs=1e-9)
    assert_same_state(pw.merge_states([r[0] for r in ranks]), want.state)
    expected = pw.serve_reference(gpt(), requests()).outputs
    for got, wanted in zip(ranks[-1][1].outputs, expected, strict=True):
        torch.testing.assert_close(got, wanted, rtol=0, atol=1e-9)


def test_completion_ticks_as_a_table():
    from dmlbook.model_parallel.pipeline_serving import completion_ticks

    # micro-batches of 4: samples 0-3 in micro-batch 0, which leaves stage 1 (of 2) at tick 2
    assert completion_ticks([4, 4, 4, 4], 4, 2) == [2, 3, 4, 5]
    assert completion_ticks([3, 5, 2, 6], 4, 2) == [2, 3, 4, 5]  # requests straddle micro-batches
    assert completion_ticks([1, 1, 1], 2, 3) == [3, 3, 4]  # two requests share micro-batch 0
    assert completion_ticks([10], 3, 2) == [5]  # four micro-batches, the last one short
    assert completion_ticks([8, 8], 4, 1) == [2, 4]


def test_a_serving_gantt_names_only_the_ops_it_draws():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook import viz

    window = [[pp.OpRecord("F", k, k, k + 1) for k in range(3)] for _ in range(2)]
    names = lambda ax: [t.get_text() for t in ax.get_legend().get_texts()]  # noqa: E731
    assert names(viz.gantt(window)) == ["forward", "backward"]  # training charts: as before
    assert names(viz.gantt(window, legend_present_only=True)) == ["forward"]
    plt.close("all")
