"""Efficiency: making a model cheaper to train and serve (chapter 8, "Achieving higher throughput
and lower latency"). Chapter 8 closes the book's model-parallel part: the same problem as chapter
5's (a model too big or too slow for one device), answered here without splitting the model.
Chapter 3's data-parallel inference is :mod:`dmlbook.data_parallel.serving`; chapter 7's
pipelined serving is :mod:`dmlbook.model_parallel.pipeline_serving`.

- ``layers``: a model seen as a plain list of layers, the unit that chapter 8 freezes, streams
  from disk and decomposes.
- ``freezing``: frozen layers compute no weight gradient and, as a prefix, save no activation.
- ``offload``: parameters streamed from a memory-mapped file one layer at a time, and Adam state
  kept off the device (in CPU memory or on disk) and streamed in per layer.
- ``lowrank``: truncated-SVD factorisation of linear layers, accuracy and speed against rank.
- ``distillation``: a small student trained on a teacher's softened outputs (Hinton et al. 2015).
- ``reduced_precision``: fp16, bf16 and int8 inference side by side: bytes, accuracy, latency.
- ``quantization``: fp16 and int8 weights with their error, and an int8 x int8 matmul (chapters
  4, 8 and 10).
"""

from dmlbook.model_parallel.efficiency import (
    distillation,
    freezing,
    layers,
    lowrank,
    offload,
    quantization,
    reduced_precision,
)

__all__ = [
    "distillation",
    "freezing",
    "layers",
    "lowrank",
    "offload",
    "quantization",
    "reduced_precision",
]
