"""Tests for dmlbook.model_parallel.memory: the estimator against memory measured in real training
steps of our char-GPT (on CPU: bytes of parameters, gradients and optimizer state as allocated,
saved tensors, the allocator's peak; on CUDA: the allocator), against published model sizes,
against torch's own
layers, against Korthikanti et al.'s formula, and per pipeline stage on real ranks."""

from __future__ import annotations

import dataclasses
import resource

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dmlbook.launch import RankError, run
from dmlbook.model_parallel import memory
from dmlbook.models import char_gpt, count_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 0.10  # the bound: |estimate - measured| / measured, per component and total

# (name, char_gpt kwargs, batch, seq, measure/estimate options): batch, sequence length, depth,
# width, precision, optimizer, dropout (the math attention path) and recomputation all vary.
CONFIGS = [
    ("fp32 adam", dict(n_layer=2, n_embd=64, n_head=4, block_size=64), 8, 64, {}),
    ("fp32 short seq", dict(n_layer=2, n_embd=64, n_head=4, block_size=64), 16, 24, {}),
    ("fp32 deep narrow sgd", dict(n_layer=6, n_embd=32, n_head=2, block_size=32), 12, 32,
     dict(optimizer="sgd")),
    ("fp32 wide momentum", dict(n_layer=1, n_embd=128, n_head=8, block_size=32), 4, 32,
     dict(optimizer="sgd_momentum")),
    ("bf16 adam", dict(n_layer=3, n_embd=64, n_head=4, block_size=48), 6, 48,
     dict(precision="bf16")),
    ("mixed adam", dict(n_layer=2, n_embd=96, n_head=4, block_size=32), 8, 32,
     dict(precision="mixed")),
    ("fp32 dropout (math attention)", dict(n_layer=2, n_embd=64, n_head=4, block_size=32,
                                           dropout=0.1), 8, 32, {}),
    ("bf16 dropout (math attention)", dict(n_layer=2, n_embd=64, n_head=4, block_size=32,
                                           dropout=0.1), 8, 32, dict(precision="bf16")),
    ("fp32 no bias", dict(n_layer=2, n_embd=64, n_head=4, block_size=32, bias=False), 8, 32, {}),
    ("fp32 recompute sqrt(n)", dict(n_layer=6, n_embd=32, n_head=2, block_size=64), 8, 64,
     dict(recompute=True)),
    ("mixed recompute 2 segments", dict(n_layer=4, n_embd=64, n_head=4, block_size=32), 8, 32,
     dict(precision="mixed", recompute=2)),
]  # fmt: skip


def _relative_errors(est: memory.MemoryEstimate, got: memory.MemoryMeasurement) -> dict:
    predicted, measured = est.components(), got.components()
    errors = {
        k: abs(predicted[k] - measured[k]) / measured[k]
        for k in ("parameters", "gradients", "optimizer_state", "activations")
        if measured[k]
    }
    errors["total"] = abs(est.total - got.total) / got.total
    return errors


