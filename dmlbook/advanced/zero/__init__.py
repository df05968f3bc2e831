"""ZeRO stages 1, 2 and 3: data parallelism without the replicated model states ("beyond the book").

Plain data parallelism (chapters 1 and 3) keeps a whole copy of the model states on every rank.
With fp32 Adam that is 16 bytes per parameter: 4 for the parameter, 4 for its gradient and 8 for
Adam's two moments. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models") removes the copies in three stages, each keeping the arithmetic of
plain data parallelism exactly:

* stage 1 (P_os) shards the optimizer state: rank r keeps Adam's moments only for its 1/N of
  the parameters, steps only those, and an all-gather hands the updated parameters round;
* stage 2 (P_os+g) also shards the gradients: each layer's gradient is reduce-scattered as soon
  as backward has produced it, and a rank keeps only the averaged gradient of its own shard;
* stage 3 (P_os+g+p) also shards the parameters: a layer's parameters are all-gathered just
  before its forward, freed after it, gathered again just before its backward and freed again.

Stage 0 is plain data parallelism in the same code (an all-reduce of the gradients, Adam on every
element), so that memory and communication can be measured for all four in one way.

The layout, as in FSDP1's flat parameter: every *unit* (by default each module that owns
parameters directly, such as an ``nn.Linear``) flattens its parameters into one flat buffer,
padded with zeros to a multiple of the world size N, and split into N equal shards; rank r owns
elements ``[r * S, (r + 1) * S)`` with ``S = ceil(numel / N)``. Padding never changes a result:
a padded element starts at 0, its gradient is always 0, so Adam leaves it at 0. It costs at most
N - 1 elements per unit, and is counted in the memory measurement.

Collectives: ``collectives="torch"`` (the default) uses ``dist.reduce_scatter_single`` and
``dist.all_gather_single`` (torch 2.13's names for ``reduce_scatter_tensor`` and
``all_gather_into_tensor``, which older versions use). Gloo on CPU runs both, ``ReduceOp.AVG``
included, but its reduce-scatter is an all-reduce from which each rank keeps its chunk (pytorch
PRs #112144 and #118911): right numbers, twice the traffic of a real reduce-scatter. NCCL's is a
real one. ``collectives="dmlbook"`` uses chapter 2's ring ``reduce_scatter`` / ``all_gather``,
built from point-to-point messages: a real ring on every backend, and
:func:`dmlbook.comm.collectives.recording_sends` counts each message it sends.

:class:`MemoryMeter` measures what each stage holds: at every point of a step where the held
set changes (each gather, each reduce-scatter, the end of backward, the step) it adds up the
bytes of the parameters, gradients and optimizer state the rank actually holds, counted from the
tensors' storages. :func:`expected_bytes` is the paper's formula with this layout's padding and
the unit in flight (at stages 2 and 3 one unit's full gradient waits for its reduce-scatter; at
stage 3 its parameters are gathered meanwhile); :func:`paper_bytes` is the formula as the paper
writes it, which leaves such temporary buffers out. The notebook
``chapters/09b_zero_sharding.ipynb`` ("Beyond the book: ZeRO and FSDP") uses this module, and
checks it against FSDP2.

ZeRO-1 is here twice, both worth teaching; per step, on N ranks, for P parameters (counted):

* flat (:class:`ZeroStage1`, DeepSpeed's): the flattened units cut at any element, so each rank
  holds ``ceil(numel / N)`` of every unit (at most N - 1 padding elements each); traffic is a
  reduce-scatter plus an all-gather, ``2 (N - 1) / N x P`` elements, the same as plain data
  parallelism's all-reduce; right only for an elementwise update (Adam's, SGD's);
* whole-parameter (:class:`~dmlbook.advanced.zero.sharded_optimizer.ShardedOptimizer`, torch's
  ``ZeroRedundancyOptimizer``): each rank owns whole parameters, so *any* ``torch.optim``
  optimizer works unchanged; a rank may hold up to the mean plus one largest parameter; traffic
  is the all-reduce plus one broadcast pass, ``3 (N - 1) / N x P`` (1.5x), one message per
  parameter, and every rank still holds the whole gradient. Chapter 13's composition uses it.
"""

from dmlbook.advanced.zero.accounting import (
    COLLECTIVES,
    PARTS,
    ZERO_STAGES,
    MemoryMeter,
    comm_bytes_per_step,
    expected_bytes,
    paper_bytes,
)
from dmlbook.advanced.zero.stage0 import ZeroStage0, flat_buffer
from dmlbook.advanced.zero.stages import (
    STAGE_CLASSES,
    ZeroStage1,
    ZeroStage2,
    ZeroStage3,
    zero_data_parallel,
)
from dmlbook.advanced.zero.training import ddp_train, fsdp2_train, fsdp2_wrap, zero_train

__all__ = [
    "flat_buffer",
    "ZERO_STAGES",
    "COLLECTIVES",
    "MemoryMeter",
    "PARTS",
    "STAGE_CLASSES",
    "ZeroStage0",
    "ZeroStage1",
    "ZeroStage2",
    "ZeroStage3",
    "zero_data_parallel",
    "comm_bytes_per_step",
    "ddp_train",
    "expected_bytes",
    "fsdp2_train",
    "fsdp2_wrap",
    "paper_bytes",
    "zero_train",
]
