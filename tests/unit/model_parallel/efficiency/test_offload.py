"""Chapter 8's offload: weights streamed from a memory-mapped file and Adam state kept off the
device give exactly the resident model's outputs and torch.optim.Adam's updates; FSDP2's own CPU
offload agrees on 3 ranks; on a GPU, peak device memory drops (gpu tests)."""

import pytest
import torch
from torch.nn import functional as F

from dmlbook.launch import run
from dmlbook.model_parallel.efficiency import offload
from dmlbook.model_parallel.efficiency.layers import as_layers, layer_loss
from dmlbook.model_parallel.recompute import cuda_peak_bytes
from dmlbook.models import char_gpt, mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt():
    return char_gpt(30, seed=0, n_layer=4, n_embd=32, n_head=4, block_size=16).eval()


def _tokens():
    return torch.randint(30, (3, 16), generator=torch.Generator().manual_seed(1))


def test_tensor_file_round_trip_and_torch_mmap_agree(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 3, generator=g).bfloat16(),
        "int8": torch.randint(-127, 128, (9,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "odd": torch.randn(1, 3, generator=g).half(),
    }
    stored = offload.TensorFile.save(tmp_path / "t.bin", tensors)
    for name, t in tensors.items():
        assert stored[name].dtype == t.dtype and torch.equal(stored[name], t), name
        assert stored.index[name][0] % offload.ALIGN == 0
    # torch's own memory-mapped load (torch.load(mmap=True)) reads the same numbers.
    torch.save(tensors, tmp_path / "t.pt")
    mapped = torch.load(tmp_path / "t.pt", mmap=True, weights_only=True)
    assert all(torch.equal(mapped[n], offload.TensorFile(tmp_path / "t.bin")[n]) for n in tensors)
    # Read-only opening is copy-on-write: writes stay in this process, the file is unchanged.
    stored["w"].zero_()
    assert torch.equal(offload.TensorFile(tmp_path / "t.bin")["w"], tensors["w"])
    writable = offload.TensorFile(tmp_path / "t.bin", writable=True)
    writable["w"].fill_(1.0)
    writable.flush()
    assert offload.TensorFile(tmp_path / "t.bin")["w"].eq(1.0).all()


@pytest.mark.parametrize("prefetch", [True, False])
def test_streamed_model_equals_the_resident_model(tmp_path, prefetch):
    model, x = _gpt(), _tokens()
    streamed = offload.StreamedModel(as_layers(model), tmp_path / "w.bin", prefetch=prefetch)
    with torch.no_grad():
        expected = model(x)[0]
    assert torch.equal(streamed(x), expected)
    # The skeletons hold no memory: every weight lives in the file.
    assert all(p.is_meta for s in streamed.skeletons for p in s.parameters())
    sizes = streamed.layer_bytes
    assert sum(sizes) == sum(p.nbytes for p in model.parameters())
    pairs = max(a + b for a, b in zip(sizes, sizes[1:], strict=False))
    assert streamed.peak_resident_bytes == (pairs if prefetch else max(sizes))
    assert streamed.peak_resident_bytes < 0.6 * sum(sizes)
    mlp_model = mlp(seed=1, in_features=8, hidden=(16, 16), out_features=4).eval()
    mlp_x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    streamed = offload.StreamedModel(as_layers(mlp_model), tmp_path / "m.bin", prefetch=prefetch)
    assert torch.equal(streamed(mlp_x), mlp_model(mlp_x))


def _train(model, optimizer, x, y, steps=6):
    for _ in range(steps):
        optimizer.zero_grad()
        layer_loss(model(x)[0] if x.dtype == torch.long else model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_offloaded_adam_equals_torch_adam(tmp_path, store):
    x = _tokens()
    y = torch.randint(30, (3, 16), generator=torch.Generator().manual_seed(3))
    settings = dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    theirs_model, ours_model = _gpt().train(), _gpt().train()
    theirs = _train(theirs_model, torch.optim.Adam(theirs_model.parameters(), **settings), x, y)
    optimizer = offload.OffloadedAdam(
        ours_model.parameters(), store=store, path=tmp_path / "state.bin", **settings
    )
    ours = _train(ours_model, optimizer, x, y)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert torch.equal(a, b)  # the same operations in the same order: bit for bit
    moved = [not torch.equal(a, p) for a, p in zip(ours, _gpt().parameters(), strict=True)]
    assert all(moved)
    if store == "disk":  # the moments really are in the file
        on_disk = offload.TensorFile(tmp_path / "state.bin")
        first = next(iter(ours_model.parameters()))
        assert torch.equal(on_disk["0.exp_avg"], optimizer.state[first]["exp_avg"])
        assert on_disk["0.exp_avg_sq"].abs().sum() > 0


def _fsdp_rank(steps):
    model = mlp(seed=0, in_features=12, hidden=(10,), out_features=5)  # 10 and 5: 3 does not divide
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 12, generator=g), torch.randint(5, (16,), generator=g)
    return offload.fsdp2_offload_train(model, x, y, F.cross_entropy, steps=steps, lr=1e-2)


@pytest.mark.timeout(90)
def test_fsdp2_cpu_offload_agrees_with_offloaded_adam(tmp_path):
    """torch's counterpart on 3 gloo ranks (CPUOffloadPolicy(pin_memory=False) on a CPU box)."""
    steps = 4
    results = run(_fsdp_rank, 3, steps, timeout=60)
    model = mlp(seed=0, in_features=12, hidden=(10,), out_features=5)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 12, generator=g), torch.randint(5, (16,), generator=g)
    optimizer = offload.OffloadedAdam(
        model.parameters(), lr=1e-2, store="disk", path=tmp_path / "s"
    )
    names = [name for name, _ in model.named_parameters()]
    ours = dict(zip(names, _train(model, optimizer, x, y, steps), strict=True))
    for full in results:
        assert full.keys() == ours.keys()
        for name, p in ours.items():
            torch.testing.assert_close(full[name], p, rtol=0, atol=1e-6)


