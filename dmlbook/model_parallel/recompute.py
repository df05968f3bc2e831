"""Recomputation (activation checkpointing): keep a few activations, rebuild the rest in backward.

Chapter 4 ("Bottlenecks and solutions") meets the on-device memory bottleneck: a training step
keeps every activation that backward needs until backward has used it, so activation memory grows
with depth. Checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost")
splits the n layers into segments, keeps only each segment's input, and reruns the segment in
backward to get its activations back: about one extra forward pass buys memory that grows like
n / segments + segments, smallest (about 2 sqrt(n)) at sqrt(n) segments.

- ``CheckpointSegment``: the idea by hand, a ``torch.autograd.Function`` that runs a segment with
  gradients off, saves its input and the RNG state, and in backward reruns the segment (same
  dropout masks) and backpropagates through it. ``checkpoint_segment`` applies it to a list of
  layers; ``torch_checkpoint_segment`` does the same with ``torch.utils.checkpoint``.
- ``checkpoint_sequential`` cuts a list of layers into segments with either one; ``sqrt_segments``
  is the sqrt(n) rule.
- ``SavedTensorMeter`` and ``measure_activation_memory`` measure activation memory on CPU by
  counting the bytes autograd saves for backward (``saved_tensors_hooks``); ``cuda_peak_bytes``
  reads the allocator on a GPU. ``benchmark`` sets no checkpointing, ours and torch's side by side.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from dmlbook.models import MLP, CharGPT, char_gpt, mlp

# ---- How many segments, and where to cut -----------------------------------------------------


def sqrt_segments(n_layers: int) -> int:
    """The sqrt(n) rule: keeping k segment inputs plus one segment of n/k layers costs about
    k + n/k activations, smallest at k = sqrt(n) (Chen et al. 2016)."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    return max(1, round(math.sqrt(n_layers)))


