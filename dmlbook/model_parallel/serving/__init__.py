"""Serving: data-parallel inference (chapter 3), and making a model cheaper to train and serve
(chapter 8, "Achieving higher throughput and lower latency").

- ``data_parallel``: :func:`predict` splits the requests over the ranks and gathers the outputs
  in order, each rank serving its block of ``comm.groups.balanced_blocks`` (chapter 3).
- ``layers``: a model seen as a plain list of layers, the unit that chapter 8 freezes, streams
  from disk and decomposes.
- ``freezing``: frozen layers compute no weight gradient and, as a prefix, save no activation.
- ``offload``: parameters streamed from a memory-mapped file one layer at a time, and Adam state
  kept off the device (in CPU memory or on disk) and streamed in per layer.
- ``lowrank``: truncated-SVD factorisation of linear layers, accuracy and speed against rank.
- ``distillation``: a small student trained on a teacher's softened outputs (Hinton et al. 2015).
- ``reduced_precision``: fp16, bf16 and int8 inference side by side: bytes, accuracy, latency.
"""

from dmlbook.data_parallel.serving import predict
from dmlbook.model_parallel.serving import (
    distillation,
    freezing,
    layers,
    lowrank,
    offload,
    reduced_precision,
)

__all__ = [
    "distillation",
    "freezing",
    "layers",
    "lowrank",
    "offload",
    "predict",
    "reduced_precision",
]
