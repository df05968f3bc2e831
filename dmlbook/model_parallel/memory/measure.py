"""Measuring a real step: the same components as the estimate, counted from live tensors (ch. 5)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.model_parallel import pipeline
from dmlbook.model_parallel.memory.estimate import check_batch_and_seq, recompute_segment_count
from dmlbook.model_parallel.memory.spec import (
    COMPONENTS,
    OPTIMIZERS,
    PRECISIONS,
    check_choice,
    spec_of,
)
from dmlbook.model_parallel.recompute import (
    SavedTensorMeter,
    checkpoint_segment,
    cuda_peak_bytes,
    layer_chain,
)
from dmlbook.models import CharGPT, next_token_loss

# ---- Measuring a real step ----------------------------------------------------------------------


@dataclass
class MemoryMeasurement:
    """Bytes measured during a real training step: the components of :class:`MemoryEstimate`.

    ``transient`` is what the allocator held at its peak beyond the saved activations: the
    gradients in flight, temporaries of the kernels."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # peak bytes autograd saved for backward (SavedTensorMeter)
    peak: int  # the allocator's peak during the step, above what it held before the step
    device: str
    layer_activations: dict[str, int] = field(default_factory=dict)  # embed, block i, head
    # measure_stage only: this stage's forward and backward ops of the measured step
    # (pipeline.OpRecord, seconds since the step's common start on every rank)
    timeline: list = field(default_factory=list)

    @property
    def transient(self) -> int:
        return max(0, self.peak - self.activations)

    @property
    def total(self) -> int:
        """Weights, gradients and optimizer state, plus the step's allocator peak above them."""
        return self.parameters + self.gradients + self.optimizer_state + self.peak

    def components(self) -> dict[str, int]:
        """The five parts of ``total``, by name, as :meth:`MemoryEstimate.components`."""
        return {name: getattr(self, name) for name in COMPONENTS}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """The optimizer ``estimate`` means by ``name`` (learning rates do not change memory)."""
    check_choice("optimizer", name, OPTIMIZERS)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9 if name == "sgd_momentum" else 0.0)


