"""Checkpoints that survive a crash at any moment, and training that resumes exactly (chapter 3).

Chapter 3 ("checkpointing and fault tolerance") teaches three ideas with this module:

1. **A save is all or nothing.** :func:`atomic_save` writes a temporary file in the same
   directory, flushes Python's buffer and calls ``fsync`` to move the kernel's cache to the
   disk, renames the file over the old one with ``os.replace`` (atomic within one filesystem),
   then calls ``fsync`` on the directory so that the rename itself is on disk. Killed at any
   moment, it leaves the previous checkpoint or the new one at the final path, never half of
   one. A killed save's temporary file names its writer (pid, start time, host), and the next
   save removes those whose writer is dead (:func:`remove_killed_saves`), never a live
   concurrent save's.
2. **A checkpoint holds everything the next step depends on**, so that a resumed run is
   bitwise the run that never crashed: the model, the optimizer (momentum buffers), the progress
   (epoch and position within it: each epoch's shuffle is a function of ``(seed, epoch)``, see
   :func:`~dmlbook.datasets.shard_indices`), and the random-number generators of *every* rank
   (torch CPU and CUDA, Python's ``random``, NumPy), since each rank draws its own dropout masks or
   augmentations. :func:`save` is collective: the ranks' RNG states are gathered to rank 0, rank 0
   alone writes (data-parallel replicas are identical), and a barrier makes sure the file exists
   before any rank moves on. :func:`load` is read by every rank, each restoring its own RNG.
   :func:`train_resumable` is chapter 1's loop plus these checkpoints: a crash costs at most
   ``every`` steps.
3. **Sharded checkpoints with** ``torch.distributed.checkpoint`` **(DCP)**, beside the home-made
   one: :func:`save_sharded` has every rank write its own shard (for a model sharded with FSDP2,
   ZeRO-3 style), and :func:`load_sharded` reads it back at *any* world size, each rank reading
   only the pieces that overlap the shard it now holds.

Files are read with ``torch.load(weights_only=True)``, so a checkpoint holds only tensors, numbers,
strings and lists/tuples/dicts of them (RNG states are converted to tensors), and loading a file
from elsewhere cannot run code. DCP's tensors are read the same way, but its ``.metadata`` file is
a plain pickle: load only DCP checkpoints you trust.

Loading at another world size: the model, optimizer and progress load as usual (replicas are
identical); rank ``r`` restores the RNG state saved by rank ``r`` if there was one and keeps its own
otherwise, and a ``RuntimeWarning`` says that random draws, hence results, will no longer match an
uninterrupted run bitwise (chapter 11 resizes jobs on purpose).
"""

from __future__ import annotations

from dmlbook.data_parallel.checkpoint.files import (
    FORMAT,
    Progress,
    atomic_save,
    checkpoint_path,
    latest,
    load,
    remove_killed_saves,
    save,
    seed_all,
)
from dmlbook.data_parallel.checkpoint.resumable import (
    Checkpointing,
    ResumableConfig,
    SimulateCrash,
    SimulatedCrash,
    progress_after,
    train_resumable,
)
from dmlbook.data_parallel.checkpoint.sharded import (
    load_sharded,
    save_sharded,
)

__all__ = [
    "FORMAT",
    "ResumableConfig",
    "Progress",
    "SimulatedCrash",
    "SimulateCrash",
    "Checkpointing",
    "progress_after",
    "atomic_save",
    "remove_killed_saves",
    "save",
    "load",
    "checkpoint_path",
    "latest",
    "seed_all",
    "train_resumable",
    "save_sharded",
    "load_sharded",
]
