"""Chapter 8's layer freezing: frozen parameters get no gradient, trainable ones get exactly the
gradients of the unfrozen model, and a frozen prefix saves no activation for backward."""

import pytest
import torch

from dmlbook.model_parallel.efficiency import freezing
from dmlbook.model_parallel.efficiency.layers import as_layers, layer_loss, run_layers
from dmlbook.model_parallel.recompute import SavedTensorMeter
from dmlbook.models import char_gpt, mlp

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 20


def _gpt():
    return char_gpt(VOCAB, seed=0, n_layer=4, n_embd=32, n_head=4, block_size=16)


def _gpt_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, (4, 16), generator=g), torch.randint(VOCAB, (4, 16), generator=g)


def _mlp():
    return mlp(seed=0, in_features=12, hidden=(16, 16, 16), out_features=5)


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(9, 12, generator=g), torch.randint(5, (9,), generator=g)


CASES = [(_gpt, _gpt_batch), (_mlp, _mlp_batch)]


def test_as_layers_reproduces_the_model():
    model, (x, _) = _gpt(), _gpt_batch()
    assert torch.equal(run_layers(as_layers(model), x), model(x)[0])
    model, (x, _) = _mlp(), _mlp_batch()
    layers = as_layers(model)
    assert torch.equal(run_layers(layers, x), model(x))
    assert len(layers) == 4  # Linear+ReLU, Linear+ReLU, Linear+ReLU, Linear
    # Shared, not copied: the layers hold every parameter of the model exactly once.
    ids = {id(p) for layer in layers for p in layer.parameters()}
    assert ids == {id(p) for p in model.parameters()}
    with pytest.raises(TypeError, match="no layer list"):
        as_layers(torch.nn.ReLU())


@pytest.mark.parametrize("build, batch", CASES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_frozen_get_no_grad_and_trainable_get_the_reference_grads(build, batch, k):
    x, y = batch()
    reference = build()
    layer_loss(run_layers(as_layers(reference), x), y).backward()
    model = build()
    layers = as_layers(model)
    frozen = freezing.freeze_first(layers, k)
    assert frozen and freezing.frozen_prefix_length(layers) == k
    layer_loss(freezing.forward_frozen_prefix(layers, x, k), y).backward()
    frozen_ids = {id(p) for p in frozen}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        if id(p) in frozen_ids:
            assert p.grad is None, f"frozen {name} got a gradient"
        else:
            # The same operations on the same numbers: bit for bit equal.
            assert torch.equal(p.grad, ref.grad), name


@pytest.mark.parametrize("build, batch", CASES)
def test_a_frozen_prefix_saves_no_activations(build, batch):
    x, y = batch()

    def saved_bytes(frozen, explicit_no_grad=True):
        model = build()
        layers = as_layers(model)
        freezing.freeze(layers, frozen)
        prefix = freezing.frozen_prefix_length(layers) if explicit_no_grad else 0
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            loss = layer_loss(freezing.forward_frozen_prefix(layers, x, prefix), y)
            held = meter.current  # what backward would need, while the graph is alive
        del loss
        return held

    none, first_two = saved_bytes([]), saved_bytes([0, 1])
    assert 0 < first_two < none
    # Freezing alone does it too: autograd records nothing until something needs a gradient.
    assert saved_bytes([0, 1], explicit_no_grad=False) == first_two
    # The same two layers frozen in the middle keep (part of) their activations: backward
    # still passes through them to reach the trainable layer 0.
    assert saved_bytes([1, 2]) > first_two


def test_measure_freezing_counts_bytes_exactly():
    x, y = _gpt_batch()
    costs = freezing.measure_freezing(
        _gpt(), x, y, {"none": [], "first 3": [0, 1, 2], "middle": [2, 3]}, rounds=1, warmup=0
    )
    by = {c.name: c for c in costs}
    total = sum(p.numel() for p in _gpt().parameters())
    assert by["none"].trainable_params == total
    for c in costs:
        assert c.grad_bytes == 4 * c.trainable_params  # one float32 gradient per trainable weight
        # Adam keeps two float32 moments per trainable weight, plus a step counter per tensor.
        assert 8 * c.trainable_params <= c.optimizer_state_bytes < 8 * c.trainable_params + 1024
        assert c.step_s > 0
    assert by["first 3"].trainable_params < by["middle"].trainable_params < total
    assert by["first 3"].saved_bytes < by["middle"].saved_bytes < by["none"].saved_bytes


def test_bad_input_is_a_clear_error():
    layers = as_layers(_mlp())
    with pytest.raises(ValueError, match=r"k must be in \[0, 4\]"):
        freezing.freeze_first(layers, 5)
    with pytest.raises(ValueError, match=r"layer indices \[7\]"):
        freezing.freeze(layers, [0, 7])
    with pytest.raises(ValueError, match="k must be"):
        freezing.forward_frozen_prefix(layers, _mlp_batch()[0], -1)
    x, y = _mlp_batch()
    with pytest.raises(ValueError, match="freezes every layer"):
        freezing.measure_freezing(_mlp(), x, y, {"all": range(4)})