@pytest.mark.parametrize("name, kwargs, batch, seq, options", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_estimate_agrees_with_a_measured_step(name, kwargs, batch, seq, options):
    model = char_gpt(37, seed=1, **kwargs)
    got = memory.measure(model, batch, seq, **options)
    est = memory.estimate(memory.spec_of(model), batch, seq, **options)
    errors = _relative_errors(est, got)
    assert max(errors.values()) <= TOLERANCE, errors
    # Weights, gradients, optimizer state and saved activations are counted exactly ...
    for key in ("parameters", "gradients", "optimizer_state", "activations"):
        assert est.components()[key] == got.components()[key], key
    if not options.get("recompute"):  # ... and so is every layer's share of the activations.
        assert got.layer_activations == {layer.name: layer.activations for layer in est.layers}
    assert got.optimizer_state == 0 or options.get("optimizer", "adam") != "sgd"


def test_measurement_is_not_the_estimate_in_disguise():
    """The measurement sees real tensors: a model with an extra saved tensor per block, which
    the estimator knows nothing about, measures more."""
    model = char_gpt(37, seed=1, n_layer=2, n_embd=64, n_head=4, block_size=32)
    plain = memory.measure(model, 8, 32).activations
    for block in model.blocks:
        # a LayerNorm after the GELU keeps its input, and its output is the next matmul's input
        block.mlp.gelu = nn.Sequential(nn.GELU(), nn.LayerNorm(256))
    tokens = 8 * 32
    extra_per_block = tokens * 256 * 4 + 2 * tokens * 4  # one more (tokens, 256) and LN stats
    assert memory.measure(model, 8, 32).activations == plain + 2 * extra_per_block
    assert memory.measure(model, 8, 32, optimizer="adam").optimizer_state > 0


def test_bf16_halves_the_fp32_state_and_activations():
    spec = memory.spec_of(char_gpt(37, n_layer=2, n_embd=64, n_head=4, block_size=32))
    fp32, bf16 = memory.estimate(spec, 8), memory.estimate(spec, 8, precision="bf16")
    assert bf16.parameters * 2 == fp32.parameters and bf16.gradients * 2 == fp32.gradients
    # attention's log-sum-exp stays fp32: a little more than half
    assert 0.5 < bf16.activations / fp32.activations < 0.52
    mixed = memory.estimate(spec, 8, precision="mixed")
    assert mixed.parameters == fp32.parameters and mixed.activations < fp32.activations


def test_cpu_peak_bytes_reads_the_allocator():
    def step():
        a = torch.empty(1 << 20)  # 4 MiB
        b = torch.empty(1 << 19)  # 2 MiB while a is alive
        del a, b
        torch.empty(1 << 20)  # 4 MiB again, after both were freed

    assert memory.cpu_peak_bytes(step) == 6 << 20


# ---- Parameter counts: published sizes and torch's own layers ------------------------------------


def test_presets_have_their_published_parameter_counts():
    # bert-base-uncased and bert-large-uncased with pooler, plus a 2-label classifier; GPT-2
    # with tied output layer; BERT-Tiny (2 layers, 128 wide).
    published = {
        "BERT-Tiny": 4_385_920 + 258,
        "BERT-base": 109_482_240 + 1_538,
        "BERT-large": 335_141_888 + 2_050,
        "GPT-2 small": 124_439_808,
        "GPT-2 medium": 354_823_168,
        "GPT-2 large": 774_030_080,
        "GPT-2 XL": 1_557_611_200,
    }
    assert {s.name: memory.spec_parameters(s) for s in memory.PRESETS} == published


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_layer, n_embd, n_head", [(1, 16, 2), (3, 48, 4), (2, 96, 6)])
def test_spec_of_counts_the_char_gpt_parameters(n_layer, n_embd, n_head, bias):
    model = char_gpt(29, n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=20, bias=bias)
    spec = memory.spec_of(model)
    assert memory.spec_parameters(spec) == count_parameters(model)
    # the estimate's parameter bytes are the tensors' bytes, layer by layer
    est = memory.estimate(spec, 2, 20)
    assert est.parameters == sum(p.nbytes for p in model.parameters())


@pytest.mark.parametrize("d_model, n_head, d_ff", [(64, 4, 256), (96, 3, 200), (768, 12, 3072)])
def test_a_block_has_the_parameters_of_torchs_encoder_layer(d_model, n_head, d_ff):
    spec = dataclasses.replace(memory.BERT_BASE, d_model=d_model, n_head=n_head, d_ff=d_ff)
    one_more = dataclasses.replace(spec, n_layer=spec.n_layer + 1)
    layer = nn.TransformerEncoderLayer(d_model, n_head, dim_feedforward=d_ff)
    assert memory.spec_parameters(one_more) - memory.spec_parameters(spec) == count_parameters(
        layer
    )


def test_state_bytes_per_parameter():
    per = memory.state_bytes_per_parameter
    assert sum(per("fp32", "sgd").values()) == 8
    assert sum(per("fp32", "sgd_momentum").values()) == 12
    assert sum(per("fp32", "adam").values()) == 16
    assert sum(per("mixed", "adam").values()) == 16  # = ZeRO's 2 + 2 + 12
    assert sum(per("bf16", "adam").values()) == 8


# ---- The published formula, the book's worked example, FLOPs -----------------------------------


@pytest.mark.parametrize(
    "batch, seq, spec", [(4, 1024, memory.GPT2_SMALL), (2, 512, memory.BERT_LARGE)]
)
def test_korthikanti_formula_is_our_count_in_their_setting(batch, seq, spec):
    """16-bit activations, 1-byte dropout masks (CUDA), explicit softmax: s b h (34 + 5 a s / h)
    per layer, which leaves out only the LayerNorms' statistics."""
    spec = dataclasses.replace(spec, dropout=0.1)
    ours = sum(memory.block_saved_terms(spec, batch, seq, "bf16", "math", "cuda").values())
    layernorm_stats = 2 * 2 * batch * seq * 4  # mean and 1/std of 2 LayerNorms, fp32 on CUDA
    assert ours == memory.korthikanti_bytes(seq, batch, spec.d_model, spec.n_head) + layernorm_stats
    fused = sum(memory.block_saved_terms(spec, batch, seq, "bf16", "fused", "cuda").values())
    assert fused < ours / 2  # flash attention drops the s x s terms


def test_bert_base_runs_out_of_16_gb_where_bert_tiny_fits_easily():
    gpu = 16 * 2**30
    setting = dict(precision="fp32", optimizer="adam", attention="math", device="cuda")
    base = memory.estimate(memory.BERT_BASE, 32, 512, **setting)
    tiny = memory.estimate(memory.BERT_TINY, 32, 512, **setting)
    assert not base.fits(gpu) and base.total > 1.3 * gpu
    assert tiny.fits(gpu) and tiny.total < 0.05 * gpu
    largest = memory.largest_batch(memory.BERT_BASE, 512, gpu, **setting)
    assert 8 <= largest < 32
    assert memory.estimate(memory.BERT_BASE, largest, 512, **setting).fits(gpu)
    assert not memory.estimate(memory.BERT_BASE, largest + 1, 512, **setting).fits(gpu)
    assert memory.largest_batch(memory.BERT_LARGE, 512, 1e9, **setting) == 0


def test_layer_gemm_flops_match_torchs_flop_counter():
    model = char_gpt(50, n_layer=1, n_embd=64, n_head=4, block_size=32)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.blocks[0](torch.randn(3, 32, 64))
    assert counter.get_total_flops() == sum(memory.layer_gemm_flops(64, 256, 3, 32).values())


def test_dgx1_hybrid_cube_mesh_uses_four_links_per_gpu():
    links = memory.DGX1_NVLINK
    assert len(links) == 16
    assert all(sum(g in link for link in links) == 4 for g in range(8))
    assert {g.name for g in memory.GPUS} >= {"P100", "V100", "A100", "H100"}


# ---- Recomputation and pipeline stages ---------------------------------------------------------


def test_recompute_one_segment_is_plain_backprop_and_sqrt_n_saves_most():
    spec = memory.spec_of(char_gpt(37, n_layer=16, n_embd=64, n_head=4, block_size=64))
    plain = memory.estimate(spec, 8)
    assert memory.estimate(spec, 8, recompute=1).activations == plain.activations
    sqrt_n = memory.estimate(spec, 8, recompute=True)
    assert sqrt_n.recompute_segments == 4 and sqrt_n.activations < 0.45 * plain.activations
    assert sqrt_n.parameters == plain.parameters


def test_stages_split_the_layers():
    from dmlbook.model_parallel import pipeline

    spec = memory.spec_of(char_gpt(37, n_layer=6, n_embd=64, n_head=4, block_size=32))
    whole = memory.estimate(spec, 8)
    for stages in (2, 3):
        parts = memory.estimate_stages(spec, 8, stages=stages)
        assert [len(p.layers) for p in parts] == pipeline.even_partition(8, stages)
        for key in ("parameters", "gradients", "optimizer_state", "activations"):
            assert sum(getattr(p, key) for p in parts) == getattr(whole, key)
        fullest = memory.estimate(spec, 8, stages=stages)
        assert fullest.total == max(p.total for p in parts) and len(fullest.stages) == stages
        assert fullest.total < 0.7 * whole.total
    with pytest.raises(ValueError, match="summing to 8"):
        memory.estimate_stages(spec, 8, stages=2, counts=[3, 3])


def test_each_pipeline_stage_measures_what_the_estimator_predicts():
    """Real ranks at 2 and 3 stages (a non-power of two): every stage's parameters, gradients,
    optimizer state and saved activations as estimated, and its total within 10%."""
    from dmlbook.model_parallel import pipeline

    model = char_gpt(37, seed=2, n_layer=4, n_embd=64, n_head=4, block_size=32)
    spec = memory.spec_of(model)
    for stages in (2, 3):
        measured = run(memory.measure_stage, stages, model, 8, 32)
        counts = pipeline.even_partition(spec.n_layer + 2, stages)
        predicted = memory.estimate_stages(spec, 8, 32, stages, counts)
        for got, est in zip(measured, predicted, strict=True):
            errors = _relative_errors(est, got)
            assert max(errors.values()) <= TOLERANCE, (stages, est.stage, errors)
            assert est.activations == got.activations and est.parameters == got.parameters
        whole = memory.estimate(spec, 8, 32)
        assert sum(g.parameters for g in measured) == whole.parameters
        # the measured step's time line: one F and one B per stage, the vanilla order
        ops = [[(r.op, r.microbatch) for r in g.timeline] for g in measured]
        assert ops == [[("F", 0), ("B", 0)]] * stages
        for left, right in zip(measured, measured[1:], strict=False):
            assert right.timeline[0].start >= left.timeline[0].end  # forward: left first
            assert left.timeline[1].start >= right.timeline[1].end  # backward: right first


# ---- A small device: the memory cap ------------------------------------------------------------


def _cap_checks(budget: int) -> dict:
    """Inside a rank: fits under the cap, fails past it with OutOfMemoryError, limit restored."""
    limit_before = resource.getrlimit(resource.RLIMIT_DATA)
    with memory.memory_cap(budget):
        x = torch.ones(budget // 2, dtype=torch.uint8)  # half the budget
        del x
    try:
        with memory.memory_cap(budget):
            torch.ones(2 * budget, dtype=torch.uint8)
        error = None
    except torch.OutOfMemoryError as e:
        error = str(e)
    with memory.memory_cap(budget):
        try:
            with memory.memory_cap(budget):
                raise ValueError("not a memory problem")
        except ValueError as e:
            other = str(e)
    return dict(
        error=error, other=other,
        restored=resource.getrlimit(resource.RLIMIT_DATA) == limit_before,
    )  # fmt: skip


def test_memory_cap_turns_an_oversized_allocation_into_out_of_memory():
    budget = 64 << 20
    (result,) = run(_cap_checks, 1, budget)
    assert result["error"] is not None and "out of memory" in result["error"], result
    assert "67.11 MB" in result["error"]
    assert result["other"] == "not a memory problem" and result["restored"]


def test_memory_cap_refuses_to_run_in_the_callers_process():
    with pytest.raises(RuntimeError, match="only runs inside a rank"):
        with memory.memory_cap(1 << 30):
            pass


def _oversized_step(budget: int) -> None:
    model = char_gpt(37, n_layer=2, n_embd=64, n_head=4, block_size=64)
    with memory.memory_cap(budget):
        memory.measure(model, 64, 64)


def test_an_oversized_step_fails_on_its_rank_with_out_of_memory():
    with pytest.raises(RankError) as failure:
        run(_oversized_step, 1, 8 << 20)
    assert isinstance(failure.value.__cause__, torch.OutOfMemoryError)


# ---- Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(precision="fp16"), "precision must be one of"),
        (dict(optimizer="adamw"), "optimizer must be one of"),
        (dict(attention="flash"), "attention must be one of"),
        (dict(device="tpu"), "device must be one of"),
        (dict(batch=0), "batch must be an integer"),
        (dict(seq=513), "exceeds BERT-base's 512 positions"),
        (dict(recompute=-1), "recompute must be"),
        (dict(stages=15), "cannot split 14 layers into 15"),
    ],
)
def test_bad_input_is_a_value_error(kwargs, message):
    args = dict(spec=memory.BERT_BASE, batch=2, seq=128) | kwargs
    with pytest.raises(ValueError, match=message):
        memory.estimate(**args)


