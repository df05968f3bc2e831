"""Checkers for chapter 3's exercises ("A data-parallel training and serving pipeline").

1. ``check_sharded_accuracy``: write ``sharded_accuracy(model, x, y)``, the evaluation step of a
   data-parallel pipeline: each rank scores its own shard of the test set, and one all-reduce of
   (correct, count) makes the accuracy exact over the whole set, on every rank, even when the
   shards differ in size (averaging the ranks' accuracies is then wrong). The checker counts the
   collectives each rank calls (one is enough) and the bytes it hands them (two numbers are).
2. ``check_atomic_save``: write ``atomic_save(obj, path)``, the checkpointing rule that a crash
   mid-save never destroys the last good checkpoint: write a temporary file in the same directory,
   flush and fsync it (so that a power cut cannot lose its data), then rename it over ``path`` in
   one step (:mod:`dmlbook.data_parallel.checkpoint` does this). The checker sees the save crash
   midway, and watches that a file is at ``path`` at every moment of a save over an old one.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dmlbook import models
from dmlbook.exercises import ExerciseFailed, checker, learner_code, run_answer

__all__ = ["check_sharded_accuracy", "check_atomic_save"]

# --------------------------------------------------------------------------- 1. evaluation

TEST_SIZES = ((2, 11), (3, 10), (4, 7))  # (world size, test samples): shards of unequal size


def _eval_data(n: int):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 16, generator=g), torch.randint(0, 3, (n,), generator=g)


def _eval_model() -> nn.Module:
    return models.mlp(seed=2, in_features=16, hidden=(8,), out_features=3)


def _shard(n: int, rank: int, world: int) -> slice:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


# Every collective a rank can call: torch's, and chapter 2's (dmlbook.comm.collectives).
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "send", "recv", "isend", "irecv",
)  # fmt: skip


MAX_BYTES = 64  # what a rank may send: a few numbers, never the data or per-sample results


def _payload_bytes(name: str, args, kwargs) -> int:
    """Bytes a collective call hands over: its tensors' sizes, and for an ``*_object*``
    collective its objects' pickled sizes. An all-gather's output (its first argument) is
    not counted: it is what arrives."""
    if name.startswith("all_gather"):
        args = args[1:]
    total = 0
    for value in [*args, *kwargs.values()]:
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif "object" in name and item is not None and not isinstance(item, int):
                total += len(pickle.dumps(item))
    return total


@contextmanager
def _counting_collectives(answer: Callable) -> Iterator[list[tuple[str, int]]]:
    """Record, in the yielded list, each collective the block calls (a collective that calls
    others counts once) with the bytes it was handed, wherever ``answer`` finds it: ``dist.``,
    chapter 2's ``collectives.``, or a name imported into its globals."""
    from dmlbook.comm import collectives

    calls: list[tuple[str, int]] = []
    depth = [0]

    def counting(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                calls.append((name, _payload_bytes(name, args, kwargs)))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    owners = [dist, collectives]
    originals = {
        (owner, name): getattr(owner, name)
        for owner in owners
        for name in _COLLECTIVES
        if callable(getattr(owner, name, None))
    }
    wrappers = {id(f): counting(name, f) for (_, name), f in originals.items()}
    spaces = getattr(answer, "__globals__", {})
    bound = {k: v for k, v in spaces.items() if id(v) in wrappers}
    try:
        for (owner, name), f in originals.items():
            setattr(owner, name, wrappers[id(f)])
        spaces.update({k: wrappers[id(v)] for k, v in bound.items()})
        yield calls
    finally:
        for (owner, name), f in originals.items():
            setattr(owner, name, f)
        spaces.update(bound)


def _sharded_accuracy_on_rank(fn: Callable, n: int) -> tuple[float, list[tuple[str, int]]]:
    x, y = _eval_data(n)
    mine = _shard(n, dist.get_rank(), dist.get_world_size())
    with _counting_collectives(fn) as calls:
        value = float(fn(_eval_model(), x[mine], y[mine]))
    return value, calls


@checker("sharded_accuracy", writes=("dmlbook.data_parallel.loop.sharded_accuracy",))
def check_sharded_accuracy(fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], float]) -> str:
    """Check ``fn(model, x_shard, y_shard)`` returns the accuracy over ALL ranks' shards on every
    rank, at world sizes 2, 3 and 4 with shards of unequal sizes."""
    for world, n in TEST_SIZES:
        x, y = _eval_data(n)
        with torch.no_grad():
            right = _eval_model()(x).argmax(1) == y
        expected = right.sum().item() / n
        call = f"your function on {world} ranks, {n} test samples"
        with learner_code(call):
            got = run_answer(_sharded_accuracy_on_rank, world, fn, n, timeout=30)
        for rank, (value, calls) in enumerate(got):
            names = [name for name, _ in calls]
            sent = sum(size for _, size in calls)
            if sent > MAX_BYTES:
                raise ExerciseFailed(
                    f"{call}: rank {rank} handed {sent} bytes to {', '.join(names)}, where two "
                    "numbers (16 bytes) are enough: moving the shards (or a result per sample) "
                    "to every rank costs bandwidth and makes every rank score every sample. "
                    "Score your own shard, then all-reduce (correct, total)"
                )
            if abs(value - expected) < 1e-6 and len(calls) > 1:
                raise ExerciseFailed(
                    f"{call}: the accuracy is right, but rank {rank} called {len(calls)} "
                    f"collectives ({', '.join(names)}) where one is enough: each collective "
                    "pays a whole round of latency. Put (correct, total) in one tensor and "
                    "all-reduce it once"
                )
            if abs(value - expected) < 1e-6:
                continue
            shards = [_shard(n, r, world) for r in range(world)]
            local = [right[s].sum().item() / (s.stop - s.start) for s in shards]
            correct = right.sum().item()
            hint = ""
            if abs(value - local[rank]) < 1e-6 and "reduce" in names:
                hint = (
                    ": that is this rank's own shard only. dist.reduce delivers the sum to one "
                    "rank only (dst); the others keep their own counts. all_reduce delivers it "
                    "to every rank"
                )
            elif abs(value - local[rank]) < 1e-6:
                hint = ": that is this rank's own shard only. Combine the ranks with all_reduce"
            elif abs(value - sum(local) / world) < 1e-6:
                hint = (
                    ": that is the mean of the ranks' accuracies, which weighs a small shard as "
                    "much as a big one. All-reduce the counts (correct, total), then divide"
                )
            elif value > 0 and abs(correct / value - round(correct / value)) < 1e-6:
                hint = (
                    f": that is the right number of correct answers ({correct}) divided by "
                    f"{round(correct / value)}, not by the {n} samples the ranks hold together. "
                    "Count the samples on each rank and all-reduce the count: a fixed size "
                    "(such as len(x_test)) is wrong on any other data"
                )
            raise ExerciseFailed(
                f"{call}: rank {rank} returned {value:.4f}, expected {expected:.4f} (shard sizes "
                f"{[s.stop - s.start for s in shards]}){hint}"
            )
    return "exact over the whole test set at world sizes 2, 3 and 4, on every rank"


