"""Chapter 6's exercise checkers: right answers pass; planted bugs (GPipe's order, a warm-up one
too long or too short, no min() for M < P, a B before its F, micro-batches out of turn; micro-batch
losses not scaled by 1/M, gradients zeroed between micro-batches, the whole batch in one forward,
one backward of the summed losses, the summed, last or a tensor loss returned; a Linear -> tanh ->
Linear block's B with a weight transposed, tanh's derivative missing, taken at h or a or 1 - a,
computing weight gradients too (by products or by broadcasting, kept or stashed elsewhere), or
recomputing the forward; its W transposed, from h instead of a, from the gradient at a instead of h,
from x's wrong stand-in, a bias not summed, a mean, leading dims not flattened, B's product
redone, by a product or by broadcasting) are caught with a message that says so, and no order
hint prints the expected order; an answer that calls the library (or autograd) is told to write
the mechanism (``DELEGATING_ANSWERS``, run by ``test_back_doors.py``)."""

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


DELEGATING_ANSWERS = {  # one per exercise; the split's other back doors are tried below
    "one_f_one_b_order": _order_from_the_library,
    "microbatch_gradients": _grads_from_the_executor,
    "input_gradient": lambda *params: BlockByAtenLinearBackward(*params),
    "weight_gradient": lambda *params: SplitByAtenLinearBackward(*params),
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


# ---- 3-4. B and W of a block Linear -> tanh -> Linear


def _rows(t):
    return t.reshape(-1, t.shape[-1])


class Block:  # exercise 3: forward keeps, B computes grad_x only and keeps what W needs
    def __init__(self, w1, b1, w2, b2):
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2

    def forward(self, x):
        self.x = x
        self.h = x @ self.w1.T + self.b1
        self.a = torch.tanh(self.h)
        return self.a @ self.w2.T + self.b2

    def input_gradient(self, grad_y):
        self.grad_y = grad_y
        self.grad_a = grad_y @ self.w2
        self.grad_h = self.grad_a * (1 - self.a**2)
        return self.grad_h @ self.w1


class Split(Block):  # exercise 4: W from what the forward and B kept
    def weight_gradient(self):
        gy, gh = _rows(self.grad_y), _rows(self.grad_h)
        return {"w1": gh.T @ _rows(self.x), "b1": gh.sum(0), "w2": gy.T @ _rows(self.a),
                "b2": gy.sum(0)}  # fmt: skip


def test_the_split_passes_the_right_answers():
    assert ch06.check_input_gradient(Block).status == "passed"
    assert ch06.check_weight_gradient(Split).status == "passed"


def _b(grad_x):  # a block whose B returns grad_x(self, grad_y) after keeping as Block does
    class Wrong(Block):
        def input_gradient(self, grad_y):
            super().input_gradient(grad_y)
            return grad_x(self, grad_y)

    return Wrong


class BComputesW(Split):
    def input_gradient(self, grad_y):
        grad_x = super().input_gradient(grad_y)
        Split.weight_gradient(self)  # W's products, on the critical path (and thrown away)
        return grad_x


class BWritesGrad(Block):
    def input_gradient(self, grad_y):
        grad_x = super().input_gradient(grad_y)
        self.w2.grad = torch.zeros_like(self.w2)
        return grad_x


class BBroadcastsW(Block):  # no matrix product counted, but it keeps a weight gradient
    def input_gradient(self, grad_y):
        grad_x = super().input_gradient(grad_y)
        g, a = _rows(grad_y), _rows(self.a)
        self.w2_grad = (g[:, :, None] * a[:, None, :]).sum(0)
        return grad_x


STASH = []  # somewhere outside the block, where the checker's look at what B keeps does not reach


class BStashesBroadcastW1(Block):  # W1's gradient by broadcasting, kept outside the block
    def input_gradient(self, grad_y):
        grad_x = super().input_gradient(grad_y)
        gh, x = _rows(self.grad_h), _rows(self.x)
        STASH.append((gh[:, :, None] * x[:, None, :]).sum(0))  # (hidden, in): W1's gradient
        return grad_x


class BRecomputesForward(Block):  # not a weight gradient: the forward again, on the critical path
    def forward(self, x):
        self.x = x
        return torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T + self.b2

    def input_gradient(self, grad_y):
        self.a = torch.tanh(self.x @ self.w1.T + self.b1)
        return super().input_gradient(grad_y)


class ForwardWrong(Block):
    def forward(self, x):
        return super().forward(x) - self.b2


TANH = "tanh'\\(h\\) = 1 - tanh\\(h\\)\\^2 = 1 - a\\^2, from the a your forward kept"


@pytest.mark.parametrize(
    "answer, message",
    [
        (_b(lambda s, g: (g @ s.w2.T) * (1 - s.a**2) @ s.w1), "TRANSPOSED weight"),
        (_b(lambda s, g: ((g @ s.w2) * (1 - s.a**2)) @ s.w1.T), "TRANSPOSED W1"),
        (_b(lambda s, g: g @ s.w2 @ s.w1), "tanh's derivative is missing"),
        (_b(lambda s, g: ((g @ s.w2) * (1 - s.h**2)) @ s.w1), "1 - h\\^2 uses the pre-activation"),
        (_b(lambda s, g: (g @ s.w2) * (1 - s.a**2)), "stops at layer 1's output h"),
        (_b(lambda s, g: s.grad_h.tolist()), "returns grad_x as a tensor"),
        (BComputesW, "B computed weight gradients too \\(it ran .* multiply-adds more"),
        (BWritesGrad, "B computed weight gradients too \\(it wrote .grad of w2"),
        (BBroadcastsW, "B computed weight gradients too \\(it keeps the gradient of w2"),
        (
            BStashesBroadcastW1,
            "B computed weight gradients too \\(it ran 80 multiply-adds more.*"
            "made a tensor of w1's shape",
        ),
        (
            BRecomputesForward,
            "your B ran 80 multiply-adds more than the two products that carry "
            "the gradient to x \\(recomputing the forward\\?\\)",
        ),
        (_b(lambda s, g: ((g @ s.w2) * (1 - s.a)) @ s.w1), "not 1 - a: " + TANH),
        (_b(lambda s, g: ((g @ s.w2) * s.a) @ s.w1), "not a: " + TANH),
        (_b(lambda s, g: ((g @ s.w2) * (1 - s.a.tanh() ** 2)) @ s.w1), "taken at a.*" + TANH),
        (ForwardWrong, "your forward's y differs"),
        (_b(lambda s, g: s.grad_h[..., :1]), "grad_x must have x's shape"),
    ],
)
def test_input_gradient_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message) as raised:
        ch06.check_input_gradient(answer)
    if answer is BRecomputesForward:  # extra products that are no weight gradient: not called one
        assert "weight gradient" not in str(raised.value)


