"""Chapter 5's exercise checkers: right answers pass, unanswered ones are "not attempted", and
planted bugs are caught with a message that says what is wrong: a layer count without biases,
LayerNorms, the output projection, one or both feed-forward biases or the LayerNorms' shifts, or
with 4 d_model for d_ff, or taken from torch's decoder layer or the library's estimator; training
state without gradients, with one Adam moment, with mixed precision as all 16-bit, with bf16
moments in fp32;
a largest batch that is one too many, one too few, strictly below the device (< for <=), or
ignores that nothing fits."""

from dataclasses import replace

import pytest
from torch import nn

from dmlbook import models
from dmlbook.exercises import ExerciseFailed, ch05
from dmlbook.model_parallel import memory

# Answers that only call the library (test_back_doors.py): each must be refused.
DELEGATING_ANSWERS = {
    "layer_parameters": lambda h, f: models.count_parameters(
        nn.TransformerEncoderLayer(h, 1, dim_feedforward=f)
    ),
    "training_state_bytes": lambda n, precision, optimizer: (
        n * sum(memory.state_bytes_per_parameter(precision, optimizer).values())
    ),
    "largest_batch": lambda spec, seq, device_bytes: memory.largest_batch(spec, seq, device_bytes),
}


def unanswered(*args):
    raise NotImplementedError


# ---- 1. parameters of a layer ------------------------------------------------------------------


def count(h, f):
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def count_without_biases(h, f):
    return 4 * h * h + 2 * h * f + 4 * h


def count_without_layernorms(h, f):
    return 4 * h * h + 4 * h + 2 * h * f + f + h


def count_without_output_projection(h, f):
    return 3 * h * h + 3 * h + 2 * h * f + f + h + 4 * h


def count_with_4h(h, f):
    return count(h, 4 * h)


def count_without_first_feed_forward_bias(h, f):
    return count(h, f) - f


def count_without_one_d_model_bias(h, f):
    return count(h, f) - h


def count_returning_a_float(h, f):
    return float(count(h, f))


def test_layer_parameters_passes_the_right_answer():
    assert ch05.check_layer_parameters(count).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (count_without_biases, "you left out the biases"),
        (count_without_layernorms, "you left out the two LayerNorms"),
        (count_without_output_projection, "output projection"),
        (count_with_4h, "the feed-forward width is d_ff, not 4 d_model"),
        (count_without_first_feed_forward_bias, "first feed-forward layer's bias"),
        (count_without_one_d_model_bias, "one d_model-sized bias"),
        (count_returning_a_float, "must return an int"),
    ],
)
def test_layer_parameters_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch05.check_layer_parameters(answer)


# ---- 2. bytes of training state ----------------------------------------------------------------

BYTES = {"fp32": 4, "bf16": 2, "mixed": 4}
BUFFERS = {"sgd": 0, "sgd_momentum": 1, "adam": 2}


def state_bytes(n, precision, optimizer):
    return n * BYTES[precision] * (2 + BUFFERS[optimizer])


def state_bytes_without_gradients(n, precision, optimizer):
    return n * BYTES[precision] * (1 + BUFFERS[optimizer])


def state_bytes_adam_one_moment(n, precision, optimizer):
    return n * BYTES[precision] * (2 + min(BUFFERS[optimizer], 1))


def state_bytes_mixed_all_16_bit(n, precision, optimizer):
    per = 2 if precision == "mixed" else BYTES[precision]
    return n * per * (2 + BUFFERS[optimizer])


def state_bytes_bf16_moments_in_fp32(n, precision, optimizer):
    return n * (2 * BYTES[precision] + 4 * BUFFERS[optimizer])


def test_training_state_bytes_passes_the_right_answer():
    assert ch05.check_training_state_bytes(state_bytes).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (state_bytes_without_gradients, "Weights AND gradients"),
        (state_bytes_adam_one_moment, "Adam keeps two moments"),
        (state_bytes_mixed_all_16_bit, "keeps fp32 weights, gradients and optimizer moments"),
        (state_bytes_bf16_moments_in_fp32, "optimizer state is bf16 too"),
    ],
)
def test_training_state_bytes_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch05.check_training_state_bytes(answer)


# ---- 3. largest batch --------------------------------------------------------------------------


