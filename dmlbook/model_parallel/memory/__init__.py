"""How much memory one training step of a transformer needs, predicted and then measured.

Chapter 5 ("Splitting the model") starts from an out-of-memory error: a model that will not train
on one device. Four things fill the device: the **parameters**, their **gradients**, the
**optimizer state** (nothing for SGD, one buffer for momentum, two for Adam) and the
**activations** that backward needs, which grow with batch and sequence length. The estimator
counts each one op by op, the way this PyTorch build saves tensors for backward, so that it can be
checked against our char-GPT on a CPU to within a few percent:

- ``TransformerSpec`` describes a BERT- or GPT-style model; ``BERT_TINY`` ... ``GPT2_XL`` are the
  published sizes and ``spec_of`` reads one off a ``CharGPT``.
- ``estimate`` predicts every component (per layer, per pipeline stage with ``stages=``, with
  recomputation or in bf16), ``largest_batch`` the biggest batch that fits a device, and
  ``block_saved_terms`` lists what one transformer block saves, tensor by tensor.
- ``measure`` runs a real step of a ``CharGPT`` and measures the same components: parameter,
  gradient and optimizer-state bytes as allocated, saved activations with
  :class:`dmlbook.model_parallel.recompute.SavedTensorMeter`, and the allocator's peak
  (``cpu_peak_bytes`` reads it from the profiler on a CPU,
  :func:`dmlbook.model_parallel.recompute.cuda_peak_bytes` on a GPU); ``measure_stage`` does it for
  one rank's stage of a model split over ranks, and ``memory_timeline`` records what a step holds
  moment by moment through forward, backward and the optimizer step.
- ``memory_cap`` turns a rank into a small device: past its budget, an allocation raises
  ``torch.OutOfMemoryError``, and the notebook that launched the rank is never at risk.
- ``korthikanti_bytes`` is the published per-layer formula (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models"): s b h (34 + 5 a s / h) bytes in fp16
  with dropout and an explicit softmax; ``estimate`` reproduces it in that setting exactly.
- ``layer_gemm_flops`` counts the matrix multiplies (D = A x B + C) of one layer, the work that
  Tensor Cores do, and ``GPUS`` / ``DGX1_NVLINK`` hold the hardware table of the chapter.

The parts, each a module of this package: ``spec`` (what a model is, bytes per number),
``estimate``, ``measure``, ``device_cap`` (the memory cap) and ``hardware`` (the GPU table);
the names above are importable from ``dmlbook.model_parallel.memory`` itself, while what the
parts share (per-layer parameter counts, bytes per precision, argument checks) stays in its
module. Chapter 5's picture of a
model split into stages is :func:`dmlbook.viz.model_split`.
"""

from dmlbook.model_parallel.memory.device_cap import (
    memory_cap,
    onednn_disabled,
)
from dmlbook.model_parallel.memory.estimate import (
    MemoryEstimate,
    block_saved_terms,
    estimate,
    estimate_stages,
    format_bytes,
    korthikanti_bytes,
    largest_batch,
    layer_gemm_flops,
)
from dmlbook.model_parallel.memory.hardware import (
    DGX1_NVLINK,
    GPU,
    GPUS,
)
from dmlbook.model_parallel.memory.measure import (
    MemoryMeasurement,
    cpu_peak_bytes,
    make_optimizer,
    measure,
    measure_stage,
    measure_step,
    memory_timeline,
)
from dmlbook.model_parallel.memory.spec import (
    ATTENTIONS,
    BERT_BASE,
    BERT_LARGE,
    BERT_TINY,
    COMPONENTS,
    DEVICES,
    GPT2_LARGE,
    GPT2_MEDIUM,
    GPT2_SMALL,
    GPT2_XL,
    OPTIMIZERS,
    PRECISIONS,
    PRESETS,
    TransformerSpec,
    spec_of,
    spec_parameters,
    state_bytes_per_parameter,
)

__all__ = [
    "ATTENTIONS",
    "BERT_BASE",
    "BERT_LARGE",
    "BERT_TINY",
    "COMPONENTS",
    "DEVICES",
    "DGX1_NVLINK",
    "GPT2_LARGE",
    "GPT2_MEDIUM",
    "GPT2_SMALL",
    "GPT2_XL",
    "GPU",
    "GPUS",
    "MemoryEstimate",
    "MemoryMeasurement",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRESETS",
    "TransformerSpec",
    "block_saved_terms",
    "cpu_peak_bytes",
    "estimate",
    "estimate_stages",
    "format_bytes",
    "korthikanti_bytes",
    "largest_batch",
    "layer_gemm_flops",
    "make_optimizer",
    "measure",
    "measure_stage",
    "measure_step",
    "memory_cap",
    "memory_timeline",
    "onednn_disabled",
    "spec_of",
    "spec_parameters",
    "state_bytes_per_parameter",
]