def cpu_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held during ``step()`` above what it held before it: the CPU
    counterpart of :func:`dmlbook.model_parallel.recompute.cuda_peak_bytes`.

    Torch's profiler with ``profile_memory`` records every allocation and free with its time;
    their running sum is the allocator's live bytes. The legacy (autograd) profiler is used
    because it starts in microseconds, where the Kineto one takes seconds on first use.
    """
    config = torch.autograd.ProfilerConfig(
        torch.autograd.ProfilerState.CPU, False, True, False, False, False,
        torch._C._profiler._ExperimentalConfig(),
    )  # fmt: skip  # (state, shapes, profile_memory, stack, flops, modules, experimental)
    torch.autograd._enable_profiler_legacy(config)
    try:
        step()
    finally:
        records = torch.autograd._disable_profiler_legacy()
    events = sorted(  # (time, order within its thread, bytes allocated (+) or freed (-))
        (event.start_us(), i, event.cpu_memory_usage())
        for thread in records
        for i, event in enumerate(thread)
        if event.kind() == "memory_alloc" and event.device() == -1  # -1: the CPU
    )
    live = peak = 0
    for *_, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    forward_backward: Callable[[], object],
    watch: Callable[[SavedTensorMeter], Callable[[], None]] | None = None,
) -> MemoryMeasurement:
    """Measure a training step of ``module``: ``forward_backward()`` then ``optimizer.step()``.

    The step runs twice. The first creates the gradients and the optimizer state, whose bytes
    are read off the tensors. The second keeps them (``zero_grad(set_to_none=False)``) and is
    measured twice over: the bytes autograd saves for backward (a ``SavedTensorMeter``, whose
    aliases allocate nothing) and the allocator's peak (the profiler on a CPU, the CUDA
    allocator on a GPU). ``watch(meter)`` may install hooks that read the meter during that
    step; it returns their remover. Every rank of a pipeline calls it alike.
    """
    params = list(module.parameters())
    if not params:
        raise ValueError("the module has no parameters to train")

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        forward_backward()
        optimizer.step()

    step()
    grads = [p.grad for p in params]
    state = [t for s in optimizer.state.values() for t in s.values()]
    device = params[0].device
    with SavedTensorMeter([*params, *module.buffers()]) as meter:
        unwatch = watch(meter) if watch is not None else None
        try:
            peak = cuda_peak_bytes(step, device) if device.type == "cuda" else cpu_peak_bytes(step)
        finally:
            if unwatch is not None:
                unwatch()
    return MemoryMeasurement(
        _storage_bytes(params), _storage_bytes(grads), _storage_bytes(state), meter.peak, peak,
        device.type,
    )  # fmt: skip


def measure(
    model: CharGPT,
    batch: int,
    seq: int | None = None,
    precision: str = "fp32",
    optimizer: str = "adam",
    recompute: bool | int = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> MemoryMeasurement:
    """Measure real training steps of a copy of ``model`` (see :func:`measure_step`), with the
    same options as :func:`estimate`; without recomputation, also each layer's saved bytes."""
    check_choice("precision", precision, PRECISIONS)
    seq = model.config.block_size if seq is None else seq
    check_batch_and_seq(batch, seq, spec_of(model))
    device = torch.device(device)
    model = copy.deepcopy(model).to(device).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    idx, targets = (torch.randint(vocab, (batch, seq), generator=g).to(device) for _ in range(2))
    chain = layer_chain(model)
    segments = recompute_segment_count(recompute, len(chain.layers))
    autocast = partial(torch.autocast, device.type, torch.bfloat16, enabled=precision == "mixed")
    checkpoint = None
    if segments:
        # CheckpointSegment reruns a segment in backward, outside the autocast block: wrap the
        # segment so that the rerun is cast as the forward was.
        def checkpoint(layers, x):
            return checkpoint_segment([_Autocast(layers, autocast)], x)

    def forward_backward() -> None:
        with autocast():
            loss = chain.loss(idx, targets, checkpoint, segments)
        loss.backward()

    marks: list[tuple[str, int]] = []  # (layer, meter count when it ends)

    def watch(meter: SavedTensorMeter) -> Callable[[], None]:
        """The meter's count between layers gives each layer's share."""
        mark = lambda name: lambda *_: marks.append((name, meter.current))  # noqa: E731
        hooks = [model.blocks[0].register_forward_pre_hook(mark("embed"))]
        for i, block in enumerate(model.blocks):
            hooks.append(block.register_forward_hook(mark(f"block {i}")))
        hooks.append(model.lm_head.register_forward_hook(mark("lm_head")))
        return lambda: [hook.remove() for hook in hooks]

    opt = make_optimizer(optimizer, model.parameters())
    result = measure_step(model, opt, forward_backward, None if segments else watch)
    if marks:
        before, layers = 0, {}
        for name, current in marks:
            layers[name] = current - before
            before = current
        # lm_head's hook fires before the loss saves its log-softmax: the rest is the head's too
        layers["head"] = layers.pop("lm_head") + result.activations - before
        result.layer_activations = layers
    return result


