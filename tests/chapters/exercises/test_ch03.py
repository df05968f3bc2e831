"""Chapter 3's exercise checkers: right answers pass; planted bugs (a rank's own shard only, the
mean of per-rank accuracies, two all-reduces where one will do, every shard gathered to every
rank, a reduce to rank 0 only, a hard-coded test-set size, a save straight into the final
path, no fsync, removing the old checkpoint before the rename) are caught."""

import os

import pytest
import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook.data_parallel import checkpoint
from dmlbook.exercises import ExerciseFailed, ch03


def unanswered(*args):
    raise NotImplementedError


def sharded_accuracy(model, x, y):
    with torch.no_grad():
        counts = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.int64)
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def local_accuracy_only(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def mean_of_accuracies(model, x, y):
    t = torch.tensor([local_accuracy_only(model, x, y)])
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def two_all_reduces(model, x, y):
    with torch.no_grad():
        correct = torch.tensor([(model(x).argmax(1) == y).sum().item()])
    total = torch.tensor([len(y)])
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return correct.item() / total.item()


def gather_every_shard(model, x, y):
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (x, y))
    with torch.no_grad():
        right = sum((model(xs).argmax(1) == ys).sum().item() for xs, ys in shards)
    return right / sum(len(ys) for _, ys in shards)


def reduce_to_rank_0(model, x, y):
    with torch.no_grad():
        counts = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.int64)
    dist.reduce(counts, dst=0)
    return counts[0].item() / counts[1].item()


def hard_coded_size(model, x, y):
    with torch.no_grad():
        correct = torch.tensor([(model(x).argmax(1) == y).sum().item()])
    dist.all_reduce(correct)
    return correct.item() / 359  # the chapter's test set, not this one


def all_gather_counts(model, x, y):  # one collective of a few numbers: allowed
    with torch.no_grad():
        mine = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    total = torch.stack(everyone).sum(0)
    return total[0].item() / total[1].item()


def test_sharded_accuracy_passes_the_right_answer():
    assert ch03.check_sharded_accuracy(sharded_accuracy).status == "passed"
    assert ch03.check_sharded_accuracy(all_gather_counts).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (local_accuracy_only, "this rank's own shard only"),
        (mean_of_accuracies, "mean of the ranks' accuracies"),
        (two_all_reduces, "called 2 collectives"),
        (gather_every_shard, "bytes to all_gather_object"),
        (reduce_to_rank_0, "reduce delivers the sum to one rank only"),
        (hard_coded_size, "divided by 359"),
    ],
)
def test_sharded_accuracy_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch03.check_sharded_accuracy(answer)


def atomic_save(obj, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_in_place(obj, path):
    torch.save(obj, path)


def save_without_fsync(obj, path):
    torch.save(obj, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def remove_then_rename(obj, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.remove(path)
    os.rename(tmp, path)


def test_atomic_save_passes_the_right_answer():
    assert ch03.check_atomic_save(atomic_save).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (save_in_place, "no rename into place"),
        (save_without_fsync, "os.fsync the temporary file before renaming"),
        (remove_then_rename, "a moment with no file at checkpoint.pt .right after remove"),
    ],
)
def test_atomic_save_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch03.check_atomic_save(answer)


def test_a_save_in_place_is_caught_by_the_crash_even_with_a_rename_elsewhere():
    """Renames something, fsyncs, but still writes the real data straight into path."""

    def sneaky(obj, path):
        torch.save(obj, path)
        with open(f"{path}.x", "wb") as f:
            os.fsync(f.fileno())
        os.replace(f"{path}.x", f"{path}.y")

    with pytest.raises(ExerciseFailed, match="destroyed the previous checkpoint"):
        ch03.check_atomic_save(sneaky)


def test_unanswered_exercises_are_not_attempted():
    assert ch03.check_sharded_accuracy(unanswered).status == "not attempted"
    assert ch03.check_atomic_save(unanswered).status == "not attempted"


# Answers that only call the library: test_back_doors.py sees each rejected.
DELEGATING_ANSWERS = {
    "sharded_accuracy": lambda model, x, y: dp.sharded_accuracy(model, x, y),
    "atomic_save": lambda obj, path: checkpoint.atomic_save(obj, path),
}
