"""Checkers for chapter 6's exercises ("Pipeline input and layer split").

1. ``check_one_f_one_b_order``: write ``order(stage, stages, microbatches) -> [(op, microbatch),
   ...]``, the order in which stage ``stage`` of a 1F1B pipeline runs its ops
   (:func:`dmlbook.model_parallel.pipeline.one_f_one_b_schedule` builds it for every stage). The
   hints name the mistake in the learner's own order and never print the expected one.
2. ``check_microbatch_gradients``: write ``grads(model, loss_fn, inputs, targets, microbatches)
   -> float``: run the batch through ``model`` as M micro-batches, one forward and one backward
   each, so that the gradients accumulated in ``.grad`` are those of the whole batch's mean loss,
   and return that loss. Micro-batches may differ in size (10 rows in 4), where the 1/M of
   :class:`dmlbook.model_parallel.pipeline.PipelineStage` (equal micro-batches only) is wrong:
   each micro-batch's mean loss counts for its share of the rows.
3. ``check_input_gradient`` and 4. ``check_weight_gradient`` (beyond the book, zero-bubble
   schedules): the two halves of a linear layer's backward, ``input_gradient(grad_y, weight) ->
   grad_x`` (B, which the previous stage waits for) and ``weight_gradient(x, grad_y) ->
   (grad_weight, grad_bias)`` (W, which can wait), each checked against autograd's one backward
   in float64 with autograd switched off (:mod:`dmlbook.model_parallel.backward_split` holds the
   library's split).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from dmlbook.exercises import ExerciseFailed, checker, learner_code
from dmlbook.model_parallel import pipeline as pp
from dmlbook.model_parallel import schedules

__all__ = [
    "check_input_gradient",
    "check_microbatch_gradients",
    "check_one_f_one_b_order",
    "check_weight_gradient",
]

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
    """Inside :func:`learner_code`: the executor's table of schedules by name holds the switched-off
    schedules too, so each gets the same stand-in as the module's name (``pp.SCHEDULES["1f1b"]``
    is no way round)."""
    originals = {name: schedules.SCHEDULES[name] for name in _ORDER_TABLE}
    for name, attribute in _ORDER_TABLE.items():  # the stand-ins, while switched off
        schedules.SCHEDULES[name] = getattr(schedules, attribute)
    try:
        yield
    finally:
        schedules.SCHEDULES.update(originals)


# Each schedule whose F and B ops are 1F1B's order: 1F1B itself, interleaved 1F1B with one chunk,
# and ZB-H1 without its W ops. All three are switched off while the learner's order runs.
_ORDER_TABLE = {"1f1b": "one_f_one_b_schedule", "interleaved": "interleaved_schedule",
                "zb-h1": "zb_h1_schedule"}  # fmt: skip


@checker(
    "one_f_one_b_order",
    writes=tuple(f"dmlbook.model_parallel.pipeline.{name}" for name in _ORDER_TABLE.values()),
)
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


def _stages_after(stage: int, stages: int) -> str:
    after = stages - stage - 1
    return f"{after} stage{'s' if after != 1 else ''} after this one"


def _diagnose(got, want, stage: int, stages: int, microbatches: int) -> str:
    """Say what is wrong with a 1F1B order, most telling mistake first. The hint names the cause
    and points at the learner's own ops; it never prints the expected order."""
    yours = " ".join(f"{o}{m}" for o, m in got)
    if any(mb < 0 or mb >= microbatches for _, mb in got):
        ghost = next(mb for _, mb in got if mb < 0 or mb >= microbatches)
        why = (
            ". Where the stages after this one outnumber the micro-batches, the warm-up runs out "
            "of micro-batches before it runs out of stages"
            if microbatches < stages - stage - 1
            else ""
        )
        return (
            f"your order ({yours}) names micro-batch {ghost}, but there are only "
            f"{microbatches} (0..{microbatches - 1}){why}"
        )
    counts = {(op, mb): got.count((op, mb)) for op in "FB" for mb in range(microbatches)}
    wrong = [f"{op}{mb} x{n}" for (op, mb), n in counts.items() if n != 1]
    if wrong or len(got) != 2 * microbatches:
        return (
            f"each of micro-batches 0..{microbatches - 1} needs exactly one F and one B; your "
            f"order ({yours}) has {', '.join(wrong) or 'extra ops'}"
        )
    forward_at = {mb: i for i, (op, mb) in enumerate(got) if op == "F"}
    early = [mb for i, (op, mb) in enumerate(got) if op == "B" and i < forward_at[mb]]
    if early:
        return (
            f"your B{early[0]} comes before F{early[0]}: a micro-batch's backward needs the "
            "activations its forward saved"
        )
    f_order = [mb for op, mb in got if op == "F"]
    b_order = [mb for op, mb in got if op == "B"]
    if f_order != sorted(f_order) or b_order != f_order:
        return (
            f"your order ({yours}) runs the micro-batches' forwards or backwards out of turn. "
            "Every stage must run forwards in the order 0, 1, 2, ... and backwards in the same "
            "order, or a stage would wait for a message its neighbour sends later"
        )
    gpipe = [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]
    warmup = min(stages - stage - 1, microbatches)
    got_warmup = next(i for i, (op, _) in enumerate(got) if op == "B") - 1
    if got == gpipe and got != want:
        return (
            "that is GPipe's order (all forwards, then all backwards), which holds all "
            f"{microbatches} micro-batches' activations at once on every stage. 1F1B runs a "
            "stage's first backward as soon as its gradient can be back, and from then on "
            "alternates"
        )
    if got_warmup > warmup:
        return (
            f"stage {stage} of {stages} holds {_peak_live(got)} micro-batches' activations at "
            f"once in your order, more than the {min(stages - stage, microbatches)} it needs. "
            "Its first backward "
            f"waits for micro-batch 0 to cross the stages after it; your warm-up of "
            f"{got_warmup} forwards (before the forward that pairs with the first backward) is "
            "longer than that wait"
        )
    if got_warmup < warmup:
        return (
            f"your stage {stage} of {stages} runs {got_warmup + 1} forward"
            f"{'s' if got_warmup else ''} before its first "
            f"backward (a warm-up of {got_warmup}, counting the forward that pairs with that "
            "backward as the first of the alternation), but that backward waits for micro-batch "
            "0 to go through the "
            f"{_stages_after(stage, stages)} and its gradient to come back. With "
            "so short a warm-up the stage sits idle through that wait where it could have run "
            "forwards"
        )
    first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    return (
        f"your warm-up is right, but after it your order ({yours}) stops alternating one F "
        f"and one B at op {first} ({got[first][0]}{got[first][1]}); alternate until the "
        "forwards run out, then drain the backwards left"
    )


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


