"""Advanced paradigms: several parallelisms at once, and training beyond one cluster (ch. 9-12).

* ``tensor_parallel``: Megatron column / row linears, parallel MLP and attention;
  ``tensor_parallel_comm``: their conjugate communication operators, counted;
  ``vocab_parallel``: vocab-parallel embedding and loss (chapter 9)
* ``parallelize``: plans of styles applied to an unmodified model, the composition order stated
  once (chapter 9)
* ``mesh``: a device mesh of process groups, and DP x TP training (chapter 9)
* ``zero``: ZeRO stages 1-3 on flat shards; ``sharded_optimizer``: ZeRO-1 around any
  ``torch.optim`` optimizer (chapter 9b, beyond the book)
* ``federated``: FedAvg, non-IID splits, secure aggregation (chapter 10)
* ``elastic``: elastic training under torchrun, an adaptive parameter server, an autoscaled
  serving pool (chapter 11)
* ``speedups``: profiling compute against communication, job multiplexing and migration,
  heterogeneous workers (chapter 12)
* chapter 13 (beyond the book): ``sequence_parallel`` (Megatron-SP), ``context_parallel`` (ring
  attention, zigzag layout), ``moe`` (a mixture-of-experts layer) and ``expert_parallel``
"""