def split_segments(n_layers: int, segments: int) -> list[range]:
    """Cut ``range(n_layers)`` into ``segments`` contiguous runs whose sizes differ by at most one;
    the longer runs come last (the last segment is never recomputed, see checkpoint_sequential)."""
    if segments < 1:
        raise ValueError(f"segments must be >= 1, got {segments}")
    if segments > n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {segments} non-empty segments")
    short, longer = divmod(n_layers, segments)
    sizes = [short] * (segments - longer) + [short + 1] * longer
    starts = [sum(sizes[:i]) for i in range(segments)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


# ---- Checkpointing one segment: by hand, and torch's ----------------------------------------


def _run_layers(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _rng_state(device: torch.device) -> dict:
    """The CPU generator's state, plus the accelerator's when the segment runs on one."""
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


class CheckpointSegment(torch.autograd.Function):
    """Run ``run(x)`` keeping only ``x``; in backward, run it again with grad and backpropagate.

    ``params`` are the segment's parameters, passed in so that autograd asks this Function for
    their gradients: without them, a segment whose input needs no grad (the first layers) would
    give its weights none at all. Gradients equal plain backprop bit for bit, because backward
    reruns the same operations on the same input with the same random numbers.
    """

    @staticmethod
    def forward(ctx, run: Callable, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # Autograd runs a Function's forward with gradients off: the segment records no graph
        # and saves no activation. We keep what backward needs to replay it exactly.
        ctx.run = run
        ctx.rng = _rng_state(x.device)  # dropout must draw the same masks again
        ctx.save_for_backward(x, *params)  # x is the one activation this segment keeps
        return run(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]  # for x, then each parameter
        devices = [x.device] if x.device.type != "cpu" else []
        # Replay the forward's RNG, then give the caller's RNG back untouched.
        with torch.random.fork_rng(devices=devices, device_type=x.device.type):
            torch.set_rng_state(ctx.rng["cpu"])
            if devices:
                torch.get_device_module(x.device.type).set_rng_state(ctx.rng["device"], x.device)
            with torch.enable_grad():
                x_again = x.detach().requires_grad_(needs[0])  # a leaf that shares x's memory
                out = ctx.run(x_again)  # recompute: the segment's activations exist again
        wanted = [t for t, need in zip([x_again, *params], needs, strict=True) if need]
        # Backpropagate through the replayed segment into .grad, as plain backprop does: each
        # weight's gradient is added to its .grad (and freed) as soon as it is computed.
        # Returning them all instead (``torch.autograd.grad``) would hold every weight gradient
        # of the segment at once: 4 MiB per 1024x1024 layer, more than checkpointing saves.
        torch.autograd.backward(out, grad_out, inputs=wanted)
        return None, x_again.grad if needs[0] else None, *(None for _ in params)


def checkpoint_segment(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Run ``layers`` on ``x`` through the hand-written ``CheckpointSegment`` (chapter 4)."""
    if not torch.is_grad_enabled():
        return _run_layers(layers, x)  # nothing is saved without grad: nothing to checkpoint
    params = {p: None for layer in layers for p in layer.parameters() if p.requires_grad}
    return CheckpointSegment.apply(partial(_run_layers, layers), x, *params)


def torch_checkpoint_segment(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Run ``layers`` on ``x`` through ``torch.utils.checkpoint.checkpoint`` (non-reentrant)."""
    return _torch_checkpoint(partial(_run_layers, layers), x, use_reentrant=False)


CheckpointFn = Callable[[Sequence[nn.Module], torch.Tensor], torch.Tensor]


def checkpoint_sequential(
    layers: Sequence[nn.Module],
    segments: int,
    x: torch.Tensor,
    checkpoint: CheckpointFn = checkpoint_segment,
) -> torch.Tensor:
    """Run ``layers`` in ``segments`` segments, each but the last through ``checkpoint``.

    The last segment runs normally, as in ``torch.utils.checkpoint.checkpoint_sequential``:
    backward would recompute it first thing, so keeping its activations raises no peak and saves
    one segment's recomputation. One segment is therefore plain backprop.
    """
    layers = list(layers)
    cuts = split_segments(len(layers), segments)
    for cut in cuts[:-1]:
        x = checkpoint(layers[cut.start : cut.stop], x)
    return _run_layers(layers[cuts[-1].start :], x)


# ---- A model as before -> layers -> after, so any of them can be checkpointed ----------------


@dataclass
class LayerChain:
    """A model seen as ``loss = after(layers(before(inputs)), targets)``; ``layers`` get cut."""

    model: nn.Module
    before: Callable[[torch.Tensor], torch.Tensor]  # inputs -> first layer's input
    layers: list[nn.Module]  # the chain of layers that checkpointing cuts into segments
    after: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last output, targets) -> loss

    def loss(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        checkpoint: CheckpointFn | None = None,
        segments: int | None = None,
    ) -> torch.Tensor:
        """One forward pass to the loss; with ``checkpoint``, in ``segments`` (default sqrt(n))."""
        x = self.before(inputs)
        if checkpoint is None:
            x = _run_layers(self.layers, x)
        else:
            segments = sqrt_segments(len(self.layers)) if segments is None else segments
            x = checkpoint_sequential(self.layers, segments, x, checkpoint)
        return self.after(x, targets)


def layer_chain(model: nn.Module) -> LayerChain:
    """An ``MLP`` as its Linear+ReLU units, or a ``CharGPT`` as its blocks (the book's models)."""
    if isinstance(model, MLP):
        units: list[list[nn.Module]] = []  # each Linear with what follows it (ReLU, dropout)
        for layer in model.layers:
            if isinstance(layer, nn.Linear) or not units:
                units.append([])
            units[-1].append(layer)
        layers = [nn.Sequential(*unit) for unit in units]
        return LayerChain(model, lambda x: x.flatten(1), layers, F.cross_entropy)
    if isinstance(model, CharGPT):

        def after(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = model.head(x)  # (B, T, V)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        return LayerChain(model, model.embed, list(model.blocks), after)
    raise TypeError(f"no layer chain for {type(model).__name__}; build a LayerChain by hand")


# ---- Measuring activation memory --------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class _Saved:
    """What the graph holds instead of a saved tensor: dies when autograd lets the tensor go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter(torch.autograd.graph.saved_tensors_hooks):
    """Live bytes of the tensors autograd keeps for backward, and their peak (chapter 4).

    Each saved tensor is counted once per storage (views such as q, k, v of one projection share
    it) from the moment an op saves it until autograd releases it, which backward does as soon as
    the op's gradient is computed. ``exclude`` (the parameters) is not activation memory.
    Caveat: the hooks of the innermost ``saved_tensors_hooks`` win, so tensors saved inside
    ``torch.utils.checkpoint`` (its own hooks) are invisible to this meter.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.holders: dict[tuple[str, int], int] = {}  # storage -> saved tensors sharing it
        self.current = 0  # bytes saved and not yet released
        self.peak = 0  # the most `current` has been
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> object:
        key = _storage_key(t)
        if key in self.excluded:
            return t
        nbytes = t.untyped_storage().nbytes()
        if self.holders.get(key, 0) == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self.holders[key] = self.holders.get(key, 0) + 1
        # Hold a detached alias: same storage, but no grad_fn, so an op's saved output does not
        # point back at the graph that holds it (a cycle that would outlive a dropped graph).
        saved = _Saved(t.detach())
        weakref.finalize(saved, self._release, key, nbytes)
        return saved

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: tuple[str, int], nbytes: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:
            self.current -= nbytes


@dataclass
class ActivationMemory:
    """Bytes saved for backward during one training step."""

    forward_bytes: int  # held when the forward pass ends
    peak_bytes: int  # the most held at any moment of forward and backward
    meter_peak_bytes: int  # the meter's own peak; misses torch.utils.checkpoint's recomputation
    recompute_bytes: list[int]  # what rerunning each checkpointed segment saves again


def measure_activation_memory(
    chain: LayerChain,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    checkpoint: CheckpointFn | None = None,
    segments: int | None = None,
) -> ActivationMemory:
    """Run one forward and backward (gradients accumulate into .grad) and count saved bytes.

    Backward frees what the layers after segment j saved before it recomputes segment j, so
    the peak is max(forward_bytes, held_j + recompute_j), where held_j is what was held right
    after segment j ran forward and recompute_j is measured by running segment j again under
    the meter. For no checkpointing and for ``checkpoint_segment``, whose recomputation the
    meter sees, ``meter_peak_bytes`` measures the same peak directly; the tests check both agree.
    """
    exclude = [*chain.model.parameters(), *chain.model.buffers()]
    held, segment_inputs = [], []

    def recording(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        segment_inputs.append((layers, x.detach(), x.requires_grad))
        out = checkpoint(layers, x)
        held.append(meter.current)  # held right after this segment's forward
        return out

    with SavedTensorMeter(exclude) as meter:
        loss = chain.loss(inputs, targets, recording if checkpoint else None, segments)
        forward_bytes = meter.current
        loss.backward()
    recompute = []
    devices = [inputs.device] if inputs.device.type != "cpu" else []
    with torch.random.fork_rng(devices, device_type=inputs.device.type):  # leave the RNG alone
        for layers, x, needs_grad in segment_inputs:
            x_again = x.requires_grad_(needs_grad)  # the leaf backward rebuilds
            with SavedTensorMeter([*exclude, x_again]) as again:
                _run_layers(layers, x_again)
            recompute.append(again.peak)
    peak = max([forward_bytes, *map(sum, zip(held, recompute, strict=True))])
    return ActivationMemory(forward_bytes, peak, meter.peak, recompute)


def cuda_peak_bytes(step: Callable[[], object], device: torch.device | None = None) -> int:
    """Peak bytes the CUDA allocator held during ``step()`` above what it held before it.

    One small matrix product runs first: cuBLAS takes its workspace (32 MiB on a Hopper) from the
    caching allocator on a stream's first product and keeps it, so without it whichever step is
    measured first would be charged a one-time cost the others are not."""
    probe = torch.ones(8, 8, device=device if device is not None else "cuda")
    probe @ probe
    del probe
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# ---- Benchmark: memory saved against time spent ------------------------------------------------


def _bench_model(name: str, device: torch.device) -> tuple[LayerChain, torch.Tensor, torch.Tensor]:
    """The benchmark's models: deep enough that sqrt(n) segments pay off."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = mlp(seed=0, in_features=512, hidden=(512,) * 48, out_features=10)
        # He init (std sqrt(2 / fan_in)) keeps signals and gradients at scale through 48 ReLU
        # layers. With nn.Linear's default they shrink to denormal floats, which CPUs compute
        # 10x slower: the timings would measure denormal arithmetic, not checkpointing.
        with torch.no_grad():
            for layer in model.layers[::2]:
                layer.weight.normal_(0.0, math.sqrt(2.0 / layer.in_features), generator=g)
                layer.bias.zero_()
        inputs, targets = (
            torch.randn(128, 512, generator=g),
            torch.randint(0, 10, (128,), generator=g),
        )
    elif name == "char_gpt":
        model = char_gpt(96, seed=0, n_layer=16, n_head=4, n_embd=128, block_size=64, dropout=0.1)
        inputs = torch.randint(0, 96, (16, 64), generator=g)
        targets = torch.randint(0, 96, (16, 64), generator=g)
    else:
        raise ValueError(f"unknown benchmark model {name!r}; use 'mlp' or 'char_gpt'")
    model.to(device).train()
    return layer_chain(model), inputs.to(device), targets.to(device)


def _train_step(chain: LayerChain, batch: tuple, checkpoint: CheckpointFn | None, segments: int):
    chain.model.zero_grad(set_to_none=True)
    chain.loss(*batch, checkpoint, segments).backward()


def _median_step_times(
    chain: LayerChain, batch: tuple, variants: dict, segments: int, repeats: int, warmup: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU seconds per training step of each variant. The variants take turns
    step by step, so that drift on a busy machine hits all of them alike; the process's CPU
    time is steadier than the wall clock when other processes compete for the cores."""
    cuda = batch[0].is_cuda
    wall_s: dict[str, list[float]] = {v: [] for v in variants}
    cpu_s: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(warmup + repeats):
        for v, fn in variants.items():
            if cuda:
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            _train_step(chain, batch, fn, segments)
            if cuda:
                torch.cuda.synchronize()  # CUDA kernels run asynchronously: wait for them
            if i >= warmup:
                wall_s[v].append(time.perf_counter() - wall)
                cpu_s[v].append(time.process_time() - cpu)
    median = lambda times: {v: statistics.median(t) for v, t in times.items()}
    return median(wall_s), median(cpu_s)


def benchmark(
    models: Sequence[str] = ("mlp", "char_gpt"),
    repeats: int = 20,
    warmup: int = 2,
    device: str | torch.device | None = None,
) -> list[dict]:
    """No checkpointing vs ours vs torch's at sqrt(n) segments: activation bytes and step time.

    One record per (model, implementation): ``activation_bytes_saved_fraction`` is 1 - peak
    activation bytes / those without checkpointing, and ``time_overhead_fraction`` is the median
    step (forward + backward) time / that without checkpointing - 1, on the wall clock (and on
    the process's CPU clock, ``cpu_time_overhead_fraction``). On a GPU the records also carry the
    allocator's peak (``cuda_peak_bytes``), which includes gradients and temporaries.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    variants = {"none": None, "ours": checkpoint_segment, "torch": torch_checkpoint_segment}
    records = []
    for name in models:
        chain, *batch = _bench_model(name, dev)
        segments = sqrt_segments(len(chain.layers))
        memory = {
            v: measure_activation_memory(chain, *batch, fn, segments) for v, fn in variants.items()
        }
        step_s, cpu_s = _median_step_times(chain, tuple(batch), variants, segments, repeats, warmup)
        for v in ("ours", "torch"):
            peak, baseline = memory[v].peak_bytes, memory["none"].peak_bytes
            record = {
                "model": name,
                "implementation": v,
                "device": dev.type,
                "layers": len(chain.layers),
                "segments": segments,
                "activation_bytes_saved_fraction": 1 - peak / baseline,
                "time_overhead_fraction": step_s[v] / step_s["none"] - 1,
                "peak_activation_bytes": peak,
                "baseline_peak_activation_bytes": baseline,
                "step_s": step_s[v],
                "baseline_step_s": step_s["none"],
                "cpu_time_overhead_fraction": cpu_s[v] / cpu_s["none"] - 1,
            }
            if dev.type == "cuda":
                for key, fn in (
                    ("cuda_peak_bytes", variants[v]),
                    ("baseline_cuda_peak_bytes", None),
                ):
                    record[key] = cuda_peak_bytes(partial(_train_step, chain, batch, fn, segments))
            records.append(record)
    return records
