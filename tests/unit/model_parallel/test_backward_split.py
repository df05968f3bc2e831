"""The backward split in B (input gradient) and W (weight gradient)
(dmlbook.model_parallel.backward_split): on one linear layer by hand, then on any module's stage,
B + W equal to autograd's one backward in float64 to 1e-12, and the executor's split on one
process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmlbook.model_parallel import backward_split as bs
from dmlbook.model_parallel import pipeline as pp
from dmlbook.models import char_gpt, mlp, next_token_loss

TOL = dict(rtol=0, atol=1e-12)


def test_the_split_of_one_linear_layer_is_autograds_backward():
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(4, 6).double()
    x = torch.randn(5, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    grad_y = torch.randn(5, 3, 6, dtype=torch.float64, generator=g)
    layer(x).backward(grad_y)
    grad_x = bs.linear_input_gradient(grad_y, layer.weight)  # B: grad_y W
    grad_w, grad_b = bs.linear_weight_gradient(x.detach(), grad_y)  # W: grad_y^T x
    torch.testing.assert_close(grad_x, x.grad, **TOL)
    torch.testing.assert_close(grad_w, layer.weight.grad, **TOL)
    torch.testing.assert_close(grad_b, layer.bias.grad, **TOL)


def _stages():
    model = char_gpt(20, seed=0, n_layer=3, n_head=2, n_embd=16, block_size=8).double()
    layers = pp.layers_of(model)
    return pp.split_model(layers, pp.even_partition(len(layers), 3))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_b_then_w_equals_the_full_backward_on_any_stage(which):
    """Embedding, transformer blocks, head and loss: B computes no weight gradient at all, and
    W then adds exactly what one backward would have."""
    stage = _stages()[which]
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 20, (6, 8), generator=g)
    if which == 0:
        x = idx
    else:
        x = torch.randn(6, 8, 16, dtype=torch.float64, generator=g, requires_grad=True)
    last = which == 2
    out = stage(x)
    y = next_token_loss(out, idx) if last else out
    grad_y = None if last else torch.randn(y.shape, dtype=torch.float64, generator=g)
    y.backward(grad_y)
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    want_x = None if which == 0 else x.grad.clone()
    stage.zero_grad(set_to_none=True)
    x = x if which == 0 else x.detach().requires_grad_()
    with bs.weight_outputs(stage) as owned:
        out = stage(x)
    y = next_token_loss(out, idx) if last else out
    grad_x, pending = bs.input_gradient(y, grad_y, x, owned)
    assert all(p.grad is None for p in stage.parameters())  # B: input gradient only
    if which:
        torch.testing.assert_close(grad_x, want_x, **TOL)
    else:
        assert grad_x is None  # token ids have no gradient
    bs.weight_gradient(pending)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[name], **TOL, msg=name)
    assert len(owned) == sum(1 for m in stage.modules() if list(m.parameters(False)))


def test_a_module_that_owns_weights_and_returns_no_tensor_is_a_clear_error():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.w, x

    pair = Pair()
    with pytest.raises(TypeError, match="Pair owns parameters but returns a tuple"):
        with bs.weight_outputs(pair):
            pair(torch.ones(2, requires_grad=True))


def test_the_executor_splits_backward_on_one_process():
    """One stage, no group: ZB-H1's F, B, W leave the gradients of the mean loss; interleaved
    chunks of one stage pass their activations through the stage's own mailbox."""
    model = mlp(seed=0, in_features=4, hidden=(6, 5, 3), out_features=2).double()
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    stage = pp.PipelineStage(model, 0, 1, device="cpu")
    result = stage.train_step(x, y, nn.functional.mse_loss, 3, "zb-h1")
    assert [(r.op, r.microbatch) for r in result.timeline] == [
        ("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1), ("F", 2), ("B", 2), ("W", 2)
    ]  # fmt: skip
    assert result.loss == pytest.approx(loss.item(), abs=1e-12)
    for got, expected in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(got.grad, expected, **TOL)
    assert stage.held == {} and result.peak_live_activations == 1
    model.zero_grad(set_to_none=True)
    chunks = pp.split_model(pp.layers_of(model), [2, 2])
    stage = pp.PipelineStage(chunks, 0, 1, device="cpu")
    result = stage.train_step(x, y, nn.functional.mse_loss, 2, "interleaved")
    assert [(r.op, r.microbatch, r.chunk) for r in result.timeline][:4] == [
        ("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 1, 0)
    ]  # fmt: skip
    assert result.loss == pytest.approx(loss.item(), abs=1e-12)
    for got, expected in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(got.grad, expected, **TOL)
    with pytest.raises(ValueError, match="holds 2 model chunks, which the '1f1b' schedule"):
        stage.train_step(x, y, nn.functional.mse_loss, 2, "1f1b")
