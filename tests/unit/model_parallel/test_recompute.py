"""Tests for dmlbook.model_parallel.recompute: exact gradients, saved bytes counted by hand, the
sqrt(n) rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from dmlbook.model_parallel.memory.measure import cpu_peak_bytes
from dmlbook.model_parallel.recompute import (
    SavedTensorMeter,
    checkpoint_segment,
    checkpoint_sequential,
    cuda_peak_bytes,
    layer_chain,
    measure_activation_memory,
    split_segments,
    sqrt_segments,
    torch_checkpoint_segment,
)
from dmlbook.models import char_gpt, cnn, mlp

IMPLEMENTATIONS = {"ours": checkpoint_segment, "torch": torch_checkpoint_segment}


pytestmark = pytest.mark.usefixtures("one_thread")


def _dropout_mlp(device: str = "cpu") -> nn.Module:
    """A 10-unit MLP with dropout after every ReLU, so recomputation must replay the RNG."""
    model = mlp(seed=1, in_features=16, hidden=(32,) * 9, out_features=5)
    layers = []
    for layer in model.layers:
        layers.append(layer)
        if isinstance(layer, nn.ReLU):
            layers.append(nn.Dropout(0.3))
    model.layers = nn.Sequential(*layers)
    return model.to(device).train()


def _mlp_batch(device: str = "cpu"):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    return x.to(device), y.to(device)


def _gpt_and_batch():
    model = char_gpt(20, seed=3, n_layer=4, n_head=2, n_embd=16, block_size=12, dropout=0.2)
    g = torch.Generator().manual_seed(4)
    idx, targets = (torch.randint(0, 20, (3, 12), generator=g) for _ in range(2))
    return model.train(), idx, targets


def _step(model, loss_fn, seed: int = 5):
    """Loss, parameter gradients and the next random number after one seeded training step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, torch.rand(3)


def _assert_identical(got, want):
    loss, grads, after = got
    want_loss, want_grads, want_after = want
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name
    assert torch.equal(after, want_after), "checkpointing moved the caller's RNG"


# ---- exact gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("segments", [2, 3, 5])
def test_mlp_with_dropout_gradients_are_bitwise_equal(impl, segments):
    model = _dropout_mlp()
    x, y = _mlp_batch()
    chain = layer_chain(model)
    assert len(chain.layers) == 10
    plain = _step(model, lambda: nn.functional.cross_entropy(model(x), y))
    checkpointed = _step(model, lambda: chain.loss(x, y, IMPLEMENTATIONS[impl], segments))
    _assert_identical(checkpointed, plain)
    # Dropout really is on: another seed gives other gradients.
    other = _step(model, lambda: chain.loss(x, y, IMPLEMENTATIONS[impl], segments), seed=6)
    assert not torch.equal(other[1]["layers.0.weight"], plain[1]["layers.0.weight"])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_char_gpt_with_dropout_gradients_are_bitwise_equal(impl):
    model, idx, targets = _gpt_and_batch()
    chain = layer_chain(model)
    plain = _step(model, lambda: model(idx, targets)[1])
    for segments in (2, 4):
        got = _step(model, lambda s=segments: chain.loss(idx, targets, IMPLEMENTATIONS[impl], s))
        _assert_identical(got, plain)


def test_first_segment_weights_get_gradients_when_the_input_needs_none():
    """The reason CheckpointSegment takes the parameters: x needs no grad, the weights do."""
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    out = checkpoint_segment([layer], x)
    assert out.requires_grad
    out.sum().backward()
    assert torch.equal(layer.weight.grad, torch.ones(2, 3).t() @ x)
    assert x.grad is None


def test_input_gradient_and_no_grad_mode():
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    x = torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(layers[2](layers[1](layers[0](x))).sum(), x)[0]
    for fn in IMPLEMENTATIONS.values():
        got = torch.autograd.grad(checkpoint_sequential(layers, 2, x, fn).sum(), x)[0]
        assert torch.equal(got, want)
    with torch.no_grad():
        assert not checkpoint_segment(layers, x).requires_grad