def memory_timeline(
    model: CharGPT,
    batch: int,
    seq: int | None = None,
    optimizer: str = "adam",
    steps: int = 2,
    seed: int = 0,
) -> list[dict[str, int | str]]:
    """What a training step holds, moment by moment, over ``steps`` steps of a copy of ``model``.

    One record after each layer's forward, after each block's backward, after the optimizer step
    and after ``zero_grad(set_to_none=True)``: the bytes of parameters, gradients, optimizer
    state and saved activations (a :class:`SavedTensorMeter`) at that moment, with ``step`` and
    ``event``. The first step creates the optimizer state; gradients live from backward to
    ``zero_grad``; activations grow through forward and are freed through backward.
    """
    seq = model.config.block_size if seq is None else seq
    check_batch_and_seq(batch, seq, spec_of(model))
    model = copy.deepcopy(model).train()
    params = list(model.parameters())
    opt = make_optimizer(optimizer, params)
    g = torch.Generator().manual_seed(seed)
    idx, targets = (torch.randint(model.config.vocab_size, (batch, seq), generator=g) for _ in "xy")
    records: list[dict[str, int | str]] = []
    step = 0

    def record(event: str) -> None:
        state = [t for st in opt.state.values() for t in st.values()]
        records.append({
            "step": step, "event": event, "parameters": _storage_bytes(params),
            "gradients": _storage_bytes(p.grad for p in params),
            "optimizer_state": _storage_bytes(state), "activations": meter.current,
        })  # fmt: skip

    mark = lambda event: lambda *_: record(event)  # noqa: E731
    hooks = [model.wpe.register_forward_hook(mark("forward embed"))]
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_hook(mark(f"forward block {i}")))
        hooks.append(block.register_full_backward_hook(mark(f"backward block {i}")))
    hooks.append(model.lm_head.register_forward_hook(mark("forward head")))
    with SavedTensorMeter([*params, *model.buffers(), idx, targets]) as meter:
        try:
            for step in range(steps):  # noqa: B007 (record reads it)
                record("start")
                _, loss = model(idx, targets)
                record("loss")
                loss.backward()
                record("backward done")
                opt.step()
                record("optimizer step")
                opt.zero_grad(set_to_none=True)
                record("zero_grad")
        finally:
            for hook in hooks:
                hook.remove()
    return records


def measure_stage(
    model: CharGPT,
    batch: int,
    seq: int | None = None,
    counts: Sequence[int] | None = None,
    optimizer: str = "adam",
    seed: int = 0,
) -> MemoryMeasurement:
    """Rank function: measure this rank's pipeline stage of ``model`` (chapter 5's model split).

    The layers ``[embed, *blocks, head]`` are cut into one stage per rank
    (``pipeline.split_model``, ``counts`` or ``pipeline.even_partition``); the layers of other
    stages go to the meta device, so that each rank holds only its own weights; the step is
    ``PipelineStage.train_step`` with the vanilla schedule (one micro-batch, no overlap),
    measured by :func:`measure_step` on every rank alike. The result's ``timeline`` holds the
    measured step's forward and backward ops of this stage (``PipelineStage.forward`` and
    ``.backward``), for a time line of who works and who waits.
    """
    rank, stages = dist.get_rank(), dist.get_world_size()
    seq = model.config.block_size if seq is None else seq
    check_batch_and_seq(batch, seq, spec_of(model))
    layers = pipeline.layers_of(model.train())
    counts = list(counts) if counts is not None else pipeline.even_partition(len(layers), stages)
    parts = pipeline.split_model(layers, counts)
    for other, part in enumerate(parts):
        if other != rank:
            part.to("meta")  # frees the weights this rank does not run
    stage = pipeline.PipelineStage(parts[rank], rank, stages)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    idx, targets = (
        torch.randint(vocab, (batch, seq), generator=g).to(stage.device) for _ in range(2)
    )
    last = rank == stages - 1
    timeline: list = []

    def forward_backward() -> None:
        result = stage.train_step(
            idx if rank == 0 else None, targets if last else None,
            next_token_loss if last else None, microbatches=1, schedule="vanilla",
        )  # fmt: skip
        timeline[:] = result.timeline  # the last (measured) step's forward and backward

    measured = measure_step(
        stage.module, make_optimizer(optimizer, stage.module.parameters()), forward_backward
    )
    measured.timeline = list(timeline)
    return measured


class _Autocast(nn.Module):
    """``layers`` run in order under ``autocast()``, wherever they run (also in backward)."""

    def __init__(self, layers: Sequence[nn.Module], autocast: Callable) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            for layer in self.layers:
                x = layer(x)
        return x
