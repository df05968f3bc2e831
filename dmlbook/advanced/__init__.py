"""Advanced paradigms: several parallelisms at once, and training beyond one cluster (ch. 9-13).

One folder per strategy:

* ``tensor_parallel``: Megatron column / row linears, parallel MLP and attention, the
  vocabulary-parallel embedding and loss (chapter 9), sequence parallelism (chapter 13), and one
  ``comm`` module with every conjugate operator of both
* ``context_parallel``: ring attention, the zigzag split, and its plan styles (chapter 13)
* ``expert_parallel``: a mixture-of-experts layer and its experts spread by all-to-all (chapter 13)
* ``zero``: ZeRO stages 1-3 on flat shards, and ``zero.sharded_optimizer``: ZeRO-1 on whole
  parameters around any ``torch.optim`` optimizer (chapter 9b, beyond the book)
* ``composition``: the rank grid ``Layout`` with its named axes, plans of styles, the one
  ``compose`` function in the order stated once, chapter 9's DP x TP training, chapter 13's
  five-dimensional training and its planner
* ``federated``: FedAvg, non-IID splits, secure aggregation (chapter 10)
* ``elastic``: elastic training under torchrun, an adaptive parameter server, an autoscaled
  serving pool (chapter 11)
* ``speedups``: profiling compute against communication, job multiplexing and migration,
  heterogeneous workers (chapter 12)
"""

__all__ = [
    "composition",
    "context_parallel",
    "elastic",
    "expert_parallel",
    "federated",
    "speedups",
    "tensor_parallel",
    "zero",
]
