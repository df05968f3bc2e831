"""dmlbook: from-scratch, tested implementations for *Distributed Machine Learning with Python*.

One module per technique, each naming the chapter that teaches it:

* ``launch``: run a rank function on N processes, or in place under torchrun (every chapter)
* ``datasets``, ``models``: shipped and generated data, loaders, and the shared small models
* ``input_pipeline``: data-loading against training bandwidth, measured (chapter 1)
* ``data_parallel``: gradient and model averaging, the data-parallel loop, LR scaling (chapter 1);
  a bucketed DDP written from scratch beside a naive one, sharded evaluation (chapter 3)
* ``collectives``: every collective from send/recv; ring, tree, recursive-doubling and naive
  all-reduce, with a message trace (chapters 2 and 4)
* ``costmodel``: the alpha-beta model of each algorithm and of a parameter server, fitted to
  measurements (chapters 2 and 4)
* ``ps``: a sharded parameter server: synchronous, bounded staleness, asynchronous (chapter 2)
* ``checkpoint``: atomic, resumable checkpoints (every rank's RNG), and DCP sharded ones
  (chapter 3)
* ``serving``: data-parallel inference (chapter 3); freezing, offload, low-rank decomposition,
  distillation and reduced-precision inference (chapter 8)
* ``tuning``: parallel hyper-parameter search (chapter 3)
* ``compression``: gradient compression as DDP communication hooks (chapter 4)
* ``recompute``: activation checkpointing by hand and with torch, measured (chapter 4)
* ``quantization``: fp16 and int8 weights, with their error, and an int8 x int8 matmul
  (chapters 4 and 8)
* ``memory``: what training a transformer keeps in memory, estimated and measured (chapter 5)
* ``pipeline``: layer split over ranks; vanilla, GPipe and 1F1B schedules (chapters 6 and 7)
* ``stage_balancing``: cut layers into stages by measured cost, a linear-partition DP (chapter 7)
* ``pipeline_workflows``: pipelined training on and off, fine-tuning and serving (chapter 7)
* ``tensor_parallel``: Megatron column- and row-parallel linears, parallel MLP and attention,
  vocab-parallel embedding and cross-entropy, a tensor-parallel char-GPT (chapter 9)
* ``mesh``: a DP x TP (x PP) device mesh of process groups, and 2-D training (chapter 9)
* ``zero``: ZeRO stages 1-3 with Adam (optimizer state, gradients, parameters sharded), memory
  measured against the paper's formulas, checked against DDP and FSDP2 (beyond the book, 9b)
* ``federated``: FedAvg on real ranks, IID and Dirichlet splits, secure aggregation (chapter 10)
* ``elastic``: elastic data-parallel training under torchrun's agent (kill, restart, resume,
  re-partition, rescale), an adaptive parameter server and an autoscaled serving pool (chapter 11)
* ``profiling``: torch.profiler traces of data-parallel steps, compute/communication breakdown
  and overlap, job multiplexing and migration, heterogeneous workers (chapter 12)
* ``netlab``: several hosts on one machine (network namespaces, shaped links) for torchrun
  multi-node runs (chapters 3, 4, 11)
* ``viz``: plots from real runs
* ``exercises``: automatic checkers for the notebooks' exercises
* ``classroom``: student copies of the notebooks and grading them (every chapter)
* ``bench``: ``python -m dmlbook.bench``, each implementation against torch's own
"""

__version__ = "0.1.0"
