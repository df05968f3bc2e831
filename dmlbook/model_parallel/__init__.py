"""Model parallelism: the model split between ranks (chapters 5-8).

* ``memory``: what a training step holds, estimated and measured (chapter 5)
* ``recompute``: activation checkpointing by hand and with torch (chapters 4 and 5)
* ``pipeline``: layer split, vanilla / GPipe / 1F1B schedules as data, one executor (chapter 6)
* ``stage_balancing``: stages cut by measured cost, a linear-partition DP (chapter 7)
* ``pipeline_workflows``: pipelined training on and off, fine-tuning and serving (chapter 7)
* ``serving``: freezing, offload, low-rank, distillation, quantization and reduced-precision
  inference (chapter 8)
"""
