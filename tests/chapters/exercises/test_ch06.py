"""Chapter 6's exercise checkers: right answers pass; planted bugs (GPipe's order, a warm-up one
too long or too short, no min() for M < P, a B before its F, micro-batches out of turn; micro-batch
losses not scaled by 1/M, gradients zeroed between micro-batches, the whole batch in one forward,
one backward of the summed losses, the summed, last or a tensor loss returned; a linear layer's B
with the weight transposed, its W transposed, not summed over leading dims, averaged, or without
the bias) are caught with a message that says so, and no order hint prints the expected order; an
answer that calls the library (or autograd) is told to write the mechanism
(``DELEGATING_ANSWERS``, run by ``test_back_doors.py``)."""

import pytest
import torch

from dmlbook.exercises import ExerciseFailed, ch06
from dmlbook.model_parallel import backward_split as bs
from dmlbook.model_parallel import pipeline as pp


def unanswered(*args):
    raise NotImplementedError


def order(stage, stages, microbatches):
    warmup = min(stages - stage - 1, microbatches)
    ops = [("F", mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", mb) for mb in range(microbatches - warmup, microbatches)]


def order_gpipe(stage, stages, microbatches):
    return [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]


def _with_warmup(warmup, microbatches):
    ops = [("F", mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", mb) for mb in range(microbatches - warmup, microbatches)]


def order_warmup_too_long(stage, stages, microbatches):
    return _with_warmup(min(stages - stage, microbatches), microbatches)


def order_no_warmup(stage, stages, microbatches):
    return _with_warmup(0, microbatches)


def order_without_min(stage, stages, microbatches):
    return _with_warmup(stages - stage - 1, microbatches)


def order_backward_first(stage, stages, microbatches):
    return [("B", 0)] + [op for op in order(stage, stages, microbatches) if op != ("B", 0)]


def order_unpaired(stage, stages, microbatches):
    return [("F", 0), ("B", 0)]


def order_out_of_turn(stage, stages, microbatches):
    ops = order(stage, stages, microbatches)
    return [("F", 1), ("F", 0)] + ops[2:] if ops[:2] == [("F", 0), ("F", 1)] else ops


def order_stops_alternating(stage, stages, microbatches):
    ops = order(stage, stages, microbatches)
    if stage == 0 and stages == 2 and microbatches == 4:  # F0 F1 B0 F2 B1 F3 B2 B3
        return ops[:3] + [("F", 2), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    return ops


def _said_orders(message, stages, microbatches):
    """Every full 1F1B order of that pipeline that a message prints."""
    want = [" ".join(f"{o}{m}" for o, m in order(s, stages, microbatches)) for s in range(stages)]
    return [w for w in want if w in message]


@pytest.mark.parametrize(
    "answer", [order_gpipe, order_warmup_too_long, order_no_warmup, order_without_min,
               order_backward_first, order_out_of_turn, order_stops_alternating]
)  # fmt: skip
def test_one_f_one_b_hints_never_print_the_expected_order(answer):
    with pytest.raises(ExerciseFailed) as caught:
        ch06.check_one_f_one_b_order(answer)
    message = str(caught.value)
    for stages, microbatches in [(2, 4), (3, 6), (4, 8), (4, 2), (3, 1), (1, 3)]:
        leaked = [w for w in _said_orders(message, stages, microbatches) if w.count(" ") > 2]
        assert not leaked, message
    assert "min(" not in message, message


def test_one_f_one_b_order_passes_the_right_answer():
    assert ch06.check_one_f_one_b_order(order).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (order_gpipe, "that is GPipe's order"),
        (
            order_warmup_too_long,
            "holds 3 micro-batches' activations at once in your order, more than the 2 it needs",
        ),
        (order_no_warmup, "runs 1 forward before its first backward \\(a warm-up of 0"),
        (
            order_without_min,
            "names micro-batch 2, but there are only 2 .* the warm-up runs out of micro-batches",
        ),
        (order_backward_first, "your B0 comes before F0"),
        (order_unpaired, "needs exactly one F and one B"),
        (order_out_of_turn, "out of turn"),
        (order_stops_alternating, "stops alternating one F and one B at op"),
        (lambda s, p, m: 42, r"return a list of \(op, microbatch\) pairs"),
    ],
)
def test_one_f_one_b_order_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_one_f_one_b_order(answer)


def microbatch_grads(model, loss_fn, inputs, targets, microbatches):
    total = 0.0
    for x, y in _pieces(inputs, targets, microbatches):
        loss = loss_fn(model(x), y) * len(x) / len(inputs)  # its share of the rows
        loss.backward()
        total += loss.item()
    return total


def _pieces(inputs, targets, microbatches):
    return zip(inputs.tensor_split(microbatches), targets.tensor_split(microbatches), strict=True)


def grads_one_over_m(model, loss_fn, inputs, targets, microbatches):
    total = 0.0
    for x, y in _pieces(inputs, targets, microbatches):
        loss = loss_fn(model(x), y) / microbatches
        loss.backward()
        total += loss.item()
    return total


def grads_unscaled(model, loss_fn, inputs, targets, microbatches):
    for x, y in _pieces(inputs, targets, microbatches):
        loss_fn(model(x), y).backward()
    return 0.0


def grads_zeroed_each_time(model, loss_fn, inputs, targets, microbatches):
    total = 0.0
    for x, y in _pieces(inputs, targets, microbatches):
        model.zero_grad()
        loss = loss_fn(model(x), y) * len(x) / len(inputs)
        loss.backward()
        total += loss.item()
    return total


def grads_whole_batch(model, loss_fn, inputs, targets, microbatches):
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.item()


def grads_mean_of_losses(model, loss_fn, inputs, targets, microbatches):
    losses = []
    for x, y in _pieces(inputs, targets, microbatches):
        loss = loss_fn(model(x), y)
        (loss * len(x) / len(inputs)).backward()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def grads_no_backward(model, loss_fn, inputs, targets, microbatches):
    return sum(loss_fn(model(x), y).item() for x, y in _pieces(inputs, targets, microbatches))


def grads_summed_then_one_backward(model, loss_fn, inputs, targets, microbatches):
    losses = [loss_fn(model(x), y) * len(x) / len(inputs)
              for x, y in _pieces(inputs, targets, microbatches)]  # fmt: skip
    total = sum(losses)
    total.backward()
    return total.item()


def grads_tensor_returned(model, loss_fn, inputs, targets, microbatches):
    total = 0.0
    for x, y in _pieces(inputs, targets, microbatches):
        loss = loss_fn(model(x), y) * len(x) / len(inputs)
        loss.backward()
        total = total + loss
    return total


def grads_last_loss_returned(model, loss_fn, inputs, targets, microbatches):
    for x, y in _pieces(inputs, targets, microbatches):
        loss = loss_fn(model(x), y)
        (loss * len(x) / len(inputs)).backward()
    return loss.item()


def test_microbatch_gradients_passes_the_right_answer():
    assert ch06.check_microbatch_gradients(microbatch_grads).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (grads_one_over_m, "they weight every micro-batch by 1/M, but these micro-batches hold"),
        (grads_unscaled, "the sum of the micro-batches' gradients, M times too large"),
        (grads_zeroed_each_time, "the LAST micro-batch's alone. Backward adds into .grad"),
        (grads_whole_batch, "a forward saw all 12 rows at once"),
        (grads_mean_of_losses, "the mean of the micro-batches' losses"),
        (grads_no_backward, "some parameters have no .grad"),
        (
            grads_summed_then_one_backward,
            "order F0 F1 F2 F3 B.*backward must run before the next micro-batch's forward",
        ),
        (grads_tensor_returned, "as a Python float"),
        (grads_last_loss_returned, "the last micro-batch's mean loss alone"),
        (lambda *args: None, "expected 4 forwards"),
    ],
)
def test_microbatch_gradients_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_microbatch_gradients(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch06.check_one_f_one_b_order(unanswered).status == "not attempted"
    assert ch06.check_microbatch_gradients(unanswered).status == "not attempted"
    assert ch06.check_input_gradient(unanswered).status == "not attempted"
    assert ch06.check_weight_gradient(unanswered).status == "not attempted"


def _order_from_the_library(stage, stages, microbatches):
    actions = pp.stage_actions(pp.one_f_one_b_schedule(stages, microbatches), stage)
    return [(a.op, a.microbatch) for a in actions]


def _grads_from_the_executor(model, loss_fn, inputs, targets, microbatches):
    stage = pp.PipelineStage(model, 0, 1, device="cpu")
    return stage.train_step(inputs, targets, loss_fn, microbatches).loss


def _input_gradient_from_the_library(grad_y, weight):
    return bs.linear_input_gradient(grad_y, weight)


DELEGATING_ANSWERS = {
    "one_f_one_b_order": _order_from_the_library,
    "microbatch_gradients": _grads_from_the_executor,
    "input_gradient": _input_gradient_from_the_library,
    "weight_gradient": lambda x, grad_y: bs.linear_weight_gradient(x, grad_y),
}


def test_the_schedule_table_is_no_way_round():
    def via_the_table(stage, stages, microbatches):
        actions = pp.stage_actions(pp.SCHEDULES["1f1b"](stages, microbatches), stage)
        return [(a.op, a.microbatch) for a in actions]

    with pytest.raises(ExerciseFailed, match="called the library instead"):
        ch06.check_one_f_one_b_order(via_the_table)
    assert pp.SCHEDULES["1f1b"] is pp.one_f_one_b_schedule  # put back afterwards


def _order_from_zb_h1(stage, stages, microbatches):  # ZB-H1 without its Ws is 1F1B's order
    actions = pp.stage_actions(pp.zb_h1_schedule(stages, microbatches), stage)
    return [(a.op, a.microbatch) for a in actions if a.op != "W"]


def _order_from_the_table(name, *chunks):
    def answer(stage, stages, microbatches):
        actions = pp.stage_actions(pp.SCHEDULES[name](stages, microbatches, *chunks), stage)
        return [(a.op, a.microbatch) for a in actions if a.op != "W"]

    return answer


@pytest.mark.parametrize(
    "answer",
    [_order_from_zb_h1, _order_from_the_table("zb-h1"), _order_from_the_table("interleaved", 1)],
)
def test_the_newer_schedules_are_no_way_round_the_1f1b_order(answer):
    with pytest.raises(ExerciseFailed, match="called the library instead"):
        ch06.check_one_f_one_b_order(answer)
    assert pp.SCHEDULES["zb-h1"] is pp.zb_h1_schedule
    assert pp.SCHEDULES["interleaved"] is pp.interleaved_schedule


# ---- 3. the B/W split of one linear layer


def input_gradient(grad_y, weight):
    return grad_y @ weight


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def weight_gradient(x, grad_y):
    return _rows(grad_y).T @ _rows(x), _rows(grad_y).sum(0)


def test_the_split_passes_the_right_answers():
    assert ch06.check_input_gradient(input_gradient).status == "passed"
    assert ch06.check_weight_gradient(weight_gradient).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (lambda g, wt: g @ wt.T, "grad_x is grad_y times the TRANSPOSED weight"),
        (lambda g, wt: g, "grad_x differs from autograd's"),
        (lambda g, wt: (g @ wt)[..., :1], "grad_x must have x's shape"),
        (lambda g, wt: wt @ g, "raised RuntimeError.*which dimension does your product sum over"),
        (lambda g, wt: (g @ wt).tolist(), "return grad_x as a tensor"),
    ],
)
def test_input_gradient_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_input_gradient(answer)


