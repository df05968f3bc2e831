"""Checkers for chapter 6's exercises ("Pipeline input and layer split").

1. ``check_one_f_one_b_order``: write ``order(stage, stages, microbatches) -> [(op, microbatch),
   ...]``, the order in which stage ``stage`` of a 1F1B pipeline runs its ops: ``min(P - s - 1,
   M)`` warm-up forwards, then one forward and one backward in turn, then the backwards left
   (:func:`dmlbook.model_parallel.pipeline.one_f_one_b_schedule` builds it for every stage).
2. ``check_microbatch_gradients``: write ``grads(model, loss_fn, inputs, targets, microbatches)
   -> float``: run the batch through ``model`` as M micro-batches, one forward and one backward
   each, so that the gradients accumulated in ``.grad`` are those of the whole batch's mean loss,
   and return that loss. Micro-batches may differ in size (10 rows in 4), where the 1/M of
   :class:`dmlbook.model_parallel.pipeline.PipelineStage` (equal micro-batches only) is wrong:
   each micro-batch's mean loss counts for its share of the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from dmlbook.exercises import ExerciseFailed, checker, learner_code
from dmlbook.model_parallel import pipeline as pp
from dmlbook.model_parallel import schedules

__all__ = ["check_microbatch_gradients", "check_one_f_one_b_order"]

# (stages, micro-batches): a short and a long pipe, M < P, M = 1, and a single stage
_ORDER_CASES = [(2, 4), (3, 6), (4, 8), (4, 2), (3, 1), (1, 3)]


def _ops(actions: Sequence[pp.Action]) -> list[tuple[str, int]]:
    return [(a.op, a.microbatch) for a in actions]


def _peak_live(ops: Sequence[tuple[str, int]]) -> int:
    live = peak = 0
    for op, _ in ops:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


@contextmanager
def _schedule_table_too() -> Iterator[None]:
    """Inside :func:`learner_code`: the executor's table of schedules by name holds 1F1B too, so
    it gets the same stand-in as the module's name (``pp.SCHEDULES["1f1b"]`` is no way round)."""
    original = schedules.SCHEDULES["1f1b"]
    schedules.SCHEDULES["1f1b"] = schedules.one_f_one_b_schedule  # the stand-in, while switched off
    try:
        yield
    finally:
        schedules.SCHEDULES["1f1b"] = original


@checker("one_f_one_b_order", writes=("dmlbook.model_parallel.pipeline.one_f_one_b_schedule",))
def check_one_f_one_b_order(fn: Callable[[int, int, int], Sequence[tuple[str, int]]]) -> str:
    """Check ``fn(stage, stages, microbatches)`` against the 1F1B order of every stage of
    pipelines of 1 to 4 stages and 1 to 8 micro-batches, including fewer micro-batches than
    stages; a wrong order is explained (GPipe's order, too long or short a warm-up, ...)."""
    for stages, microbatches in _ORDER_CASES:
        for stage in range(stages):
            case = f"stage {stage} of P = {stages} stages with M = {microbatches} micro-batches"
            with learner_code(f"your order for {case}"), _schedule_table_too():
                got = fn(stage, stages, microbatches)
            try:
                got = [(str(op), int(mb)) for op, mb in got]
            except (TypeError, ValueError) as error:
                raise ExerciseFailed(
                    f"for {case}: return a list of (op, microbatch) pairs such as ('F', 0), "
                    f"got {got!r}"
                ) from error
            want = _ops(pp.stage_actions(pp.one_f_one_b_schedule(stages, microbatches), stage))
            if got == want:
                continue
            raise ExerciseFailed(f"for {case}: {_diagnose(got, want, stage, stages, microbatches)}")
    return f"the 1F1B order of every stage, for {len(_ORDER_CASES)} pipeline shapes"