def _w(**wrong):  # a W that returns the right gradients but for those named in wrong
    class Wrong(Split):
        def weight_gradient(self):
            grads = super().weight_gradient()
            return grads | {k: f(self) for k, f in wrong.items()}

    return Wrong


class WNotFlattened(Block):
    def weight_gradient(self):
        gy, gh = self.grad_y, self.grad_h
        return {"w1": gh.mT @ self.x, "b1": gh.sum(0), "w2": gy.mT @ self.a, "b2": gy.sum(0)}


class WRedoesB(Split):
    def weight_gradient(self):
        self.grad_h = (self.grad_y @ self.w2) * (1 - self.a**2)  # B's product again
        return super().weight_gradient()


class WRedoesBByBroadcasting(Split):  # grad_y W2 again, as a multiply-and-sum
    def weight_gradient(self):
        gy = _rows(self.grad_y)
        grad_a = (gy[:, :, None] * self.w2[None]).sum(1)  # (rows, out, hidden) summed over out
        self.grad_h = (grad_a * (1 - _rows(self.a) ** 2)).reshape(self.grad_h.shape)
        return super().weight_gradient()


class SplitByBroadcasting(Split):  # the weight products as multiply-and-sum: the same work
    def weight_gradient(self):
        gy, gh, a, x = _rows(self.grad_y), _rows(self.grad_h), _rows(self.a), _rows(self.x)
        return {"w1": (gh[:, :, None] * x[:, None, :]).sum(0), "b1": gh.sum(0),
                "w2": (gy[:, :, None] * a[:, None, :]).sum(0), "b2": gy.sum(0)}  # fmt: skip