@pytest.mark.parametrize(
    "answer, message",
    [
        (
            lambda x, g: (_rows(x).T @ _rows(g), _rows(g).sum(0)),
            "grad_weight is the transpose of the right one",
        ),
        (
            lambda x, g: (g.mT @ x, g.sum(0)),
            "grad_weight must have the weight's shape \\(6, 4\\), got \\(5, 6, 4\\).*leading dims",
        ),
        (
            lambda x, g: (torch.einsum("ij,ik->jk", g, x), g.sum(0)),
            "raised RuntimeError.*2 leading dims \\(5, 3\\).*flatten the leading dims",
        ),
        (
            lambda x, g: _rows(g).T @ _rows(x),
            "return the pair \\(grad_weight, grad_bias\\).*bias is a parameter too",
        ),
        (
            lambda x, g: (weight_gradient(x, g)[0], _rows(g).mean(0)),
            "the MEAN of grad_y over the rows",
        ),
        (lambda x, g: (weight_gradient(x, g)[0], g), "grad_bias must have the bias's shape"),
        (
            lambda x, g: (weight_gradient(x, g)[0] / len(_rows(x)), weight_gradient(x, g)[1]),
            "grad_weight is the MEAN over the 5 rows",
        ),
    ],
)
def test_weight_gradient_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_weight_gradient(answer)