def test_bad_specs_are_value_errors():
    with pytest.raises(ValueError, match="must divide"):
        dataclasses.replace(memory.GPT2_SMALL, n_head=5)
    with pytest.raises(ValueError, match="kind must be"):
        dataclasses.replace(memory.GPT2_SMALL, kind="seq2seq")
    with pytest.raises(TypeError, match="reads a CharGPT"):
        memory.spec_of(nn.Linear(2, 2))


# ---- GPU: the CUDA allocator -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_agrees_with_the_cuda_allocator(precision):
    """On a GPU the allocator sees everything: weights, gradients and optimizer state as
    allocated, the saved tensors, and the step's peak (cuda_peak_bytes)."""
    model = char_gpt(96, seed=0, n_layer=4, n_embd=256, n_head=8, block_size=256)
    got = memory.measure(model, 16, 256, precision=precision, device="cuda")
    est = memory.estimate(memory.spec_of(model), 16, 256, precision=precision, device="cuda")
    errors = _relative_errors(est, got)
    assert max(errors.values()) <= TOLERANCE, errors


def test_memory_timeline_follows_forward_backward_and_the_optimizer_step():
    model = char_gpt(37, seed=2, n_layer=2, n_embd=32, n_head=4, block_size=16)
    records = memory.memory_timeline(model, 4, steps=2)
    est = memory.estimate(memory.spec_of(model), 4)
    loss = [r for r in records if r["event"] == "loss"]
    done = [r for r in records if r["event"] == "backward done"]
    assert len(loss) == len(done) == 2
    # forward: saved activations grow up to (about) the estimate; backward frees them all
    assert all(0.9 * est.activations <= r["activations"] <= est.activations for r in loss)
    assert all(r["activations"] == 0 and r["gradients"] == r["parameters"] for r in done)
    # Adam: no state until the first optimizer step, then two moments; zero_grad frees gradients
    first = next(i for i, r in enumerate(records) if r["optimizer_state"])
    assert records[first]["event"] == "optimizer step" and records[first]["step"] == 0
    moments = 2 * records[first]["parameters"]  # plus Adam's one-number step counters
    assert moments <= records[first]["optimizer_state"] <= 1.01 * moments
    assert all(r["gradients"] == 0 for r in records if r["event"] == "zero_grad")
