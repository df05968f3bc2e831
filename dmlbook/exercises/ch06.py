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
   schedules): a block ``Linear -> tanh -> Linear`` written as a class, ``block_class(w1, b1, w2,
   b2)``, whose backward is split as a pipeline stage's is. Exercise 3: ``forward(x)``, which
   keeps what the backward will need, and ``input_gradient(grad_y) -> grad_x`` (B, which the
   previous stage waits for), computing no weight gradient; exercise 4, a subclass adding
   ``weight_gradient() -> {"w1", "b1", "w2", "b2"}`` (W, which can wait), from what the forward
   and B kept. Each is checked against autograd's one backward in float64 with autograd, the
   library's split and every aten backward op switched off; matrix products (and multiplies that
   broadcast two factors into an outer product) are counted, so that a B that also computes
   weight gradients or recomputes the forward, or a W that redoes B's products, is named
   (:mod:`dmlbook.model_parallel.backward_split` holds the library's split).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from math import prod
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dmlbook.exercises import ExerciseFailed, SwitchedOff, checker, learner_code
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


# ------------------------------------------------------------------------ 3-4. B and W of a block

# What does the job the learner writes: the library's split, every autograd way to a gradient (a
# backward, a vector-Jacobian product, a Jacobian) and, through :class:`_LibraryBackwardOff`,
# every aten backward op (``torch.ops.aten.linear_backward``, ``tanh_backward``, ...).
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

# (what the case is, leading dims of x, in, hidden, out): all-square first, where a transposed
# product still has the right shape, then rows, rows of sequences and one row
_BLOCK_CASES = [
    ("5 rows through 4 -> 4 -> 4 features", (5,), 4, 4, 4),
    ("5 rows through 4 -> 6 -> 3 features", (5,), 4, 6, 3),
    ("x of shape (5, 3, 4) (5 sequences of 3 tokens) through 4 -> 6 -> 3", (5, 3), 4, 6, 3),
    ("1 row through 3 -> 5 -> 2 features", (1,), 3, 5, 2),
]
_NAMES = ("w1", "b1", "w2", "b2")

# The matrix products an aten op runs, as multiply-adds: (op name, where its two factors are)
_PRODUCTS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "mv": (0, 1),
             "addmv": (1, 2), "dot": (0, 1), "vdot": (0, 1)}  # fmt: skip


# Multiplies whose two factors broadcast into a larger result are products too: g[:, :, None] *
# x[:, None, :] is the outer product of each row, one multiply-add per number of the result
# (summed over the rows afterwards, it is g^T x). An elementwise multiply is not counted.
_BROADCAST_PRODUCTS = {"mul": (0, 1), "addcmul": (1, 2)}


def _multiply_adds(name: str, args: tuple) -> int:
    if name in _BROADCAST_PRODUCTS:
        factors = [args[i] for i in _BROADCAST_PRODUCTS[name] if isinstance(args[i], torch.Tensor)]
        if len(factors) < 2:
            return 0
        try:
            result = prod(torch.broadcast_shapes(*(f.shape for f in factors)))
        except RuntimeError:
            return 0  # no shapes to broadcast: the op itself raises its own error
        return result if result > max(f.numel() for f in factors) else 0
    if name not in _PRODUCTS:
        return 0
    i, j = _PRODUCTS[name]
    a, b = args[i], args[j]
    return a.numel() * (b.shape[-1] if b.dim() > 1 else 1)


class _LibraryBackwardOff(TorchDispatchMode):
    """While the learner's code runs: every aten op named ``*_backward*`` (a library backward,
    however it is reached: ``torch.ops.aten.linear_backward``, ``torch.ops.aten.tanh_backward``,
    ...) raises :class:`SwitchedOff`, and the multiply-adds of matrix products are counted, with
    the shapes that products and sums made (a weight's shape: a weight gradient, probably)."""

    def __init__(self) -> None:
        super().__init__()
        self.multiply_adds = 0
        self.made: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if "_backward" in name:
            raise SwitchedOff(
                f"torch.ops.aten.{name} is switched off in this exercise: it is a library "
                "backward, which does the very job you are asked to write (on CPU some have no "
                "kernel at all). Write the mechanism yourself, with matrix products"
            )
        counted = _multiply_adds(name, args)
        self.multiply_adds += counted
        out = func(*args, **(kwargs or {}))
        if (counted or name == "sum") and isinstance(out, torch.Tensor):
            self.made.add(tuple(out.shape))
        return out


