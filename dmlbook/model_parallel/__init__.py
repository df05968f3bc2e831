"""Model parallelism: the model split between ranks (chapters 5-8).

* ``memory``: what a training step holds, estimated and measured (chapter 5)
* ``recompute``: activation checkpointing by hand and with torch (chapters 4 and 5)
* ``layer_split``: a model as a chain of layers, cut into stages (chapter 6)
* ``schedules``: vanilla / GPipe / 1F1B schedules as data, and beyond the book interleaved 1F1B
  (virtual stages) and zero-bubble ZB-H1; the timelines a run records (chapter 6)
* ``backward_split``: backward split into the input gradient (B) and the weight gradient (W), on
  one linear layer and on any module (ZB-H1's split; beyond chapter 6)
* ``pipeline``: one executor for any schedule, one stage (or v model chunks) per rank; gives the
  two above's names too (chapter 6)
* ``stage_balancing``: stages cut by measured cost, a linear-partition DP (chapter 7)
* ``pipeline_workflows``: pipelined training on and off, fine-tuning (chapter 7)
* ``pipeline_serving``: a stream of requests through overlapping stages (chapter 7)
* ``efficiency``: a model made cheaper to train and serve without splitting it: freezing,
  offload, low-rank, distillation, quantization and reduced-precision inference (chapter 8)
"""