def _record_backward(events: list):
    """A forward hook that logs ("F", k) for the k-th forward and ("B", k) when backward reaches
    that forward's output: the order in which the answer interleaves them."""

    def hook(module, args, output):
        k = sum(op == "F" for op, _ in events)
        events.append(("F", k))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: events.append(("B", k)))

    return hook


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
    micro-batches, all forwards before one backward of the summed losses, the mean or the last of
    the micro-batch losses returned, a tensor returned, ...)."""
    for name, make, loss_fn, x, y, microbatches in _gradient_cases():
        reference = make()
        want_loss = loss_fn(reference(x), y)
        want_loss.backward()
        want = [p.grad.clone() for p in reference.parameters()]

        model, rows, events = make(), [], []
        model.register_forward_pre_hook(lambda m, args, rows=rows: rows.append(len(args[0])))
        model.register_forward_hook(_record_backward(events))
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
        backward_of = {k: i for i, (op, k) in enumerate(events) if op == "B"}
        forward_at = [i for i, (op, _) in enumerate(events) if op == "F"]
        if any(k not in backward_of or (k + 1 < len(forward_at) and backward_of[k] > forward_at[
            k + 1]) for k in range(len(forward_at))):  # fmt: skip
            order = " ".join(f"{op}{k}" for op, k in events)
            raise ExerciseFailed(
                f"on {name}: your forwards and backwards ran in the order {order} (F: a "
                "micro-batch's forward, B: the backward reaching its output). A micro-batch's "
                "backward must run before the next micro-batch's forward: one backward of the "
                "summed losses keeps every micro-batch's graph, and its activations, alive at "
                "once, which is the memory that accumulating over micro-batches saves. Call "
                "backward on each micro-batch's loss as soon as you have it"
            )
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
        if isinstance(got_loss, torch.Tensor):
            raise ExerciseFailed(
                f"on {name}: return the loss as a Python float (tensor.item()), not a tensor: a "
                "tensor that required grad keeps its graph and activations alive"
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
                "the last micro-batch's mean loss alone: the batch's loss takes every "
                "micro-batch's, each weighted by its share of the rows": [0.0] * (m - 1) + [1.0],
                "the last micro-batch's share alone (a variable overwritten in the loop?): add "
                "up every micro-batch's share": [0.0] * (m - 1) + [rows[-1] / n],
            }
            hint = next(
                (
                    f": that is {why}"
                    for why, weights in slips.items()
                    if abs(got_loss - _weighted(make, loss_fn, x, y, rows, weights)[1]) <= 1e-9
                ),
                ": the batch's mean loss is loss_fn over all its rows, which the micro-batches' "
                "losses give when each counts for its share of the rows",
            )
            raise ExerciseFailed(
                f"on {name}: the batch's mean loss is {want_loss.item():.6f}, got "
                f"{got_loss:.6f}{hint}"
            )
    return "the whole batch's gradients and mean loss from 1, 3 and 4 micro-batches, equal or not"


# --------------------------------------------------------------------------- 3. the B/W split

# What does the job the learner writes: the split itself, and every autograd way to a gradient
# (a layer's forward and a backward, a vector-Jacobian product, a Jacobian).
_SPLIT_WRITES = (
    "dmlbook.model_parallel.backward_split.linear_input_gradient",
    "dmlbook.model_parallel.backward_split.linear_weight_gradient",
    "torch.autograd.grad",
    "torch.autograd.backward",
    "torch.Tensor.backward",
    "torch.func.vjp",
    "torch.func.grad",
    "torch.func.jacrev",
    "torch.func.jacfwd",
)

# (what the case is, leading dims of x, in_features, out_features): a square weight first, where a
# transposed product still has the right shape, then rows of sequences, one row, and more dims
_SPLIT_CASES = [
    ("5 rows into Linear(4, 4)", (5,), 4, 4),
    ("5 rows into Linear(4, 6)", (5,), 4, 6),
    ("x of shape (5, 3, 4) (5 sequences of 3 tokens) into Linear(4, 6)", (5, 3), 4, 6),
    ("1 row into Linear(3, 2)", (1,), 3, 2),
    ("x of shape (2, 3, 2, 5) into Linear(5, 3)", (2, 3, 2), 5, 3),
]


def _split_case(leading: tuple[int, ...], fan_in: int, fan_out: int, seed: int):
    """x, W, b and grad_y in float64, and what autograd's one backward of y = x W^T + b gives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, fan_in, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(fan_out, fan_in, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(fan_out, dtype=torch.float64, generator=g, requires_grad=True)
    grad_y = torch.randn(*leading, fan_out, dtype=torch.float64, generator=g)
    y = nn.functional.linear(x, weight, bias)
    want = torch.autograd.grad(y, (x, weight, bias), grad_y)  # the checker's reference
    return x.detach(), weight.detach(), grad_y, want


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def _call_split(fn: Callable, args: tuple, what: str, shape_hint: str) -> object:
    """Run the learner's ``fn(*args)``; an error that is not "not attempted" or "called the
    library" fails with ``shape_hint``, the likely cause on this case."""
    try:
        with learner_code(what):
            return fn(*(a.clone() for a in args))
    except ExerciseFailed as failure:
        if "called the library instead" in str(failure):
            raise
        raise ExerciseFailed(f"{failure}. {shape_hint}") from failure.__cause__