@contextmanager
def _your(what: str) -> Iterator[_LibraryBackwardOff]:
    """:func:`learner_code` with the library's backwards switched off and the products counted.
    A NotImplementedError raised inside torch (an op with no CPU kernel) is a library op, not the
    unfilled stub, whose ``raise NotImplementedError`` is the learner's own line."""
    try:
        with learner_code(what), _LibraryBackwardOff() as mode:
            yield mode
    except NotImplementedError as error:
        if not _raised_inside_torch(error):
            raise  # the stub's `raise NotImplementedError`: not attempted
        raise ExerciseFailed(
            f"{what} raised NotImplementedError from inside torch ({str(error)[:120]}...): a "
            "library op is not the exercise; write the mechanism with matrix products"
        ) from error


def _raised_inside_torch(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is in torch's own files."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    torch_dir = str(Path(torch.__file__).parent)
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(torch_dir)


def _block_case(seed: int, leading: tuple[int, ...], fan_in: int, hidden: int, fan_out: int):
    """The block's parameters, x, grad_y and what autograd's one backward gives, in float64:
    (params, x, grad_y, reference) with reference holding y, h, a, grad_a, grad_h, grad_x and
    the four parameters' gradients."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=g)

    params = {"w1": rand(hidden, fan_in), "b1": rand(hidden), "w2": rand(fan_out, hidden),
              "b2": rand(fan_out)}  # fmt: skip
    x, grad_y = rand(*leading, fan_in), rand(*leading, fan_out)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    xr = x.clone().requires_grad_()
    h = nn.functional.linear(xr, leaves["w1"], leaves["b1"])
    h.retain_grad()
    a = torch.tanh(h)
    a.retain_grad()
    y = nn.functional.linear(a, leaves["w2"], leaves["b2"])
    y.backward(grad_y)  # the checker's reference: autograd's one backward of the whole block
    reference = {"y": y.detach(), "h": h.detach(), "a": a.detach(), "grad_a": a.grad,
                 "grad_h": h.grad, "grad_x": xr.grad, "grad_y": grad_y}  # fmt: skip
    reference |= {k: v.grad for k, v in leaves.items()}
    return params, x, grad_y, reference


def _same(got: object, want: torch.Tensor) -> bool:
    return (
        isinstance(got, torch.Tensor)
        and got.shape == want.shape
        and torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _tensors_in(value: object, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor a block keeps: its attributes, and what dicts, lists and tuples hold."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif depth < 3 and isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item, depth + 1)


def _b_did_w(block: object, params: dict, ref: dict, mode: _LibraryBackwardOff, needed: int,
             case: str) -> None:  # fmt: skip
    """Fail if B did more than the two products that carry the gradient to x: a ``.grad``
    written, a kept tensor equal to a weight's gradient, or more products, named as weight
    gradients where a product or a sum made a tensor of a weight's shape, else as work B need not
    do (recomputing the forward, say)."""
    kept = list(_tensors_in(dict(vars(block)) if hasattr(block, "__dict__") else {}))
    found = [k for k in ("w1", "w2") if any(_same(t, ref[k]) for t in kept)]
    graded = [k for k, p in params.items() if p.grad is not None]
    extra = mode.multiply_adds - needed
    more = f"ran {extra} multiply-adds more than the two products that carry the gradient to x"
    shaped = [k for k in ("w1", "w2") if tuple(params[k].shape) in mode.made]
    if extra > 0 and not (found or graded or shaped):
        raise ExerciseFailed(
            f"on {case}: your B {more} (recomputing the forward?). B is on the critical "
            "path: the previous stage waits for grad_x, so B runs those two products and no "
            "more; what it needs from the forward, the forward keeps"
        )
    if extra > 0 or found or graded:
        how = (
            f"it wrote .grad of {', '.join(graded)}"
            if graded
            else f"it keeps the gradient of {found[0]}"
            if found
            else f"it {more}, and made a tensor of {shaped[0]}'s shape"
        )
        raise ExerciseFailed(
            f"on {case}: your B computed weight gradients too ({how}). That is W's work: B is on "
            "the critical path (the previous stage waits for grad_x), W is not, and ZB-H1 "
            "fills its idle slots with W. B keeps what W will need and leaves the weight "
            "products to W"
        )


def _run_block_b(fn: Callable, case: str, params: dict, x, grad_y, ref: dict):
    """The learner's block: built, forward on x, then B on grad_y, each checked. Returns it."""
    with _your(f"your block on {case}"):
        block = fn(*(params[k] for k in _NAMES))
    with _your(f"your forward on {case}"):
        y = block.forward(x.clone())
    if not _same(y, ref["y"]):
        raise ExerciseFailed(
            f"on {case}: your forward's y differs from the block's y = tanh(x W1^T + b1) W2^T + "
            "b2" + (f" (shape {tuple(y.shape)}, want {tuple(ref['y'].shape)})"
                    if isinstance(y, torch.Tensor) else f" (got {type(y).__name__})")
        )  # fmt: skip
    with _your(f"your input_gradient (B) on {case}") as mode:
        grad_x = block.input_gradient(grad_y.clone())
    rows, want = len(_rows(x)), ref["grad_x"]
    hidden, fan_in = params["w1"].shape
    needed = rows * params["w2"].shape[0] * hidden + rows * hidden * fan_in
    if not isinstance(grad_x, torch.Tensor):
        raise ExerciseFailed(
            f"on {case}: B returns grad_x as a tensor, got {type(grad_x).__name__}"
        )
    if grad_x.shape != want.shape:
        raise ExerciseFailed(
            f"on {case}: grad_x must have x's shape {tuple(want.shape)} (one gradient per input "
            f"number), got {tuple(grad_x.shape)}: which dimension does each product sum over?"
        )
    if not _same(grad_x, want):
        raise ExerciseFailed(f"on {case}: {_diagnose_b(grad_x, params, grad_y, ref)}")
    _b_did_w(block, params, ref, mode, needed, case)
    return block


def _diagnose_b(grad_x, params: dict, grad_y, ref: dict) -> str:
    """Name the cause of a wrong grad_x: a transposed weight, tanh's derivative missing or taken
    at the wrong tensor."""
    w1, w2, h, a = params["w1"], params["w2"], ref["h"], ref["a"]
    tanh = "tanh'(h) = 1 - tanh(h)^2 = 1 - a^2, from the a your forward kept"
    square = w1.shape[0] == w1.shape[1] and w2.shape[0] == w2.shape[1]
    slips = {
        "tanh's derivative is missing: between the two layers the gradient passes through tanh, "
        "which scales each number by tanh'(h)": (grad_y @ w2) @ w1,
        "tanh's derivative is taken at the wrong tensor: 1 - h^2 uses the pre-activation h, "
        f"but {tanh}": ((grad_y @ w2) * (1 - h**2)) @ w1,
        f"tanh's derivative is taken at a, tanh's output (1 - tanh(a)^2): {tanh}": (
            (grad_y @ w2) * (1 - torch.tanh(a) ** 2)
        )
        @ w1,
        f"tanh's derivative is not a: {tanh}": ((grad_y @ w2) * a) @ w1,
        f"tanh's derivative is not 1 - a: {tanh}": ((grad_y @ w2) * (1 - a)) @ w1,
        "it stops at layer 1's output h: the gradient of x goes on back through layer 1, by W1": (
            grad_y @ w2
        )
        * (1 - a**2),
    }
    if square:
        slips |= {
            "it multiplies by a TRANSPOSED weight. y = a W2^T maps hidden to out features; the "
            "gradient goes back the other way, so on the way back W2 is not transposed (and "
            "the same for W1)": ((grad_y @ w2.T) * (1 - a**2)) @ w1,
            "it multiplies by a TRANSPOSED W1: h = x W1^T maps in to hidden features; the "
            "gradient goes back the other way, by W1 itself": ((grad_y @ w2) * (1 - a**2)) @ w1.T,
            "it multiplies by both weights TRANSPOSED: the gradient goes back the other way "
            "through each layer, so neither is transposed": ((grad_y @ w2.T) * (1 - a**2)) @ w1.T,
        }
    why = next((w for w, wrong in slips.items() if _same(grad_x, wrong)), None)
    if why:
        return f"your grad_x differs from autograd's: {why}"
    return (
        f"your grad_x differs from autograd's by up to {(grad_x - ref['grad_x']).abs().max():.3g}: "
        "go back through the block one step at a time, layer 2, then tanh, then layer 1"
    )


def _diagnose_w(name: str, got: torch.Tensor, ref: dict, x) -> str:
    """Name the cause of a wrong weight or bias gradient."""
    want = ref[name]
    out_grad = _rows(ref["grad_y"] if name in ("w2", "b2") else ref["grad_h"])
    layer_in = _rows(ref["a"] if name == "w2" else x)
    layer = "layer 2" if name in ("w2", "b2") else "layer 1"
    if name.startswith("b"):
        if got.shape != want.shape and got.shape[-1:] == want.shape:
            return (
                f"{name} has the shape {tuple(got.shape)}, not the bias's {tuple(want.shape)}: "
                "the bias is added to every row, so its gradient sums the output gradient over "
                "all the rows (a forgotten sum over the batch)"
            )
        if _same(got, out_grad.mean(0)):
            return f"{name} is the MEAN of the output gradient over the rows; the rows add up"
        if name == "b1" and _same(got, _rows(ref["grad_a"]).sum(0)):
            return (
                "b1 sums the gradient at tanh's output a; b1 is added before tanh, at layer 1's "
                "output h, whose gradient is grad_a * (1 - a^2): keep that one from B"
            )
        return f"{name} differs from autograd's: sum {layer}'s output gradient over the rows"
    if got.shape != want.shape:
        if got.shape == want.T.shape:
            what = f"has the shape (in, out) {tuple(got.shape)}"
        else:
            what = f"has the shape {tuple(got.shape)}"
        return f"{name} {what}, not the weight's {tuple(want.shape)}" + (
            ": x has leading dims, and every row of every sequence is one more row of the "
            "batch: flatten the leading dims into rows first, then sum over all of them"
            if got.dim() > 2
            else ", its entry [j, i] pairing output j with input i"
        )
    rows = len(layer_in)
    slips = {}
    if out_grad.shape[1] == layer_in.shape[1]:  # square: a transposed product keeps the shape
        slips[
            f"{name} is the transpose of the right one: a weight's gradient has the weight's "
            "shape (out, in), its entry [j, i] pairing output j with input i"
        ] = (out_grad.T @ layer_in).T
    slips[f"{name} is the MEAN over the {rows} rows; the rows add up"] = (
        out_grad.T @ layer_in
    ) / rows
    if name == "w2":
        slips[
            "w2 is computed from the pre-activation h; layer 2's input is a = tanh(h), so "
            "keep a from the forward"
        ] = out_grad.T @ _rows(ref["h"])
    else:
        slips[
            "w1 is computed from the gradient at tanh's output a; layer 1's output is h, "
            "before tanh, whose gradient is grad_a * (1 - a^2): keep that one from B"
        ] = _rows(ref["grad_a"]).T @ layer_in
        for saved in ("a", "h"):
            slips[
                f"w1 is computed from the wrong saved tensor ({saved}): layer 1's input is x "
                "itself, keep it from the forward"
            ] = out_grad.T @ _rows(ref[saved])
    why = next(
        (w for w, wrong in slips.items() if wrong.shape == want.shape and _same(got, wrong)), None
    )
    return why or (
        f"{name} differs from autograd's by up to {(got - want).abs().max():.3g}: a weight's "
        f"gradient pairs each row's output gradient with that row's input to {layer}, summed "
        "over the rows"
    )


@checker("input_gradient", writes=_SPLIT_WRITES)
def check_input_gradient(block_class: Callable[..., object]) -> str:
    """Check ``block_class(w1, b1, w2, b2)``, a block Linear -> tanh -> Linear whose ``forward(x)``
    keeps what its backward needs and whose ``input_gradient(grad_y)`` is B: ``grad_x`` against
    autograd's one backward in float64 on four shapes, with autograd and every library backward
    switched off. A wrong answer is explained (a transposed weight, tanh's derivative missing
    or taken at h or a, a wrong factor, a wrong shape, B that computes weight gradients too: more
    products than the two that reach x making a weight's shape, a kept weight gradient or a
    ``.grad`` written, and B that runs other products, recomputing the forward, say)."""
    for seed, (case, leading, fan_in, hidden, fan_out) in enumerate(_BLOCK_CASES):
        params, x, grad_y, ref = _block_case(seed, leading, fan_in, hidden, fan_out)
        _run_block_b(block_class, case, params, x, grad_y, ref)
    return (
        f"B of Linear -> tanh -> Linear equals autograd's input gradient on {len(_BLOCK_CASES)} "
        "shapes and computes no weight gradient"
    )


@checker("weight_gradient", writes=_SPLIT_WRITES)
def check_weight_gradient(block_class: Callable[..., object]) -> str:
    """Check the block of exercise 3 with ``weight_gradient()`` (W) added: after its forward and
    B, W returns ``{"w1", "b1", "w2", "b2"}`` equal to autograd's weight gradients, from what the
    forward and B kept, redoing none of B's products. A wrong answer is explained (transposed,
    from h instead of a, from the gradient at a instead of h, from the wrong saved tensor, a
    bias not summed over the rows, a mean, leading dims not flattened, B's products redone)."""
    for seed, (case, leading, fan_in, hidden, fan_out) in enumerate(_BLOCK_CASES):
        params, x, grad_y, ref = _block_case(seed, leading, fan_in, hidden, fan_out)
        block = _run_block_b(block_class, case, params, x, grad_y, ref)
        with _your(f"your weight_gradient (W) on {case}") as mode:
            grads = block.weight_gradient()
        if not (isinstance(grads, dict) and set(grads) == set(_NAMES)):
            raise ExerciseFailed(
                f"on {case}: W returns a dict with the keys {list(_NAMES)}, got "
                + (f"the keys {sorted(grads)}" if isinstance(grads, dict) else type(grads).__name__)
                + ". The biases are parameters too: W computes their gradients as well"
            )
        for name in _NAMES:
            got = grads[name]
            if not isinstance(got, torch.Tensor):
                raise ExerciseFailed(
                    f"on {case}: {name}'s gradient must be a tensor, got {type(got).__name__}"
                )
            if not _same(got, ref[name]):
                raise ExerciseFailed(f"on {case}: {_diagnose_w(name, got, ref, x)}")
        rows = len(_rows(x))
        needed = rows * fan_out * hidden + rows * hidden * fan_in
        redone = rows * fan_out * hidden  # B's product grad_y W2, the smaller of B's two
        if mode.multiply_adds - needed >= redone:  # a bias as ones @ grad_y costs less: fine
            raise ExerciseFailed(
                f"on {case}: your W ran {mode.multiply_adds - needed} multiply-adds more than "
                "the two weight products: it redid a product B had already computed (the "
                "gradient at layer 1's output, grad_y W2, say). Keep B's result for W instead "
                "of computing it twice"
            )
    return (
        f"W of Linear -> tanh -> Linear equals autograd's weight gradients on {len(_BLOCK_CASES)} "
        "shapes, from what the forward and B kept"
    )
