"""Advanced speed-ups: see where a step's time goes, then share, move and balance the ranks.

Chapter 12 ("Advanced techniques for further speed-ups") uses this module for four ideas:

1. **Profile a data-parallel step.** :func:`profile_data_parallel` runs a few training steps of
   chapter 3's :class:`~dmlbook.data_parallel.BucketedDDP`, its :class:`NaiveDDP` or torch's
   DDP under ``torch.profiler`` on every rank (:func:`trace_steps`) and writes one
   Chrome/Perfetto trace file per rank (``prof.export_chrome_trace``; open it in
   https://ui.perfetto.dev or ``chrome://tracing``).
   :func:`analyse_trace` then reads the trace back and splits each step's wall time into
   computation (the ``aten::``/autograd ops of the training thread), communication that no
   computation hid, and the rest (Python between ops, waiting on a future). On the CPU with gloo
   (found by experiment, torch 2.13) a collective shows twice: ``c10d::allreduce_`` on the
   training thread, which only enqueues it (often from a gradient hook inside backward, so its
   time is cut out of the enclosing ops), and ``gloo:all_reduce`` on gloo's worker thread, from
   the moment the worker starts it until it completes, waiting for the peers included.
2. **Overlap.** How much of the all-reduce time ran while backward was still computing: the
   length of (communication intervals) intersected with (backward intervals), over the length
   of the communication. Bucketed DDP starts a bucket's all-reduce inside backward; the naive
   one only after it, so its overlap is zero by construction. The interval arithmetic
   (:func:`union`, :func:`intersection`, :func:`difference`, :func:`overlap_fraction`) is plain
   Python, tested on hand-made intervals.
3. **Multiplexing and migration** (as in Gandiva, Xiao et al. OSDI 2018). :func:`run_multiplexed`
   lets two data-parallel jobs share the same ranks by time slices: each keeps its model and
   optimizer, and they take turns, ``slice_steps`` steps at a time. :func:`train_job` trains one
   job on however many ranks it is launched with, saving and resuming with chapter 3's
   :mod:`dmlbook.data_parallel.checkpoint`; launched again on fewer ranks, the job has migrated.
   Because the global batch and its order do not depend on the world size, both equal training the
   job alone.
4. **Heterogeneous workers.** :func:`train_heterogeneous` throttles ranks on purpose (after
   computing, a rank spins for ``slowdown - 1`` times as long), measures each rank's speed
   (:func:`measure_speeds`), and gives each a share of the global batch in proportion to it
   (:func:`proportional_batches`).
   Each rank scales its summed loss by ``1 / global_batch`` and the gradients are *summed*, so the
   update is exactly the single-process one on the union batch (:func:`train_union_reference`);
   plain averaging of unequal batches weights the small batch's samples more, and is wrong.

The four ideas live in :mod:`~dmlbook.advanced.speedups.profiling` (with the interval arithmetic
of :mod:`~dmlbook.advanced.speedups.intervals`), :mod:`~dmlbook.advanced.speedups.jobs` and
:mod:`~dmlbook.advanced.speedups.heterogeneous`; every name is importable from here.
"""

from dmlbook.advanced.speedups.heterogeneous import (
    equal_batches,
    measure_speeds,
    proportional_batches,
    train_heterogeneous,
    train_union_reference,
)
from dmlbook.advanced.speedups.intervals import (
    Interval,
    difference,
    intersection,
    length,
    overlap_fraction,
    union,
)
from dmlbook.advanced.speedups.jobs import (
    Job,
    job_reference,
    run_alone,
    run_multiplexed,
    train_job,
)
from dmlbook.advanced.speedups.profiling import (
    STEP,
    WRAPPERS,
    analyse_trace,
    is_backward,
    load_trace,
    profile_data_parallel,
    trace_steps,
)

__all__ = [
    "STEP",
    "WRAPPERS",
    "Interval",
    "union",
    "length",
    "intersection",
    "difference",
    "overlap_fraction",
    "is_backward",
    "load_trace",
    "analyse_trace",
    "profile_data_parallel",
    "trace_steps",
    "Job",
    "run_alone",
    "run_multiplexed",
    "train_job",
    "job_reference",
    "proportional_batches",
    "equal_batches",
    "measure_speeds",
    "train_heterogeneous",
    "train_union_reference",
]