# ---- activation memory, counted by hand -------------------------------------------------------


def test_saved_bytes_equal_a_hand_count_for_a_small_mlp():
    """MLP 16 -> 8 x 32 -> 5, batch 8, loss = sum (saves nothing). One ReLU output is
    a = 8 * 32 * 4 bytes, the input x = 8 * 16 * 4. Each Linear saves its input (the previous
    ReLU's output, shared storage, counted once), each ReLU its output."""
    n, width, depth = 8, 32, 8
    model = mlp(seed=0, in_features=16, hidden=(width,) * depth, out_features=5)
    chain = dataclasses.replace(layer_chain(model), after=lambda out, targets: out.sum())
    x, y = torch.randn(n, 16), torch.zeros(n, dtype=torch.long)
    a, x_bytes = n * width * 4, n * 16 * 4

    plain = measure_activation_memory(chain, x, y)
    assert plain.forward_bytes == plain.peak_bytes == plain.meter_peak_bytes == x_bytes + depth * a
    assert plain.recompute_bytes == []

    # 9 units in 3 segments of 3: seg 1 = ReLUs 1-3, seg 2 = ReLUs 4-6, seg 3 = ReLUs 7-8 + head.
    # Forward keeps seg 1's input x, seg 2's input r3, and all of the last segment: r6 (its
    # input), r7, r8. That is x + 4a. Backward first frees seg 3's r6, r7, r8, then reruns seg 2
    # (r4, r5, r6 again, 3a) while x and r3 are held: x + 4a again. Seg 1's rerun: x + 3a.
    for impl, fn in IMPLEMENTATIONS.items():
        memory = measure_activation_memory(chain, x, y, fn, segments=3)
        assert memory.forward_bytes == x_bytes + 4 * a, impl
        assert memory.recompute_bytes == [3 * a, 3 * a], impl
        assert memory.peak_bytes == x_bytes + 4 * a, impl
        assert 1 - memory.peak_bytes / plain.peak_bytes == pytest.approx(4 * a / (x_bytes + 8 * a))
    # Our recomputation runs under the meter's hooks, so its live peak is measured, not derived.
    ours = measure_activation_memory(chain, x, y, checkpoint_segment, segments=3)
    assert ours.meter_peak_bytes == ours.peak_bytes


def test_meter_counts_each_storage_once_and_releases_in_backward():
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)
    with SavedTensorMeter(exclude=[w]) as meter:
        h = x @ w  # saves x (w excluded)
        q, k = h.chunk(2, dim=1)  # two views of one storage
        loss = (q * k).sum()  # saves q and k: one storage, counted once
        assert meter.current == x.nbytes + h.nbytes
        loss.backward()
        assert meter.current == 0
        # A graph dropped without backward lets its saved tensors go too (no reference cycle
        # through an op's saved output, here relu's).
        dropped = torch.relu(x @ w)
        assert meter.current == x.nbytes + dropped.nbytes
        del dropped
        assert meter.current == 0
    assert meter.peak == x.nbytes + h.nbytes


def test_char_gpt_checkpointing_saves_memory_and_both_implementations_agree():
    model, idx, targets = _gpt_and_batch()
    chain = layer_chain(model)
    plain = measure_activation_memory(chain, idx, targets)
    ours = measure_activation_memory(chain, idx, targets, checkpoint_segment, 2)
    theirs = measure_activation_memory(chain, idx, targets, torch_checkpoint_segment, 2)
    assert ours.peak_bytes < 0.75 * plain.peak_bytes
    assert ours.meter_peak_bytes == ours.peak_bytes
    assert (ours.forward_bytes, ours.recompute_bytes, ours.peak_bytes) == (
        theirs.forward_bytes,
        theirs.recompute_bytes,
        theirs.peak_bytes,
    )


# ---- segments --------------------------------------------------------------------------------