def test_a_product_by_broadcasting_counts_as_one():
    assert ch06.check_weight_gradient(SplitByBroadcasting).status == "passed"


class SplitBiasByOnes(Block):  # the biases as products with a vector of ones: no work redone
    def weight_gradient(self):
        gy, gh, a, x = _rows(self.grad_y), _rows(self.grad_h), _rows(self.a), _rows(self.x)
        ones = torch.ones(len(gy), dtype=gy.dtype)
        return {"w1": gh.T @ x, "b1": ones @ gh, "w2": gy.T @ a, "b2": ones @ gy}


def test_a_bias_as_a_product_with_ones_is_not_work_redone():
    assert ch06.check_weight_gradient(SplitBiasByOnes).status == "passed"


class WWithoutWhatBKept(Block):
    def input_gradient(self, grad_y):
        return ((grad_y @ self.w2) * (1 - self.a**2)) @ self.w1  # keeps nothing for W

    def weight_gradient(self):
        return Split.weight_gradient(self)


@pytest.mark.parametrize(
    "answer, message",
    [
        (_w(w2=lambda s: (_rows(s.grad_y).T @ _rows(s.a)).T), "w2 is the transpose"),
        (
            _w(w2=lambda s: _rows(s.a).T @ _rows(s.grad_y)),
            "w2 (is the transpose|has the shape \\(in, out\\))",
        ),
        (_w(w2=lambda s: _rows(s.grad_y).T @ _rows(s.h)), "w2 is computed from the pre-activation"),
        (_w(w1=lambda s: _rows(s.grad_a).T @ _rows(s.x)), "w1 is computed from the gradient at"),
        (_w(w1=lambda s: _rows(s.grad_h).T @ _rows(s.h)), "w1 is computed from the wrong saved"),
        (_w(b2=lambda s: _rows(s.grad_y)), "a forgotten sum over the batch"),
        (_w(b1=lambda s: _rows(s.grad_h).mean(0)), "b1 is the MEAN"),
        (_w(b1=lambda s: _rows(s.grad_a).sum(0)), "b1 sums the gradient at tanh's output"),
        (WNotFlattened, "w1 has the shape \\(5, 6, 4\\).*flatten the leading dims"),
        (
            _w(w2=lambda s: _rows(s.grad_y).T @ _rows(s.a) / len(_rows(s.a))),
            "w2 is the MEAN over the 5 rows",
        ),
        (
            lambda *p: type("NoBias", (Split,), {"weight_gradient": lambda s: {"w1": 0, "w2": 0}})(
                *p
            ),
            "W returns a dict with the keys .*biases are parameters too",
        ),  # fmt: skip
        (WRedoesB, "W ran .* multiply-adds more than the two weight products"),
        (WRedoesBByBroadcasting, "W ran 80 multiply-adds more than the two weight products"),
        (WWithoutWhatBKept, "raised AttributeError"),
    ],
)
def test_weight_gradient_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch06.check_weight_gradient(answer)


# Every back door to a block's gradients, each rejected as calling the library


class BlockByAutogradGrad(Block):
    def forward(self, x):
        self.x = x.clone().requires_grad_()
        self.y = torch.tanh(self.x @ self.w1.T + self.b1) @ self.w2.T + self.b2
        return self.y.detach()

    def input_gradient(self, grad_y):
        return torch.autograd.grad(self.y, self.x, grad_y)[0]


class BlockByBackward(BlockByAutogradGrad):
    def input_gradient(self, grad_y):
        self.y.backward(grad_y)
        return self.x.grad