def _diagnose(got, want, stage: int, stages: int, microbatches: int) -> str:
    """Say what is wrong with a 1F1B order, most telling mistake first."""
    shown = f"expected {' '.join(f'{o}{m}' for o, m in want)}, got "
    shown += " ".join(f"{o}{m}" for o, m in got)
    every = sorted((op, mb) for op in "FB" for mb in range(microbatches))
    if microbatches < stages - stage - 1 and any(mb >= microbatches for _, mb in got):
        return (
            f"with fewer micro-batches than the pipe is deep, the warm-up is cut short: "
            f"min(P - s - 1, M) = {microbatches} forwards, not P - s - 1 ({shown})"
        )
    if sorted(got) != every:
        return (
            f"each of micro-batches 0..{microbatches - 1} needs exactly one F and one B ({shown})"
        )
    forward_at = {mb: i for i, (op, mb) in enumerate(got) if op == "F"}
    if any(op == "B" and i < forward_at[mb] for i, (op, mb) in enumerate(got)):
        return f"a micro-batch's B must come after its F ({shown})"
    gpipe = [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]
    warmup = min(stages - stage - 1, microbatches)
    if got == gpipe:
        return (
            "that is GPipe's order (all forwards, then all backwards), which holds all "
            f"{microbatches} micro-batches at once. 1F1B warms up with min(P - s - 1, M) = "
            f"{warmup} forwards and then alternates F and B ({shown})"
        )
    got_warmup = next(i for i, (op, _) in enumerate(got) if op == "B") - 1
    if _peak_live(got) > stages - stage:
        return (
            f"stage {stage} holds {_peak_live(got)} micro-batches' activations at once; 1F1B "
            f"holds at most P - s = {stages - stage}: warm up with P - s - 1 forwards, not "
            f"{got_warmup} ({shown})"
        )
    if got_warmup != warmup:
        return (
            f"stage {stage} should run min(P - s - 1, M) = {warmup} warm-up forwards (the "
            f"micro-batches still in the stages below it) before its first F-B pair, not "
            f"{got_warmup} ({shown})"
        )
    return f"after the warm-up, alternate one F and one B, then drain the B's left ({shown})"


# --------------------------------------------------------------------------- 2. micro-batches


def _gradient_cases():
    """(name, model factory, loss_fn, inputs, targets, micro-batches): equal and unequal cuts."""
    g = torch.Generator().manual_seed(6)

    def mlp() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = torch.randn(12, 3, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (12,), generator=g)
    mse, ce = nn.functional.mse_loss, nn.functional.cross_entropy
    return [
        ("12 rows, mean squared error, M = 4", mlp, mse, x, y, 4),
        ("12 rows, cross-entropy, M = 1", mlp, ce, x, labels, 1),
        ("10 rows, cross-entropy, M = 4 (unequal micro-batches)", mlp, ce, x[:10], labels[:10], 4),
        ("11 rows, mean squared error, M = 3 (unequal)", mlp, mse, x[:11], y[:11], 3),
    ]


def _weighted(make, loss_fn, x, y, rows, weights) -> tuple[list[torch.Tensor], float]:
    """The gradients and loss of sum_i weights[i] * (micro-batch i's mean loss), cut by rows."""
    model, total = make(), 0.0
    for xs, ys, w in zip(x.split(rows), y.split(rows), weights, strict=True):
        loss = w * loss_fn(model(xs), ys)
        if w:
            loss.backward()
        total += loss.item()
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ], total


def _close(got: list, want: list) -> bool:
    return all(
        a is not None and torch.allclose(a, b, rtol=1e-9, atol=1e-12)
        for a, b in zip(got, want, strict=True)
    )


