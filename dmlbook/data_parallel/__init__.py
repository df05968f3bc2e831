"""Data parallelism: every rank holds the whole model and trains on a shard (chapters 1-3).

* ``averaging``: :func:`average_gradients` (synchronous SGD's model synchronisation, the one
  gradient average every chapter uses), parameter averaging, the two sync schemes (chapter 1)
* ``loop``: :func:`train_loop`, the one data-parallel training loop, with callbacks that the
  checkpointing, elastic and heterogeneous chapters plug into; :func:`train`, chapter 1's SGD on
  it; the learning-rate rules for a larger global batch (chapters 1 and 3)
* ``stages``: one data-parallel step written out as its six stages, each timed (chapter 3)
* ``job``: how a process started by ``torchrun`` learns its rank and joins the group (chapter 3)
* ``ddp``: :class:`BucketedDDP` (torch's DDP from scratch) and :class:`NaiveDDP` (chapter 3)
* ``ps``: a sharded parameter server, synchronous, bounded-staleness or asynchronous (chapter 2)
* ``checkpoint``: atomic, resumable checkpoints, and DCP sharded ones (chapter 3)
* ``input_pipeline``: data-loading against training bandwidth, measured (chapter 1)
* ``serving``: data-parallel inference (chapter 3); ``tuning``: parallel hyper-parameter search
* ``compression_experiment``: chapter 4's compression hooks trained and measured on the one loop

The names of ``averaging``, ``loop`` and ``ddp`` are importable from here, as
``from dmlbook import data_parallel as dp; dp.train(...)``.
"""

from dmlbook.data_parallel.averaging import (
    GradientAveraging,
    ModelAveraging,
    average_gradients,
    average_gradients_per_parameter,
    average_parameters,
    broadcast_parameters,
)
from dmlbook.data_parallel.ddp import (
    BucketedDDP,
    DistributedDataParallel,
    GradBucket,
    NaiveDDP,
    assign_buckets,
)
from dmlbook.data_parallel.loop import (
    Callback,
    ForwardBackward,
    LocalBatch,
    LoopState,
    NoSync,
    TrainConfig,
    linear_scaling,
    sharded_accuracy,
    strided_batches,
    train,
    train_loop,
    train_reference,
    warmup,
)

__all__ = [
    "BucketedDDP",
    "Callback",
    "DistributedDataParallel",
    "GradBucket",
    "GradientAveraging",
    "ForwardBackward",
    "LocalBatch",
    "LoopState",
    "ModelAveraging",
    "NaiveDDP",
    "NoSync",
    "TrainConfig",
    "assign_buckets",
    "average_gradients",
    "average_gradients_per_parameter",
    "average_parameters",
    "broadcast_parameters",
    "linear_scaling",
    "sharded_accuracy",
    "strided_batches",
    "train",
    "train_loop",
    "train_reference",
    "warmup",
]