def largest(spec, seq, device_bytes):
    batch = 0
    while memory.estimate(spec, batch + 1, seq).total <= device_bytes:
        batch += 1
    return batch


def largest_one_too_many(spec, seq, device_bytes):
    return largest(spec, seq, device_bytes) + 1


def largest_one_too_few(spec, seq, device_bytes):
    return max(0, largest(spec, seq, device_bytes) - 1)


def largest_at_least_one(spec, seq, device_bytes):
    return max(1, largest(spec, seq, device_bytes))


def largest_from_activations_only(spec, seq, device_bytes):
    """Scales batch 1's activations, forgetting the weights, gradients and optimizer state."""
    one = memory.estimate(spec, 1, seq)
    return int(device_bytes // (one.activations + one.transient))


def test_largest_batch_passes_the_right_answer():
    assert ch05.check_largest_batch(largest).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (largest_one_too_many, r"more than the device has \(off by one\?\)"),
        (largest_one_too_few, "you stopped one short"),
        (largest_at_least_one, "batch 1 needs"),
        (largest_from_activations_only, "more than the device has"),
    ],
)
def test_largest_batch_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch05.check_largest_batch(answer)


def count_by_building_the_layer(h, f):
    """A back door: build torch's layer and count what it holds (no library counter called)."""
    return sum(p.numel() for p in nn.TransformerEncoderLayer(h, 1, dim_feedforward=f).parameters())


def test_layer_parameters_refuses_a_built_layer():
    with pytest.raises(ExerciseFailed, match="called the library instead.*TransformerEncoderLayer"):
        ch05.check_layer_parameters(count_by_building_the_layer)


def test_unanswered_exercises_are_not_attempted():
    assert ch05.check_layer_parameters(unanswered).status == "not attempted"
    assert ch05.check_training_state_bytes(unanswered).status == "not attempted"
    assert ch05.check_largest_batch(unanswered).status == "not attempted"


def count_from_a_decoder_layer(h, f):
    """A back door: torch's decoder layer less its cross-attention and third LayerNorm."""
    layer = nn.TransformerDecoderLayer(h, 1, dim_feedforward=f)
    skip = {id(p) for m in (layer.multihead_attn, layer.norm3) for p in m.parameters()}
    return sum(p.numel() for p in layer.parameters() if id(p) not in skip)


def count_from_the_estimator(h, f):
    """A back door: the estimator's parameters of two layers less those of one."""
    spec = memory.TransformerSpec("probe", 1, 1, 1, h, 1, f, "encoder", dropout=0.0)
    one = memory.estimate(spec, 1, 1).parameters
    two = memory.estimate(replace(spec, n_layer=2), 1, 1).parameters
    return (two - one) // 4


def count_from_gemm_flops(h, f):
    """A back door: a layer's GEMM FLOPs for one token are twice its weights."""
    return sum(memory.layer_gemm_flops(h, f, batch=1, seq=1).values()) // 2 + 9 * h + f


@pytest.mark.parametrize(
    "answer, switched",
    [
        (count_from_a_decoder_layer, "TransformerDecoderLayer"),
        (count_from_the_estimator, "estimate"),
        (count_from_gemm_flops, "layer_gemm_flops"),
    ],
)
def test_layer_parameters_refuses_other_library_counts(answer, switched):
    with pytest.raises(ExerciseFailed, match=f"called the library instead.*{switched}"):
        ch05.check_layer_parameters(answer)


@pytest.mark.parametrize(
    "answer, message",
    [
        (lambda h, f: count(h, f) - 2 * h, "each LayerNorm also has a shift"),
        (lambda h, f: count(h, f) - f - h, "feed-forward layers' biases"),
    ],
)
def test_layer_parameters_names_the_cause_of_more_wrong_counts(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch05.check_layer_parameters(answer)


def largest_strictly_below(spec, seq, device_bytes):
    """Treats a total equal to the device's memory as not fitting."""
    batch = 0
    while memory.estimate(spec, batch + 1, seq).total < device_bytes:
        batch += 1
    return batch


def test_largest_batch_catches_a_strict_comparison():
    with pytest.raises(ExerciseFailed, match=r"<=, not <"):
        ch05.check_largest_batch(largest_strictly_below)