def test_bad_input_is_a_clear_error(tmp_path):
    params = mlp().parameters()
    with pytest.raises(ValueError, match="store must be"):
        offload.OffloadedAdam(params, store="gpu")
    with pytest.raises(ValueError, match="needs a path"):
        offload.OffloadedAdam(mlp().parameters(), store="disk")
    with pytest.raises(ValueError, match="invalid Adam"):
        offload.OffloadedAdam(mlp().parameters(), betas=(0.9, 1.0))
    with pytest.raises(FileNotFoundError, match="no tensor file"):
        offload.TensorFile(tmp_path / "missing.bin")
    with pytest.raises(ValueError, match="at least one tensor"):
        offload.TensorFile.zeros(tmp_path / "empty.bin", {})
    stored = offload.TensorFile.save(tmp_path / "a.bin", {"a": torch.ones(2)})
    with pytest.raises(KeyError, match="'b' is not in"):
        stored["b"]
    with pytest.raises(ValueError, match="at least one layer"):
        offload.StreamedModel([], tmp_path / "none.bin")


# ---- On a GPU: peak device memory, measured by the allocator --------------------------------


@pytest.mark.gpu
def test_streaming_weights_lowers_peak_cuda_memory(tmp_path):
    model = char_gpt(100, seed=0, n_layer=8, n_embd=256, block_size=64).eval()
    x = torch.randint(100, (4, 64), device="cuda")
    streamed = offload.StreamedModel(as_layers(model), tmp_path / "w.bin", device="cuda")

    def resident():  # the usual way: the whole model moves to the GPU, then runs
        with torch.no_grad():
            return model.to("cuda")(x)[0]

    peak_streamed = cuda_peak_bytes(lambda: streamed(x))
    peak_resident = cuda_peak_bytes(resident)
    total = sum(p.nbytes for p in model.parameters())
    assert peak_streamed < peak_resident, (peak_streamed, peak_resident)
    assert peak_resident >= total > 2 * streamed.peak_resident_bytes
    torch.testing.assert_close(streamed(x), resident(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_offloaded_adam_lowers_peak_cuda_memory(tmp_path):
    x = torch.randint(100, (4, 64), device="cuda")
    y = torch.randint(100, (4, 64), device="cuda")

    def peak(make_optimizer):
        model = char_gpt(100, seed=0, n_layer=8, n_embd=256, block_size=64).cuda()
        optimizer = make_optimizer(model.parameters())
        torch.cuda.empty_cache()
        return cuda_peak_bytes(lambda: _train(model, optimizer, x, y, steps=2)), optimizer

    theirs, _ = peak(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    ours, optimizer = peak(lambda ps: offload.OffloadedAdam(ps, lr=1e-3, store="cpu"))
    assert optimizer.state_bytes_on("cuda") == 0
    assert ours < theirs


def test_ideal_timeline_without_prefetch_is_the_sum_of_loads_and_computes():
    spans = offload.ideal_timeline([1.0, 2.0, 1.0], [3.0, 1.0, 2.0], prefetch=False)
    assert {s.lane for s in spans} == {"compute thread"}
    assert [(s.kind, s.layer) for s in spans[:2]] == [("load", 0), ("compute", 0)]
    assert spans[-1].end == 10.0


def test_ideal_timeline_with_prefetch_overlaps_the_next_load():
    # load 0 (1), compute 0 (3) while load 1 (2), compute 1 (1) while load 2 (1), compute 2 (2)
    spans = offload.ideal_timeline([1.0, 2.0, 1.0], [3.0, 1.0, 2.0], prefetch=True)
    computes = [(s.start, s.end) for s in spans if s.kind == "compute"]
    assert computes == [(1.0, 4.0), (4.0, 5.0), (5.0, 7.0)]
    loads = [(s.layer, s.start) for s in spans if s.kind == "load"]
    assert loads == [(0, 0.0), (1, 1.0), (2, 4.0)]
    # a load longer than the compute it hides behind delays the next compute
    slow = offload.ideal_timeline([1.0, 5.0], [1.0, 1.0], prefetch=True)
    assert slow[-1].end == 7.0


def test_layer_seconds_times_every_layer(tmp_path):
    layers = as_layers(mlp(seed=0, in_features=8, hidden=(16,), out_features=4))
    streamed = offload.StreamedModel(layers, tmp_path / "w.bin", prefetch=False)
    load_s, compute_s = streamed.layer_seconds(torch.randn(3, 8), rounds=2)
    assert len(load_s) == len(compute_s) == len(layers)
    assert all(t >= 0 for t in load_s + compute_s)