def _check_input_gradient(fn: Callable, case: str, weight, grad_y, want_x, fan_in, fan_out):
    got = _call_split(
        fn,
        (grad_y, weight),
        f"your input_gradient on {case}",
        f"Shapes: weight is (out_features, in_features) = ({fan_out}, {fan_in}), grad_y is "
        f"(..., out_features) and grad_x must be (..., in_features), the shape of x: which "
        "dimension does your product sum over?",
    )
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailed(f"on {case}: return grad_x as a tensor, got {type(got).__name__}")
    if got.shape != want_x.shape:
        raise ExerciseFailed(
            f"on {case}: grad_x must have x's shape {tuple(want_x.shape)} (one gradient per "
            f"input number), got {tuple(got.shape)}"
        )
    if _same(got, want_x):
        return
    if fan_in == fan_out and _same(got, grad_y @ weight.T):
        raise ExerciseFailed(
            f"on {case}: your grad_x is grad_y times the TRANSPOSED weight. y = x W^T maps "
            "in_features to out_features; the gradient goes back the other way, from "
            "out_features to in_features, so W is not transposed on the way back"
        )
    raise ExerciseFailed(
        f"on {case}: grad_x differs from autograd's by up to {(got - want_x).abs().max():.3g}: "
        "each input number x[..., i] reaches every output y[..., j] through W[j, i]"
    )


