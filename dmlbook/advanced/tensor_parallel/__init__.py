"""Tensor parallelism, Megatron's way, and sequence parallelism on top of it (chapters 9 and 13).

One folder, one strategy, in picotron's manner:

* :mod:`~dmlbook.advanced.tensor_parallel.comm`: every conjugate communication operator, tensor
  and sequence parallelism's alike (Megatron's ``mappings.py``), counted by ``counting()``;
* :mod:`~dmlbook.advanced.tensor_parallel.layers`: column / row linears, the parallel MLP and
  attention (chapter 9);
* :mod:`~dmlbook.advanced.tensor_parallel.vocab_parallel`: the vocabulary-parallel embedding and
  loss (chapter 9);
* :mod:`~dmlbook.advanced.tensor_parallel.sequence_parallel`: Megatron-SP's layers and plan
  styles (chapter 13; import it by name).

``from dmlbook.advanced import tensor_parallel as tp`` gives the names of the first three, as
``dmlbook.advanced.tensor_parallel`` did when it was one file. The plan that applies these layers
to an unmodified model is :mod:`dmlbook.advanced.composition.plan`.
"""

from dmlbook.advanced.tensor_parallel.comm import (
    AllGatherForwardSplitBackward,
    AllReduceForwardIdentityBackward,
    CommRecord,
    IdentityForwardAllReduceBackward,
    copy_to_tensor_parallel,
    counting,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from dmlbook.advanced.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    communication_per_step,
)
from dmlbook.advanced.tensor_parallel.vocab_parallel import (
    VocabParallelCrossEntropy,
    VocabParallelCrossEntropyFunction,
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "AllGatherForwardSplitBackward",
    "AllReduceForwardIdentityBackward",
    "ColumnParallelLinear",
    "CommRecord",
    "IdentityForwardAllReduceBackward",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelCrossEntropyFunction",
    "VocabParallelEmbedding",
    "communication_per_step",
    "copy_to_tensor_parallel",
    "counting",
    "gather_from_tensor_parallel",
    "padded_vocab_size",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]