def test_sqrt_rule():
    assert [sqrt_segments(n) for n in (1, 2, 4, 9, 10, 16, 37, 49)] == [1, 1, 2, 3, 3, 4, 6, 7]


def test_split_segments_balanced_longer_last():
    cuts = split_segments(10, 3)
    assert [list(c) for c in cuts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert [len(c) for c in split_segments(11, 4)] == [2, 3, 3, 3]
    assert [len(c) for c in split_segments(5, 5)] == [1] * 5
    assert split_segments(7, 1) == [range(0, 7)]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: split_segments(4, 0), "segments must be >= 1"),
        (lambda: split_segments(3, 4), "cannot cut 3 layers into 4"),
        (lambda: sqrt_segments(0), "n_layers must be >= 1"),
        (lambda: checkpoint_sequential([nn.ReLU()] * 2, 3, torch.ones(1)), "into 3"),
        (lambda: checkpoint_sequential([nn.ReLU()] * 2, 0, torch.ones(1)), ">= 1"),
    ],
)
def test_bad_segment_counts(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_layer_chain_rejects_other_models():
    with pytest.raises(TypeError, match="CNN"):
        layer_chain(cnn())


def test_our_backward_holds_no_more_than_torchs_plus_two_activations():
    """Replaying a segment must add each weight's gradient to .grad as it is made, as plain
    backprop does. Returning all of a segment's weight gradients at once (autograd.grad) held
    4 of them together: a 1024-wide, 16-layer MLP in 2 segments then peaked above no
    checkpointing at all (39 MiB against 36 on an H200 and on this CPU alike)."""
    model = mlp(seed=0, in_features=64, hidden=(512,) * 15, out_features=10).train()
    chain = layer_chain(model)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    chain.loss(x, y).backward()  # .grad exists: the peaks below are activations and transients
    peaks = {}
    for name, fn in {"none": None, **IMPLEMENTATIONS}.items():
        model.zero_grad(set_to_none=False)
        peaks[name] = cpu_peak_bytes(lambda fn=fn: chain.loss(x, y, fn, 4).backward())
    activation = 256 * 512 * 4  # one ReLU output
    assert peaks["torch"] < 0.75 * peaks["none"], peaks
    # Ours also holds the replayed segment's output and its input's gradient while it runs.
    assert peaks["ours"] <= peaks["torch"] + 2 * activation + 4096, peaks


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_gradients_equal_and_allocator_peak_drops():
    model = mlp(seed=0, in_features=256, hidden=(1024,) * 15, out_features=10).cuda().train()
    chain = layer_chain(model)
    x, y = torch.randn(512, 256, device="cuda"), torch.randint(0, 10, (512,), device="cuda")
    chain.loss(x, y).backward()  # allocate .grad now, so the peaks below are activations
    peaks = {}
    for name, fn in {"none": None, **IMPLEMENTATIONS}.items():
        model.zero_grad(set_to_none=False)
        peaks[name] = cuda_peak_bytes(lambda fn=fn: chain.loss(x, y, fn, 4).backward())
    # 16 units, 2 MiB per ReLU output: no checkpointing keeps 15, 4 segments at most 3 + 4.
    assert peaks["ours"] < 0.75 * peaks["none"]
    assert peaks["torch"] < 0.75 * peaks["none"]
    # Dropout on CUDA: the CUDA generator must be replayed too.
    dropout_model = _dropout_mlp("cuda")
    xd, yd = _mlp_batch("cuda")
    dropout_chain = layer_chain(dropout_model)
    plain = _step(dropout_model, lambda: dropout_chain.loss(xd, yd))
    for fn in IMPLEMENTATIONS.values():
        got = _step(dropout_model, lambda fn=fn: dropout_chain.loss(xd, yd, fn, 3))
        loss, grads, _ = got  # torch.rand(3) is drawn on the CPU; compare the CUDA results
        assert torch.equal(loss, plain[0])
        for name in grads:
            assert torch.equal(grads[name], plain[1][name]), name
