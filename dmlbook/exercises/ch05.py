"""Checkers for chapter 5's exercises ("Splitting the model").

1. ``check_layer_parameters``: write ``count(d_model, d_ff) -> int``, the parameters of one
   transformer layer (BERT's or GPT's, with biases): the q, k, v and output projections, the
   two feed-forward matrices and two LayerNorms. Checked against torch's own
   ``nn.TransformerEncoderLayer``, which is switched off while the learner's count runs, with
   torch's other transformer layers, the library's counters and the estimator functions whose
   output hides a layer's count (a count is the learner's sum of the parts, not a built layer's).
2. ``check_training_state_bytes``: write ``state_bytes(n_params, precision, optimizer) -> int``,
   the bytes of weights, gradients and optimizer state for ``precision`` in fp32 / bf16 / mixed
   and ``optimizer`` in sgd / sgd_momentum / adam (Adam's step counter aside); mixed precision
   keeps fp32 weights, gradients and moments, as ``torch.autocast`` does
   (:func:`dmlbook.model_parallel.memory.state_bytes_per_parameter`).
3. ``check_largest_batch``: write ``largest(spec, seq, device_bytes) -> int``, the largest batch
   whose ``dmlbook.model_parallel.memory.estimate(spec, batch, seq).total`` fits in
   ``device_bytes`` (0 if even one sample does not; a total equal to ``device_bytes`` fits), as
   :func:`dmlbook.model_parallel.memory.largest_batch` finds it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dmlbook.exercises import ExerciseFailed, checker, learner_code, switched_off
from dmlbook.model_parallel import memory
from dmlbook.models import count_parameters

__all__ = ["check_largest_batch", "check_layer_parameters", "check_training_state_bytes"]


def _layer_mistakes(h: int, f: int) -> dict[int, str]:
    """Common wrong counts of one layer, each with the hint that explains it."""
    weights = 4 * h * h + 2 * h * f  # q, k, v, output projection; the two feed-forward layers
    biases = 4 * h + f + h
    norms = 4 * h  # two LayerNorms, each a scale and a shift per feature
    right = weights + biases + norms
    mistakes = {
        weights + norms: "you left out the biases (the q, k, v and output projections have "
        "4 d_model, the feed-forward layers d_ff + d_model)",
        weights + biases: "you left out the two LayerNorms (a scale and a shift each: 4 d_model)",
        weights: "you counted only the weight matrices: add the biases and the two LayerNorms",
        right - h * h - h: "you left out the attention's output projection (d_model^2 + d_model)",
        right - f: "you left out the first feed-forward layer's bias (d_ff numbers)",
        right - h: "you left out one d_model-sized bias (the output projection's or the second "
        "feed-forward layer's)",
        right - f - h: "you left out the feed-forward layers' biases (d_ff for the first, d_model "
        "for the second)",
        right - 2 * h: "you counted only the LayerNorms' scales: each LayerNorm also has a shift "
        "(a bias) per feature, 2 d_model per LayerNorm",
    }
    if f != 4 * h:  # the width every BERT and GPT happens to use, but not the argument
        mistakes[12 * h * h + 13 * h] = "the feed-forward width is d_ff, not 4 d_model"
    mistakes.pop(right, None)
    return mistakes


# Library functions whose output hides a layer's count, though they do other jobs (the chapter
# calls them for those): switched off inside the learner's count as well, without being named
# as the exercise's answer.
_LAYER_COUNT_BACK_DOORS = (
    "dmlbook.model_parallel.memory.estimate",
    "dmlbook.model_parallel.memory.estimate_stages",
    "dmlbook.model_parallel.memory.layer_gemm_flops",
    "dmlbook.model_parallel.memory.block_saved_terms",
    "dmlbook.model_parallel.memory.largest_batch",
)


@checker(
    "layer_parameters",
    writes=(
        "dmlbook.model_parallel.memory.spec_parameters",
        "dmlbook.models.count_parameters",
        "torch.nn.TransformerEncoderLayer",
        "torch.nn.TransformerDecoderLayer",
        "torch.nn.Transformer",
    ),
)
def check_layer_parameters(fn: Callable[[int, int], int]) -> str:
    """Check ``fn(d_model, d_ff)`` against the parameters of ``nn.TransformerEncoderLayer``."""
    # (96, 200) first: with d_ff = 4 d_model, leaving out d_ff biases looks like leaving out the
    # LayerNorms (4 d_model), and the hint would name the wrong cause
    cases = [(96, 200), (64, 256), (768, 3072), (1024, 4096), (10, 7)]
    for h, f in cases:
        want = count_parameters(nn.TransformerEncoderLayer(h, 1, dim_feedforward=f))
        with learner_code(f"your count({h}, {f})"), switched_off(_LAYER_COUNT_BACK_DOORS, fn):
            got = fn(h, f)
        if not isinstance(got, int) or isinstance(got, bool):
            raise ExerciseFailed(f"count({h}, {f}) must return an int, got {type(got).__name__}")
        if got == want:
            continue
        why = _layer_mistakes(h, f).get(got)
        hint = f": {why}" if why else ""
        raise ExerciseFailed(
            f"a layer with d_model={h}, d_ff={f} has {want:,} parameters (torch's "
            f"TransformerEncoderLayer), your count is {got:,}{hint}"
        )
    return f"{len(cases)} layer shapes match torch's TransformerEncoderLayer, BERT-base's included"


@checker(
    "training_state_bytes", writes=("dmlbook.model_parallel.memory.state_bytes_per_parameter",)
)
def check_training_state_bytes(fn: Callable[[int, str, str], int]) -> str:
    """Check ``fn(n_params, precision, optimizer)`` for every precision and optimizer."""
    sizes = [1, 1000, 109_482_240]
    for precision in memory.PRECISIONS:
        for optimizer in memory.OPTIMIZERS:
            per = memory.state_bytes_per_parameter(precision, optimizer)
            for n in sizes:
                want = n * sum(per.values())
                with learner_code(f"your state_bytes({n}, {precision!r}, {optimizer!r})"):
                    got = fn(n, precision, optimizer)
                if got == want:
                    continue
                p = per["parameters"]
                hint = ""
                if precision == "mixed" and got == want // 2:
                    hint = (
                        ": mixed precision computes in 16 bits but keeps fp32 weights, "
                        "gradients and optimizer moments (autocast casts on the fly)"
                    )
                elif got == want - n * p:
                    hint = (
                        ": one parameter-sized buffer is missing. Weights AND gradients; "
                        "Adam keeps two moments (m and v), momentum one"
                    )
                elif precision == "bf16" and got == n * (2 * p + 4 * (per["optimizer_state"] // p)):
                    hint = ": a bf16 model's optimizer state is bf16 too (2 bytes per number)"
                elif got == want - n * per["optimizer_state"]:
                    hint = ": you left out the optimizer state"
                raise ExerciseFailed(
                    f"{n:,} parameters in {precision} with {optimizer} keep {want:,} bytes of "
                    f"weights, gradients and optimizer state; you said {got:,}{hint}"
                )
    return (
        "3 precisions x 3 optimizers x 3 model sizes, BERT-base's (16 bytes a parameter with Adam)"
    )


@checker("largest_batch", writes=("dmlbook.model_parallel.memory.largest_batch",))
def check_largest_batch(fn: Callable[[memory.TransformerSpec, int, float], int]) -> str:
    """Check ``fn(spec, seq, device_bytes)`` against
    :func:`dmlbook.model_parallel.memory.largest_batch`."""
    exact = memory.estimate(memory.GPT2_SMALL, 6, 256).total  # batch 6 fills it to the byte
    cases = [
        (memory.BERT_BASE, 128, 16 * 2**30),
        (memory.GPT2_SMALL, 256, exact),  # a total equal to the device's bytes fits
        (memory.BERT_TINY, 512, 2**30),
        (memory.GPT2_SMALL, 1024, 24 * 2**30),
        (memory.BERT_LARGE, 512, 2 * 2**30),  # not even one sample fits
    ]
    for spec, seq, device_bytes in cases:
        want = memory.largest_batch(spec, seq, device_bytes)
        where = f"{spec.name} at seq {seq} on {memory.format_bytes(device_bytes)}"
        with learner_code(f"your largest({spec.name}, {seq}, {device_bytes})"):
            got = fn(spec, seq, device_bytes)
        if got == want:
            continue
        if not isinstance(got, int) or isinstance(got, bool) or got < 0:
            raise ExerciseFailed(f"{where}: return a batch size >= 0 (an int), got {got!r}")
        if got > 0 and not memory.estimate(spec, got, seq).fits(device_bytes):
            need = memory.estimate(spec, got, seq).total
            raise ExerciseFailed(
                f"{where}: batch {got} needs {memory.format_bytes(need)}, more than the device "
                f"has{' (off by one?)' if got == want + 1 else ''}. The answer is {want}"
            )
        short = ""
        if got == want - 1 and memory.estimate(spec, want, seq).total == device_bytes:
            short = (
                f": batch {want} needs exactly the device's {device_bytes:,} bytes, and a total "
                "equal to the device's memory fits (<=, not <)"
            )
        elif got == want - 1:
            short = ": you stopped one short"
        raise ExerciseFailed(
            f"{where}: batch {got} fits, but so does batch {want} (the largest that does)" + short
        )
    return f"{len(cases)} models and devices, including one where not even batch 1 fits"