def _weight_gradient_by_autograd(x, grad_y):
    weight = torch.zeros(grad_y.shape[-1], x.shape[-1], dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(grad_y.shape[-1], dtype=x.dtype, requires_grad=True)
    y = torch.nn.functional.linear(x, weight, bias)
    y.backward(grad_y)
    return weight.grad, bias.grad


def _input_gradient_by_vjp(grad_y, weight):
    x = torch.zeros(*grad_y.shape[:-1], weight.shape[1], dtype=grad_y.dtype)
    return torch.func.vjp(lambda x: x @ weight.T, x)[1](grad_y)[0]


def _input_gradient_by_autograd(grad_y, weight):
    x = torch.zeros(*grad_y.shape[:-1], weight.shape[1], dtype=grad_y.dtype, requires_grad=True)
    return torch.autograd.grad(x @ weight.T, x, grad_y)[0]


@pytest.mark.parametrize(
    "check, answer",
    [
        (ch06.check_weight_gradient, _weight_gradient_by_autograd),  # Tensor.backward
        (ch06.check_input_gradient, _input_gradient_by_vjp),
        (ch06.check_input_gradient, _input_gradient_by_autograd),
    ],
)
def test_the_split_switches_off_autograd(check, answer):
    with pytest.raises(ExerciseFailed, match="called the library instead.*switched off"):
        check(answer)
    assert torch.Tensor.backward.__code__.co_name == "backward"  # put back afterwards
