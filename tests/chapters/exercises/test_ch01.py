"""Chapter 1's exercise checkers: right answers pass, planted bugs fail with a useful message, and
an unanswered exercise (``raise NotImplementedError``) is "not attempted", never an error."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from dmlbook.exercises import CheckResult, ExerciseFailed, ch01, checker, learner_code
from dmlbook.launch import RankError, RankTimeoutError

NOT_ATTEMPTED = "replace `raise NotImplementedError` with your answer and run the cell again."


def unanswered(*args):
    raise NotImplementedError


def _assert_not_attempted(result, exercise, capsys):
    assert result == CheckResult(exercise, "not attempted", result.message)
    out = capsys.readouterr().out
    assert f"Exercise {exercise!r} not attempted yet: {NOT_ATTEMPTED}" in out
    assert out.strip().splitlines()[-1] == result.message  # one line, the one returned


def _assert_passed(result, exercise, capsys):
    assert result.status == "passed" and result.exercise == exercise
    assert f"Exercise {exercise!r} passed" in capsys.readouterr().out


# --------------------------------------------------------------------------- 1. sharding


def shard(length, rank, world_size):
    """From scratch: pad by wrapping around to a multiple of world_size, then take a stride."""
    per_rank = math.ceil(length / world_size)
    padded = [i % length for i in range(per_rank * world_size)]
    return padded[rank::world_size]


def shard_with_torch(length, rank, world_size):
    sampler = DistributedSampler(range(length), num_replicas=world_size, rank=rank, shuffle=False)
    return list(sampler)


def shard_contiguous(length, rank, world_size):
    per_rank = math.ceil(length / world_size)
    padded = [i % length for i in range(per_rank * world_size)]
    return padded[rank * per_rank : (rank + 1) * per_rank]


def shard_no_padding(length, rank, world_size):
    return list(range(length))[rank::world_size]


def test_shard_passes_a_right_answer(capsys):
    _assert_passed(ch01.check_shard(shard), "shard", capsys)


def test_shard_by_torch_sampler_is_rejected():
    """DistributedSampler is what the exercise asks for, so it is switched off in the answer."""
    with pytest.raises(ExerciseFailed, match="DistributedSampler is switched off"):
        ch01.check_shard(shard_with_torch)


def test_shard_accepts_a_tensor(capsys):
    result = ch01.check_shard(lambda n, r, w: torch.tensor(shard(n, r, w), dtype=torch.long))
    _assert_passed(result, "shard", capsys)


def test_shard_contiguous_blocks_fail_at_the_first_wrong_case():
    with pytest.raises(ExerciseFailed) as failed:
        ch01.check_shard(shard_contiguous)
    message = str(failed.value)
    assert message.startswith("Exercise 'shard' failed: ")
    assert "at (length=4, rank=0, world_size=2) expected [0, 2], your function returned [0, 1]" in (
        message
    )
    assert "[[0, 2], [1, 3]]" in message  # every rank's expected shard
    assert failed.value.result == CheckResult("shard", "failed", message)


def test_shard_without_padding_fails():
    with pytest.raises(ExerciseFailed, match=r"length=1, rank=1, world_size=2\) expected \[0\], "):
        ch01.check_shard(shard_no_padding)


def test_shard_error_in_the_answer_names_the_input():
    def crashes(length, rank, world_size):
        return [length // (world_size - 1)]

    with pytest.raises(ExerciseFailed, match=r"length=1, rank=0, world_size=1\) raised Zero") as e:
        ch01.check_shard(crashes)
    assert isinstance(e.value.__cause__, ZeroDivisionError)  # the learner's traceback is kept


def test_shard_not_attempted(capsys):
    _assert_not_attempted(ch01.check_shard(unanswered), "shard", capsys)


# --------------------------------------------------------------------------- 2. learning rate


def lr_schedule(step, base_lr, base_batch, global_batch, warmup_steps):
    peak = base_lr * global_batch / base_batch
    if warmup_steps == 0:  # no warm-up: the peak from step 0
        return peak
    return peak * min(1.0, (step + 1) / warmup_steps)


def lr_no_warmup(step, base_lr, base_batch, global_batch, warmup_steps):
    return base_lr * global_batch / base_batch


def lr_sqrt_scaling(step, base_lr, base_batch, global_batch, warmup_steps):
    peak = base_lr * math.sqrt(global_batch / base_batch)
    return peak * min(1.0, (step + 1) / warmup_steps)


def lr_off_by_one(step, base_lr, base_batch, global_batch, warmup_steps):
    peak = base_lr * global_batch / base_batch
    return peak * min(1.0, step / warmup_steps)


def test_lr_schedule_passes_a_right_answer(capsys):
    _assert_passed(ch01.check_lr_schedule(lr_schedule), "lr_schedule", capsys)


@pytest.mark.parametrize(
    "answer, message",
    [
        (lr_no_warmup, "step=0, .* returned 0.025, expected 0.005 "),
        (lr_sqrt_scaling, "global_batch=64, .* returned 0.01, expected 0.005 .* is 0.025"),
        (lr_off_by_one, r"fn\(step=0, .*warmup_steps=5\) returned 0, expected 0.005"),
    ],
    ids=["no_warmup", "sqrt_scaling", "off_by_one"],
)
def test_lr_schedule_bugs_fail(answer, message):
    with pytest.raises(ExerciseFailed, match="Exercise 'lr_schedule' failed: .*" + message):
        ch01.check_lr_schedule(answer)


def test_lr_schedule_rejects_a_non_number():
    with pytest.raises(ExerciseFailed, match="returned '0.1', which is not a number"):
        ch01.check_lr_schedule(lambda *args: "0.1")


def test_lr_schedule_not_attempted(capsys):
    _assert_not_attempted(ch01.check_lr_schedule(unanswered), "lr_schedule", capsys)


# --------------------------------------------------------------------------- 3. gradients
# Each check is one launch of 3 ranks (about 2.5 s).


def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def sum_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def divide_by_two(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


def average_first_parameter_only(model):
    p = next(iter(model.parameters()))
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()


def test_average_gradients_passes_a_right_answer(capsys):
    result = ch01.check_average_gradients(average_gradients)
    _assert_passed(result, "average_gradients", capsys)
    assert "all 4 gradients are the mean over 3 ranks" in result.message


@pytest.mark.parametrize(
    "answer, message",
    [
        (sum_gradients, "on rank 0, the gradient of 'layers.0.weight' .* SUM over the ranks"),
        (divide_by_two, "'layers.0.weight' .* it is 1.5 times the mean"),
        (average_first_parameter_only, "'layers.0.bias' .* unchanged: your function did not"),
    ],
    ids=["sum", "divide_by_2", "first_parameter_only"],
)
def test_average_gradients_bugs_fail(answer, message):
    with pytest.raises(ExerciseFailed, match="Exercise 'average_gradients' failed: .*" + message):
        ch01.check_average_gradients(answer)


def test_average_gradients_not_attempted(capsys):
    result = ch01.check_average_gradients(unanswered)  # raises on every rank of a real launch
    _assert_not_attempted(result, "average_gradients", capsys)


# --------------------------------------------------------------------------- the machinery


@checker("demo")
def check_demo(fn):
    with learner_code("your function"):
        fn()


def _rank_error(cause):
    error = RankError("rank 2 failed first: ...", rank=2, exitcode=1)
    error.__cause__ = cause
    return error


def test_a_rank_that_raises_not_implemented_is_not_attempted(capsys):
    def raises():
        raise _rank_error(NotImplementedError())

    _assert_not_attempted(check_demo(raises), "demo", capsys)


def test_a_rank_that_raises_another_error_fails_naming_the_rank():
    def raises():
        raise _rank_error(KeyError("w"))

    with pytest.raises(ExerciseFailed, match="your function failed on rank 2: KeyError: 'w'"):
        check_demo(raises)


def test_hung_ranks_fail_with_a_hint():
    def hangs():
        raise RankTimeoutError("...", ranks=[1, 2], stacks={})

    with pytest.raises(ExerciseFailed, match=r"on ranks \[1, 2\] .* same collectives"):
        check_demo(hangs)


def test_a_result_instead_of_a_function_is_a_type_error():
    with pytest.raises(TypeError, match=r"takes your function itself, e.g. check_shard\(my_"):
        ch01.check_shard([0, 2])


def test_a_bug_in_a_checker_is_not_hidden():
    @checker("buggy")
    def check_buggy(fn):
        raise KeyError("checker bug")

    with pytest.raises(KeyError):
        check_buggy(lambda: None)