class BlockByVjp(Block):
    def input_gradient(self, grad_y):
        f = lambda x: torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T + self.b2  # noqa: E731
        return torch.func.vjp(f, self.x)[1](grad_y)[0]


class BlockByAtenLinearBackward(Block):
    def input_gradient(self, grad_y):
        self.grad_y = grad_y
        grad_a = torch.ops.aten.linear_backward(self.a, grad_y, self.w2, [True, False, False])[0]
        self.grad_h = grad_a * (1 - self.a**2)
        return self.grad_h @ self.w1


class BlockByAtenTanhBackward(Block):
    def input_gradient(self, grad_y):
        self.grad_y = grad_y
        self.grad_h = torch.ops.aten.tanh_backward.default(grad_y @ self.w2, self.a)
        return self.grad_h @ self.w1


class BlockByTheLibrary(Block):
    def input_gradient(self, grad_y):
        self.grad_y = grad_y
        self.grad_h = bs.linear_input_gradient(grad_y, self.w2) * (1 - self.a**2)
        return self.grad_h @ self.w1


class SplitByAtenLinearBackward(Split):
    def weight_gradient(self):
        _, w2, b2 = torch.ops.aten.linear_backward(
            _rows(self.a), _rows(self.grad_y), self.w2, [False, True, True]
        )
        return super().weight_gradient() | {"w2": w2, "b2": b2}


class SplitByBackward(Split):
    def weight_gradient(self):
        w1 = self.w1.clone().requires_grad_()
        (self.grad_h @ w1).backward(torch.ones_like(self.x))  # a backward that fills w1.grad
        return super().weight_gradient()


class SplitByAutogradGrad(Split):
    def weight_gradient(self):
        w2 = self.w2.clone().requires_grad_()
        (grad,) = torch.autograd.grad(self.a @ w2.T, w2, self.grad_y)
        return super().weight_gradient() | {"w2": grad}


class SplitByVjp(Split):
    def weight_gradient(self):
        grad = torch.func.vjp(lambda w: self.a @ w.T, self.w2)[1](self.grad_y)[0]
        return super().weight_gradient() | {"w2": grad}


class SplitByTheLibrary(Split):
    def weight_gradient(self):
        w2, b2 = bs.linear_weight_gradient(self.a, self.grad_y)
        return super().weight_gradient() | {"w2": w2, "b2": b2}


@pytest.mark.parametrize(
    "check, answer",
    [(ch06.check_input_gradient, b) for b in (BlockByAutogradGrad, BlockByBackward, BlockByVjp,
      BlockByAtenLinearBackward, BlockByAtenTanhBackward, BlockByTheLibrary)]
    + [(ch06.check_weight_gradient, w) for w in (SplitByAtenLinearBackward, SplitByBackward,
       SplitByAutogradGrad, SplitByVjp, SplitByTheLibrary)],
    ids=lambda a: getattr(a, "__name__", ""),
)  # fmt: skip
def test_every_back_door_to_the_split_is_named(check, answer):
    with pytest.raises(ExerciseFailed, match="called the library instead.*switched off"):
        check(answer)
    assert torch.Tensor.backward.__code__.co_name == "backward"  # put back afterwards


def test_a_library_error_is_not_read_as_not_attempted():
    class Raises(Block):  # an op with no CPU kernel: NotImplementedError, raised inside torch
        def input_gradient(self, grad_y):
            image, kernel = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3)
            return torch.ops.aten.cudnn_convolution(
                image, kernel, [0, 0], [1, 1], [1, 1], 1, False, False, False
            )

    with pytest.raises(ExerciseFailed, match="NotImplementedError from inside torch"):
        ch06.check_input_gradient(Raises)

    class Stub(Block):  # the learner's own `raise NotImplementedError`, message or not
        def input_gradient(self, grad_y):
            raise NotImplementedError("exercise not yet implemented: replace these two lines")

    assert ch06.check_input_gradient(Stub).status == "not attempted"