def _check_weight_gradient(fn: Callable, case: str, x, grad_y, want_w, want_b, leading):
    got = _call_split(
        fn,
        (x, grad_y),
        f"your weight_gradient on {case}",
        f"x has {len(leading)} leading dim{'s' if len(leading) > 1 else ''} {leading}: every "
        "row of every sequence is one more row of the batch, and the weight's gradient sums over "
        "all of them (flatten the leading dims into rows first)",
    )
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise ExerciseFailed(
            f"on {case}: return the pair (grad_weight, grad_bias), got "
            + (
                f"a tensor of shape {tuple(got.shape)}"
                if isinstance(got, torch.Tensor)
                else f"{type(got).__name__}"
            )  # fmt: skip
            + ". The bias is a parameter too: W computes its gradient as well"
        )
    grad_w, grad_b = got
    if not (isinstance(grad_w, torch.Tensor) and isinstance(grad_b, torch.Tensor)):
        raise ExerciseFailed(f"on {case}: return two tensors (grad_weight, grad_bias)")
    rows_x, rows_g = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    if not _same(grad_w, want_w):
        if _same(grad_w, want_w.T) or grad_w.shape == want_w.T.shape != want_w.shape:
            what = (
                "is the transpose of the right one"
                if grad_w.shape == want_w.shape
                else f"has the shape (in_features, out_features) {tuple(grad_w.shape)}"
            )
            raise ExerciseFailed(
                f"on {case}: your grad_weight {what}: the gradient of W has W's shape "
                f"(out_features, in_features) = {tuple(want_w.shape)}, its entry [j, i] pairing "
                "output j with input i"
            )
        if grad_w.shape != want_w.shape:
            raise ExerciseFailed(
                f"on {case}: grad_weight must have the weight's shape {tuple(want_w.shape)}, got "
                f"{tuple(grad_w.shape)}. x has leading dims {leading}: every row of every "
                "sequence is one more row of the batch, and W's gradient sums over all of them"
            )
        if len(rows_x) > 1 and _same(grad_w, want_w / len(rows_x)):
            raise ExerciseFailed(
                f"on {case}: your grad_weight is the MEAN over the {len(rows_x)} rows: the loss "
                "already averages (grad_y carries that 1/N); the rows' contributions add up"
            )
        raise ExerciseFailed(
            f"on {case}: grad_weight differs from autograd's by up to "
            f"{(grad_w - want_w).abs().max():.3g}: W[j, i] meets x[..., i] and y[..., j] in "
            "every row"
        )
    if grad_b.shape != want_b.shape:
        raise ExerciseFailed(
            f"on {case}: grad_bias must have the bias's shape {tuple(want_b.shape)}, one number "
            f"per output, got {tuple(grad_b.shape)}: the bias is added to every row, so its "
            "gradient sums grad_y over all the rows (every leading dim)"
        )
    if not _same(grad_b, want_b):
        if len(rows_g) > 1 and _same(grad_b, rows_g.mean(0)):
            why = "the MEAN of grad_y over the rows; the bias is added to every row, so sum"
        elif _same(grad_b, rows_g[-1]) or _same(grad_b, rows_g[0]):
            why = "one row's grad_y; the bias is added to every row, so sum over all of them"
        else:
            why = "the bias is added to every row: its gradient sums grad_y over all the rows"
        raise ExerciseFailed(f"on {case}: grad_bias differs from autograd's: {why}")


_INPUT_WRITES = tuple(n for n in _SPLIT_WRITES if not n.endswith("linear_weight_gradient"))
_WEIGHT_WRITES = tuple(n for n in _SPLIT_WRITES if not n.endswith("linear_input_gradient"))


@checker("input_gradient", writes=_INPUT_WRITES)
def check_input_gradient(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> str:
    """Check ``fn(grad_y, weight) -> grad_x``, B of ``y = x W^T + b``, against autograd's one
    backward in float64 on a square and a wide weight, rows of sequences, one row and 4-D inputs,
    with autograd (and the library's split) switched off while it runs. A wrong answer is
    explained (the weight transposed, a product over the wrong dimension, a wrong shape)."""
    for seed, (case, leading, fan_in, fan_out) in enumerate(_SPLIT_CASES):
        _, weight, grad_y, (want_x, _, _) = _split_case(leading, fan_in, fan_out, seed)
        _check_input_gradient(fn, case, weight, grad_y, want_x, fan_in, fan_out)
    return f"B of a linear layer equals autograd's on {len(_SPLIT_CASES)} shapes, 1 row to 4-D"


@checker("weight_gradient", writes=_WEIGHT_WRITES)
def check_weight_gradient(fn: Callable[[torch.Tensor, torch.Tensor], tuple]) -> str:
    """Check ``fn(x, grad_y) -> (grad_weight, grad_bias)``, W of ``y = x W^T + b``, against
    autograd's one backward in float64 on the same shapes, with autograd (and the library's
    split) switched off while it runs. A wrong answer is explained (the gradient transposed,
    leading dims not summed over, a mean instead of a sum, the bias's gradient missing or not
    summed)."""
    for seed, (case, leading, fan_in, fan_out) in enumerate(_SPLIT_CASES):
        x, _, grad_y, (_, want_w, want_b) = _split_case(leading, fan_in, fan_out, seed)
        _check_weight_gradient(fn, case, x, grad_y, want_w, want_b, leading)
    return f"W of a linear layer equals autograd's on {len(_SPLIT_CASES)} shapes, 1 row to 4-D"