# --------------------------------------------------------------------------- 2. atomic save


class _CrashMidway:
    """Pickling this raises, after torch.save has already written part of the file."""

    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of the save")


def _calls_in_order(fn: Callable, obj, path: Path) -> list[tuple[str, bool]]:
    """Call ``fn(obj, path)`` and return the file system calls it made (fsync, rename, remove),
    in order, each with whether a file was at ``path`` right after it."""
    calls: list[tuple[str, bool]] = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "remove", "unlink")}

    def watched(name: str) -> Callable:
        def call(*args, **kwargs):
            result = real[name](*args, **kwargs)
            if name in ("replace", "rename"):
                what = f"rename {Path(args[0]).parent == Path(args[1]).parent}"
            else:
                what = name
            calls.append((what, path.exists()))
            return result

        return call

    for name in real:
        setattr(os, name, watched(name))
    try:
        fn(obj, path)
    finally:
        for name, f in real.items():
            setattr(os, name, f)
    return calls


@checker("atomic_save", writes=("dmlbook.data_parallel.checkpoint.files.atomic_save",))
def check_atomic_save(fn: Callable[[object, Path], None]) -> str:
    """Check ``fn(obj, path)``: saves ``obj`` (torch.save format) so that a crash in the middle
    leaves the previous file at ``path`` intact, by writing a temporary file in the same directory,
    fsyncing it, then renaming it over ``path``."""
    with tempfile.TemporaryDirectory(prefix="atomic-save-") as d:
        path = Path(d) / "checkpoint.pt"
        first = {"step": 1, "weights": torch.arange(1000.0)}
        with learner_code("your function saving a checkpoint"):
            calls = [what for what, _ in _calls_in_order(fn, first, path)]
        if not path.exists():
            raise ExerciseFailed(f"after your function, nothing was at {path.name}")
        loaded = torch.load(path, weights_only=True)
        if loaded["step"] != 1 or not torch.equal(loaded["weights"], first["weights"]):
            raise ExerciseFailed("the saved file does not load back as the object saved")
        if "rename True" not in calls:
            raise ExerciseFailed(
                "no rename into place was seen: write to a temporary file in the same directory "
                "(os.replace is atomic only within one file system), then os.replace it over path"
            )
        if "fsync" not in calls or calls.index("fsync") > calls.index("rename True"):
            raise ExerciseFailed(
                "flush and os.fsync the temporary file before renaming it: the operating system "
                "keeps written data in memory (the page cache) for a while, so after a power cut "
                "the new name could point at a file whose data never reached the disk"
            )
        second = {"step": 2, "weights": torch.arange(1000.0) + 1}
        with learner_code("your function saving over the previous checkpoint"):
            watched = _calls_in_order(fn, second, path)
        gaps = [what for what, there in watched if not there]
        if gaps:
            raise ExerciseFailed(
                f"while your function saved over the previous checkpoint, there was a moment "
                f"with no file at {path.name} (right after {gaps[0].split()[0]}): a crash or a "
                "power cut there leaves no checkpoint at all. os.replace(tmp, path) swaps the "
                "new file in for the old one in one step; do not remove or move the old one first"
            )
        if torch.load(path, weights_only=True)["step"] != 2:
            raise ExerciseFailed("after a second save, the file at path is not the second object")
        crashing = {"step": 3, "weights": torch.arange(100_000.0), "extra": _CrashMidway()}
        try:
            with learner_code("your function saving a checkpoint that crashes midway"):
                fn(crashing, path)
        except ExerciseFailed as failure:
            if "called the library instead" in str(failure):
                raise
            # the simulated crash; what matters is what is left on disk
        try:
            after = torch.load(path, weights_only=True)
        except Exception as error:
            raise ExerciseFailed(
                f"a save that crashed midway destroyed the previous checkpoint: loading it now "
                f"raises {type(error).__name__}. Never write into the final path directly"
            ) from None
        if after["step"] != 2:
            raise ExerciseFailed(
                "after a crashed save, the file should still be the last good save"
            )
    return "fsync then rename; a crash mid-save left the previous checkpoint loadable"