@checker(
    "microbatch_gradients", writes=("dmlbook.model_parallel.pipeline.PipelineStage.train_step",)
)
def check_microbatch_gradients(fn: Callable[..., float]) -> str:
    """Check ``fn(model, loss_fn, inputs, targets, microbatches)`` runs M forwards (one per
    micro-batch, none of the whole batch), leaves in ``.grad`` the gradients of the whole batch's
    mean loss, and returns that loss, for equal and unequal micro-batches; a wrong answer is
    explained (1/M where micro-batches differ in size, no scaling, gradients zeroed between
    micro-batches, the mean of the micro-batch losses returned, ...)."""
    for name, make, loss_fn, x, y, microbatches in _gradient_cases():
        reference = make()
        want_loss = loss_fn(reference(x), y)
        want_loss.backward()
        want = [p.grad.clone() for p in reference.parameters()]

        model, rows = make(), []
        model.register_forward_pre_hook(lambda m, args, rows=rows: rows.append(len(args[0])))
        with learner_code(f"your answer on {name}"):
            got_loss = fn(model, loss_fn, x.clone(), y.clone(), microbatches)
        got = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        n = len(x)
        if microbatches > 1 and n in rows:
            raise ExerciseFailed(
                f"on {name}: a forward saw all {n} rows at once. Cut the batch into "
                f"{microbatches} micro-batches and run them one by one, as a pipeline's stages "
                "receive them"
            )
        if len(rows) != microbatches or sum(rows) != n:
            raise ExerciseFailed(
                f"on {name}: expected {microbatches} forwards that together cover the {n} rows "
                f"once, the model saw forwards of {rows} rows"
            )
        if any(grad is None for grad in got):
            raise ExerciseFailed(
                f"on {name}: some parameters have no .grad. Call backward on each micro-batch's "
                "loss, and keep the graph (no torch.no_grad, no .detach() before the loss)"
            )
        m = microbatches
        if not _close(got, want):
            slips = {
                f"they weight every micro-batch by 1/M, but these micro-batches hold {rows} rows: "
                "a micro-batch's mean loss counts for its share of the rows, n_i / N": [1 / m] * m,
                "they are the sum of the micro-batches' gradients, M times too large where the "
                "micro-batches are equal. Scale each micro-batch's mean loss by its share of the "
                "rows (1/M when they are equal) before backward": [1.0] * m,
                "they are the LAST micro-batch's alone. Backward adds into .grad: do not zero "
                "the gradients between micro-batches, let them accumulate": [0.0] * (m - 1)
                + [rows[-1] / n],
                "they are the LAST micro-batch's alone, scaled by 1/M. Backward adds into .grad: "
                "do not zero the gradients between micro-batches": [0.0] * (m - 1) + [1 / m],
            }
            hint = next(
                (
                    f": {why}"
                    for why, weights in slips.items()
                    if _close(got, _weighted(make, loss_fn, x, y, rows, weights)[0])
                ),
                "",
            )
            raise ExerciseFailed(
                f"on {name}: the gradients differ from those of one backward of the whole "
                f"batch's mean loss{hint}"
            )
        try:
            got_loss = float(got_loss)
        except (TypeError, ValueError) as error:
            raise ExerciseFailed(
                f"on {name}: return the batch's mean loss as a number, got {got_loss!r}"
            ) from error
        if abs(got_loss - want_loss.item()) > 1e-9:
            slips = {
                "the mean of the micro-batches' losses, which weights a short micro-batch as "
                "much as a long one; weight each by its share of the rows": [1 / m] * m,
                "the sum of the micro-batches' mean losses; weight each by its share of the rows": [
                    1.0
                ]
                * m,
            }
            hint = next(
                (
                    f": that is {why}"
                    for why, weights in slips.items()
                    if abs(got_loss - _weighted(make, loss_fn, x, y, rows, weights)[1]) <= 1e-9
                ),
                "",
            )
            raise ExerciseFailed(
                f"on {name}: the batch's mean loss is {want_loss.item():.6f}, got "
                f"{got_loss:.6f}{hint}"
            )
    return "the whole batch's gradients and mean loss from 1, 3 and 4 micro-batches, equal or not"
