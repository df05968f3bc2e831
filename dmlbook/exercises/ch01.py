"""Checkers for chapter 1's exercises ("Splitting input data").

1. ``check_shard``: which dataset indices each rank trains on, as ``DistributedSampler`` gives
   them without shuffling (:func:`dmlbook.datasets.shard_indices`).
2. ``check_lr_schedule``: the linear scaling rule with gradual warm-up
   (:func:`dmlbook.data_parallel.linear_scaling` and :func:`~dmlbook.data_parallel.warmup`).
3. ``check_average_gradients``: synchronous SGD's model synchronisation, averaging the gradients
   across real ranks with ``torch.distributed``
   (:func:`dmlbook.data_parallel.average_gradients`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from dmlbook import models
from dmlbook.data_parallel import linear_scaling, warmup
from dmlbook.datasets import shard_indices
from dmlbook.exercises import ExerciseFailed, checker, learner_code, run_answer

__all__ = ["check_shard", "check_lr_schedule", "check_average_gradients"]

# --------------------------------------------------------------------------- 1. sharding

SHARD_LENGTHS = (1, 4, 5, 7, 10, 13)  # shorter than, equal to and not a multiple of world_size
SHARD_WORLD_SIZES = (1, 2, 3, 4, 5)


@checker(
    "shard",
    writes=(
        "dmlbook.datasets.shard_indices",
        "torch.utils.data.distributed.DistributedSampler",
    ),
)
def check_shard(fn: Callable[[int, int, int], list[int]]) -> str:
    """Check ``fn(length, rank, world_size)``: rank's indices, unshuffled, as DistributedSampler.

    Tried on every rank of world sizes 1 to 5 for datasets of 1 to 13 samples.
    """
    cases = 0
    calls = {
        (length, rank, world_size): f"length={length}, rank={rank}, world_size={world_size}"
        for length in SHARD_LENGTHS
        for world_size in SHARD_WORLD_SIZES
        for rank in range(world_size)
    }
    answers = _answers(fn, {args: f"your function at ({where})" for args, where in calls.items()})
    for length in SHARD_LENGTHS:
        for world_size in SHARD_WORLD_SIZES:
            every_rank = [
                shard_indices(length, r, world_size, shuffle=False) for r in range(world_size)
            ]
            for rank, expected in enumerate(every_rank):
                where = calls[length, rank, world_size]
                got = _as_list(answers[length, rank, world_size], f"at ({where})")
                if got != expected:
                    raise ExerciseFailed(
                        f"at ({where}) expected {expected}, your function returned {got}.\n"
                        f"Every rank's expected shard for length={length}, "
                        f"world_size={world_size}: {every_rank}"
                        + _shard_hint(got, length, rank, world_size)
                    )
                cases += 1
    return (
        f"matches DistributedSampler(shuffle=False) on all {cases} (length, rank, world_size) cases"
    )


def _answers(fn: Callable, calls: dict[tuple, str]) -> dict[tuple, object]:
    """``fn(*args)`` for every ``args`` of ``calls``, with the library switched off once for all
    of them (switching it off costs milliseconds); if one raises, the call is named."""
    try:
        with learner_code("your function"):
            return {args: fn(*args) for args in calls}
    except ExerciseFailed:
        for args, what in calls.items():  # again, one at a time, to name the input that fails
            with learner_code(what):
                fn(*args)
        raise


def _shard_hint(got: list, length: int, rank: int, world_size: int) -> str:
    """Name the cause of the common wrong shards: blocks, no padding, padding by repetition."""
    per_rank = -(-length // world_size)
    if len(got) < per_rank:
        return (
            f"\nEvery rank must get ceil(length / world_size) = {per_rank} indices: pad the list "
            "by wrapping round to its start (0, 1, ...) before dealing"
        )
    wrapped = [i % length for i in range(per_rank * world_size)]
    if got == wrapped[rank * per_rank : (rank + 1) * per_rank]:
        return (
            "\nThat is a contiguous block. DistributedSampler deals the indices with a stride, "
            "like cards: rank r takes positions r, r + world_size, r + 2 world_size, ..."
        )
    repeated = list(range(length)) + [length - 1] * (per_rank * world_size - length)
    if got == repeated[rank::world_size]:
        return "\nPad by wrapping round to the start (0, 1, ...), not by repeating the last index"
    long = [i % length for i in range((per_rank + 2) * world_size)]
    for start in range(len(long)):
        if start != rank and got == long[start::world_size][:per_rank]:
            return (
                f"\nThat is the right stride from the wrong start: it begins at position {start}. "
                f"Rank r's first index is position r of the padded list (ranks count from 0), "
                f"so rank {rank} starts at {rank}"
            )
    return ""


def _as_list(got, where: str) -> list:
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    try:
        return list(got)
    except TypeError:
        raise ExerciseFailed(
            f"{where} your function returned {got!r}, not a list of indices"
        ) from None


# --------------------------------------------------------------------------- 2. learning rate

BASE_LR = 0.1
BATCHES = ((256, 64), (256, 256), (256, 1024), (32, 96))  # (base, global): ratios 1/4, 1, 4, 3


@checker(
    "lr_schedule",
    writes=(
        "dmlbook.data_parallel.loop.linear_scaling",
        "dmlbook.data_parallel.loop.warmup",
        "torch.optim.lr_scheduler.LinearLR",
    ),
)
def check_lr_schedule(fn: Callable[[int, float, int, int, int], float]) -> str:
    """Check ``fn(step, base_lr, base_batch, global_batch, warmup_steps)``: the linear scaling rule
    with gradual warm-up, on steps before, at the end of and after warm-up, and with no warm-up
    (``warmup_steps=0``, :class:`~dmlbook.data_parallel.TrainConfig`'s default).
    """
    calls = {
        (step, BASE_LR, base_batch, global_batch, warmup_steps): (
            f"fn(step={step}, base_lr={BASE_LR}, base_batch={base_batch}, "
            f"global_batch={global_batch}, warmup_steps={warmup_steps})"
        )
        for warmup_steps in (5, 1, 0)
        for base_batch, global_batch in BATCHES
        for step in sorted(
            {0, 1, warmup_steps - 1, warmup_steps, warmup_steps + 1, 2 * warmup_steps + 3} - {-1}
        )
    }
    ramped = {args: call for args, call in calls.items() if args[4] > 0}
    flat = {args: call for args, call in calls.items() if args[4] == 0}
    answers = _answers(fn, ramped)  # with warm-up first: its hints name more causes
    cases = _check_lrs(ramped, answers, answers)
    try:
        answers_flat = _answers(fn, flat)
    except ExerciseFailed as failure:
        if isinstance(failure.__cause__, ZeroDivisionError):
            raise ExerciseFailed(f"{failure}.\n{NO_WARMUP}") from failure.__cause__
        raise
    cases += _check_lrs(flat, answers_flat, answers)
    return f"right on all {cases} (step, batch sizes, warm-up) cases, warmup_steps=0 included"


def _check_lrs(calls: dict[tuple, str], answers: dict, ramped_answers: dict) -> int:
    """Compare each answer with the rule; a wrong one fails with the cause ``_lr_hint`` names."""
    for args, call in calls.items():
        got = answers[args]
        if isinstance(got, str | bytes) or not _is_number(got):
            raise ExerciseFailed(f"{call} returned {got!r}, which is not a number")
    for args, call in calls.items():
        _, _, base_batch, global_batch, _ = args
        expected = _expected_lr(*args)
        got = float(answers[args])
        if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
            peak = linear_scaling(BASE_LR, base_batch, global_batch)
            raise ExerciseFailed(
                f"{call} returned {got:.6g}, expected {expected:.6g} "
                f"(the peak learning rate for this global batch is {peak:.6g})"
                + _lr_hint(ramped_answers)
            )
    return len(calls)


NO_WARMUP = (
    "warmup_steps=0 means no warm-up (TrainConfig's default): the rate is the peak, "
    "base_lr x global_batch / base_batch, from step 0; do not divide by warmup_steps then"
)


def _expected_lr(step, base_lr, base_batch, global_batch, warmup_steps) -> float:
    peak = linear_scaling(base_lr, base_batch, global_batch)
    return peak if warmup_steps == 0 else warmup(peak, warmup_steps)(step)


def _is_number(x) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def _ramp(s, w):
    return min(1.0, (s + 1) / w)


# The common wrong rules, each with its cause: (rate(step, base_lr, base, global, W), cause).
_WRONG_LR_RULES = (
    (
        lambda s, lr, b, g, w: lr * g / b * min(1.0, s / w),
        "your warm-up is one step late: at step s (counted from 0) the rate is "
        "peak x (s + 1) / warmup_steps, so that it starts at peak / warmup_steps and reaches the "
        "peak at step warmup_steps - 1",
    ),
    (
        lambda s, lr, b, g, w: lr * g / b * (s + 1) / w,
        "your ramp goes on past the peak: after warmup_steps steps the rate holds at the peak, "
        "peak x min(1, (s + 1) / warmup_steps)",
    ),
    (
        lambda s, lr, b, g, w: lr * g / b,
        "that is the peak rate already: during warm-up, ramp up to it linearly, "
        "peak x (s + 1) / warmup_steps at step s",
    ),
    (
        lambda s, lr, b, g, w: lr * _ramp(s, w),
        "that ramps up to base_lr; the peak is base_lr x global_batch / base_batch (the linear "
        "scaling rule)",
    ),
    (
        lambda s, lr, b, g, w: lr * b / g * _ramp(s, w),
        "the batch ratio is upside down: the peak is base_lr x global_batch / base_batch, larger "
        "for a larger global batch",
    ),
    (
        lambda s, lr, b, g, w: lr * (g // b) * _ramp(s, w),
        "you used integer division, global_batch // base_batch, which rounds a ratio such as "
        "64 / 256 down to 0: use /",
    ),
    (
        lambda s, lr, b, g, w: lr * math.sqrt(g / b) * _ramp(s, w),
        "that scales by the square root of the batch ratio; the linear rule multiplies by "
        "global_batch / base_batch",
    ),
    (
        lambda s, lr, b, g, w: lr + (lr * g / b - lr) * _ramp(s, w),
        "that is Goyal et al.'s warm-up, which ramps from base_lr up to the peak; this exercise "
        "ramps from 0, as dp.warmup does: peak x (s + 1) / warmup_steps at step s",
    ),
    (
        lambda s, lr, b, g, w: lr + (lr * g / b - lr) * min(1.0, s / w),
        "that is Goyal et al.'s warm-up, which ramps from base_lr up to the peak; this exercise "
        "ramps from 0, as dp.warmup does: peak x (s + 1) / warmup_steps at step s",
    ),
)


def _lr_hint(answers: dict[tuple, object]) -> str:
    """Name the cause: the common wrong rule that gives every one of the answers (the cases with
    warm-up; with ``warmup_steps=0`` a rule may divide by zero)."""
    ramped = {args: float(got) for args, got in answers.items() if args[4] > 0}
    for rule, cause in _WRONG_LR_RULES:
        if all(math.isclose(got, rule(*args), rel_tol=1e-9, abs_tol=1e-12)
               for args, got in ramped.items()):  # fmt: skip
            return f".\n{cause[0].upper()}{cause[1:]}"
    if all(math.isclose(got, _expected_lr(*args), rel_tol=1e-9, abs_tol=1e-12)
           for args, got in ramped.items()):  # fmt: skip
        return f".\nRight with warm-up, wrong without: {NO_WARMUP}"
    return ""


# --------------------------------------------------------------------------- 3. gradients

WORLD_SIZE = 3  # not a power of two, and dividing by 2 is wrong


def _model() -> nn.Module:
    return models.mlp(seed=0, in_features=5, hidden=(4,), out_features=2)


def _gradients_of(rank: int, model: nn.Module) -> list[torch.Tensor]:
    """Rank ``rank``'s made-up gradients: any rank can regenerate any other's."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def _average_gradients_on_rank(fn: Callable[[nn.Module], None]) -> dict:
    """Rank function: give the model this rank's gradients, call ``fn``, report what it left."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()  # identical on every rank
    every = [_gradients_of(r, model) for r in range(world)]  # [rank][parameter]
    for p, grad in zip(model.parameters(), every[rank], strict=True):
        p.grad = grad.clone()
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    kinds = {p.data_ptr(): "parameter" for p in params} | {
        p.grad.data_ptr(): "gradient" for p in params
    }
    calls: list[tuple[str, str, str]] = []  # (collective, op, what it was given)
    with _recording(calls, kinds):
        fn(model)
    return dict(
        names=[name for name, _ in model.named_parameters()],
        own=every[rank],
        total=[sum(grads[i] for grads in every) for i in range(len(params))],
        got=[None if p.grad is None else p.grad.detach().clone() for p in params],
        changed=[(p.detach() - b).abs().max().item() for p, b in zip(params, before, strict=True)],
        calls=calls,
    )


@contextmanager
def _recording(calls: list, kinds: dict[int, str]):
    """Note each ``dist.all_reduce`` / ``dist.reduce`` the answer makes: its op, and whether it
    was given a gradient, a parameter or another tensor (a copy); the call itself goes through."""
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce")}

    def recorder(name: str, original: Callable) -> Callable:
        def record(tensor, *args, **kwargs):
            position = 0 if name == "all_reduce" else 1  # reduce(tensor, dst, op=...)
            op = kwargs.get("op", args[position] if len(args) > position else dist.ReduceOp.SUM)
            what = kinds.get(tensor.data_ptr(), "copy") if torch.is_tensor(tensor) else "copy"
            calls.append((name, str(op).rsplit(".", 1)[-1], what))
            return original(tensor, *args, **kwargs)

        return record

    for name, original in originals.items():
        setattr(dist, name, recorder(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@checker(
    "average_gradients",
    writes=(
        "dmlbook.data_parallel.averaging.average_gradients",
        "dmlbook.data_parallel.averaging.average_gradients_per_parameter",
    ),
)
def check_average_gradients(fn: Callable[[nn.Module], None], timeout: float = 60.0) -> str:
    """Check ``fn(model)``: on 3 real ranks, every gradient becomes its mean over the ranks."""
    try:
        with learner_code(f"your function on {WORLD_SIZE} ranks"):
            reports = run_answer(_average_gradients_on_rank, WORLD_SIZE, fn, timeout=timeout)
    except ExerciseFailed as failure:
        if any(lost in str(failure) for lost in ("Connection closed", "Connection reset")):
            raise ExerciseFailed(
                f"{failure}.\nA rank's collective lost its peers: the other ranks had returned "
                "without making the same call. Every rank must make the collective call (an "
                "all-reduce completes only when all ranks of the group call it): do not put it "
                "under `if dist.get_rank() == 0`"
            ) from failure.__cause__
        raise
    for rank, report in enumerate(reports):
        for name, own, total, got, changed in zip(
            report["names"],
            report["own"],
            report["total"],
            report["got"],
            report["changed"],
            strict=True,
        ):
            _check_gradient(rank, name, own, total, got, report["calls"])
            if changed != 0.0:
                raise ExerciseFailed(
                    f"on rank {rank} your function changed the parameter {name!r} (by up to "
                    f"{changed:.3g}); it should change only the gradients (.grad)"
                )
    count = len(reports[0]["names"])
    return f"all {count} gradients are the mean over {WORLD_SIZE} ranks, parameters untouched"


def _calls_hint(calls: list[tuple[str, str, str]]) -> str | None:
    """The cause that the collectives the answer made show, if they show one."""
    if any(name == "reduce" for name, _, _ in calls):
        return (
            "you called dist.reduce, which leaves the sum on one rank (dst) only; every rank "
            "needs it, and dist.all_reduce gives it to all of them"
        )
    if ops := sorted({op for _, op, _ in calls if op != "SUM"}):
        return (
            f"you all-reduced with op={ops[0]}, which does not add the tensors up: use the "
            "default op (ReduceOp.SUM), then divide by the world size"
        )
    given = {what for _, _, what in calls}
    if given and "gradient" not in given and "parameter" in given:
        return (
            "you all-reduced the parameters (p), not their gradients (p.grad): it is the "
            "gradients that synchronous SGD averages, before the optimizer's step"
        )
    if given and "gradient" not in given:
        return (
            "you all-reduced copies of the gradients, and p.grad stayed as it was: "
            "dist.all_reduce works in place on the very tensor you pass, so pass p.grad itself "
            "(or copy the result back into p.grad)"
        )
    return None


def _check_gradient(rank: int, name: str, own, total, got, calls=()) -> None:
    where = f"on rank {rank}, the gradient of {name!r}"
    if got is None:
        raise ExerciseFailed(f"{where} is None after your function; average it in place")
    if got.shape != own.shape:
        raise ExerciseFailed(f"{where} has shape {tuple(got.shape)}, expected {tuple(own.shape)}")
    expected = total / WORLD_SIZE
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        return
    if hint := _calls_hint(list(calls)):
        pass
    elif torch.allclose(got, own):
        hint = (
            "it is unchanged: your function did not average it (call dist.all_reduce on "
            "p.grad, then divide)"
        )
    elif torch.allclose(got, total, rtol=1e-5, atol=1e-6):
        hint = f"it is the SUM over the ranks: divide by the world size ({WORLD_SIZE})"
    else:
        factor = (got * expected).sum() / (expected * expected).sum()  # least-squares got/expected
        hint = "it is wrong"
        if torch.allclose(got, factor * expected, rtol=1e-4, atol=1e-5):
            hint = (
                f"it is {factor.item():.4g} times the mean: divide the sum by the world size "
                f"({WORLD_SIZE}), from dist.get_world_size()"
            )
    raise ExerciseFailed(
        f"{where} is not the mean of the {WORLD_SIZE} ranks' gradients: {hint}.\n"
        f"Expected {_head(expected)}, got {_head(got)} "
        f"(this rank's own gradient was {_head(own)})"
    )


def _head(t: torch.Tensor, n: int = 4) -> str:
    values = t.flatten().tolist()
    shown = ", ".join(f"{v:.4g}" for v in values[:n])
    return f"[{shown}{', ...' if len(values) > n else ''}]"
