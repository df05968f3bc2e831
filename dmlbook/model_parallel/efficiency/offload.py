"""Offload: keep weights and optimizer state in CPU memory or on disk, stream them in per layer.

Chapter 8 ("Achieving higher throughput and lower latency") uses CPU memory and disk as extra
device storage. Device memory then only ever holds what the current layer needs:

- inference: :class:`StreamedModel` keeps every layer's weights in a :class:`TensorFile`, one
  file on disk read through a memory map (only the pages touched are read, and the OS page cache
  keeps them warm), and copies one layer at a time to the device, prefetching the next layer on a
  background thread while the current one computes. Peak device memory for weights drops from
  the whole model to two layers.
- training: :class:`OffloadedAdam` is Adam whose two moment tensors per parameter live in CPU
  memory or in a :class:`TensorFile` on disk; ``step()`` brings one parameter's moments to its
  device, updates, and writes them back. Adam's state (twice the model) never sits on the device.

Both give exactly what the resident model and ``torch.optim.Adam`` give. torch's own versions
are FSDP's CPU offload (``fully_shard(..., offload_policy=CPUOffloadPolicy())``, which keeps the
sharded parameters, gradients and optimizer step on the CPU; :func:`fsdp2_offload_train` runs it)
and DeepSpeed's ZeRO-Offload and ZeRO-Infinity (optimizer state and parameters on CPU or NVMe).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from dmlbook.optim import adam_update_

__all__ = ["OffloadedAdam", "StreamedModel", "TensorFile", "fsdp2_offload_train", "ideal_timeline"]

ALIGN = 64  # every tensor starts at a multiple of 64 bytes: any dtype can view it in place


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a tensor file's index")
    return dtype


class TensorFile:
    """Named tensors laid out back to back in one file, read and written through a memory map.

    ``path`` holds the raw bytes; ``path.json`` the index: name -> (offset, shape, dtype).
    ``file[name]`` is a tensor *viewing* the mapped file, with no copy: the OS reads its pages
    from disk when they are first touched. Opened with ``writable=False`` (copy-on-write), writes
    stay in this process; with ``writable=True`` they go to the file.
    """

    def __init__(self, path: str | Path, writable: bool = False) -> None:
        self.path = Path(path)
        index_path = self.path.with_name(self.path.name + ".json")
        if not self.path.is_file() or not index_path.is_file():
            raise FileNotFoundError(f"no tensor file at {self.path} (with its index {index_path})")
        self.index = {
            name: (offset, tuple(shape), _dtype(dtype))
            for name, (offset, shape, dtype) in json.loads(index_path.read_text()).items()
        }
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r+" if writable else "c")

    @staticmethod
    def _layout(specs: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> tuple[dict, int]:
        index, offset = {}, 0
        for name, (shape, dtype) in specs.items():
            offset = -(-offset // ALIGN) * ALIGN  # round up to the alignment
            index[name] = (offset, list(shape), str(dtype).removeprefix("torch."))
            offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return index, offset

    @classmethod
    def zeros(
        cls, path: str | Path, specs: Mapping[str, tuple[Sequence[int], torch.dtype]]
    ) -> TensorFile:
        """A new file holding zero tensors of the given shapes and dtypes, opened writable."""
        if not specs:
            raise ValueError("a tensor file needs at least one tensor")
        path = Path(path)
        index, size = cls._layout(specs)
        with open(path, "wb") as f:
            f.truncate(max(size, 1))  # a sparse file of zeros: no bytes written yet
        path.with_name(path.name + ".json").write_text(json.dumps(index))
        return cls(path, writable=True)

    @classmethod
    def save(cls, path: str | Path, tensors: Mapping[str, torch.Tensor]) -> TensorFile:
        """Write ``tensors`` to a new file and return it opened for reading."""
        specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        written = cls.zeros(path, specs)
        for name, t in tensors.items():
            written[name].copy_(t.detach())
        written.flush()
        return cls(path)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise KeyError(f"{name!r} is not in {self.path}")
        offset, shape, dtype = self.index[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = torch.from_numpy(self._map[offset : offset + nbytes])  # uint8 view of the file
        return raw.view(dtype).view(shape)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def __len__(self) -> int:
        return len(self.index)

    def nbytes(self, name: str) -> int:
        _, shape, dtype = self.index[name]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def flush(self) -> None:
        """Write changed pages back to the file."""
        self._map.flush()


# ---- Inference: weights streamed from disk, one layer at a time --------------------------------


class StreamedModel:
    """Run ``layers`` with their weights kept in a :class:`TensorFile`, not on the device.

    The layers themselves become skeletons on the ``meta`` device (shapes, no memory); for each
    layer in turn its tensors are copied out of the memory map onto ``device`` and the skeleton
    runs with them (``torch.func.functional_call``). With ``prefetch``, a background thread loads
    layer i + 1 while layer i computes, so at most two layers are on the device at once.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        path: str | Path,
        device: str | torch.device = "cpu",
        prefetch: bool = True,
    ) -> None:
        if len(layers) == 0:
            raise ValueError("StreamedModel needs at least one layer")
        tensors = {
            f"{i}.{name}": t for i, layer in enumerate(layers) for name, t in _state(layer).items()
        }
        if not tensors:
            raise ValueError("the layers hold no parameter or buffer: nothing to stream")
        self.file = TensorFile.save(path, tensors)
        self.names = [list(_state(layer)) for layer in layers]
        self.skeletons = [copy.deepcopy(layer).to("meta") for layer in layers]
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.layer_bytes = [sum(t.nbytes for t in _state(layer).values()) for layer in layers]
        self.peak_resident_bytes = 0  # most weight bytes on the device at once, last call

    def load(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors, copied from the memory map onto the device."""
        return {n: self.file[f"{i}.{n}"].to(self.device, copy=True) for n in self.names[i]}

    def compute(self, i: int, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s skeleton run with ``weights`` swapped in."""
        return functional_call(self.skeletons[i], weights, (x,))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.skeletons)
        self.peak_resident_bytes = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            upcoming = pool.submit(self.load, 0) if self.prefetch else None
            for i in range(n):
                weights = upcoming.result() if self.prefetch else self.load(i)  # layer i, loaded
                resident = self.layer_bytes[i]
                if self.prefetch and i + 1 < n:
                    upcoming = pool.submit(self.load, i + 1)  # copies while layer i computes
                    resident += self.layer_bytes[i + 1]
                self.peak_resident_bytes = max(self.peak_resident_bytes, resident)
                x = self.compute(i, weights, x)  # layer i computes (layer i + 1 loads)
                del weights  # layer i leaves the device
        return x

    @torch.no_grad()
    def layer_seconds(
        self, x: torch.Tensor, rounds: int = 5, clock: Callable[[], float] = time.thread_time
    ) -> tuple[list[float], list[float]]:
        """Median seconds to load each layer and to compute it, each measured alone (no
        prefetch), on ``clock``: the inputs of :func:`ideal_timeline`."""
        loads: list[list[float]] = [[] for _ in self.skeletons]
        computes: list[list[float]] = [[] for _ in self.skeletons]
        for _ in range(rounds):
            h = x
            for i in range(len(self.skeletons)):
                start = clock()
                weights = self.load(i)
                loaded = clock()
                h = self.compute(i, weights, h)
                loads[i].append(loaded - start)
                computes[i].append(clock() - loaded)
        return [statistics.median(t) for t in loads], [statistics.median(t) for t in computes]


class Span(NamedTuple):
    """One bar of a timeline: ``kind`` ("load" or "compute") of ``layer`` on ``lane``."""

    lane: str
    kind: str
    layer: int
    start: float
    end: float


def ideal_timeline(
    load_s: Sequence[float], compute_s: Sequence[float], prefetch: bool
) -> list[Span]:
    """When each layer loads and computes if loading and computing never slow each other down.

    Without prefetch one thread loads layer i, computes it, then loads layer i + 1. With
    prefetch a second lane loads layer i + 1 as soon as layer i starts computing (two layers on
    the device at most), and layer i + 1 computes when both its load and layer i are done.
    """
    spans, clock = [], 0.0
    if not prefetch:
        for i, (load, work) in enumerate(zip(load_s, compute_s, strict=True)):
            spans.append(Span("compute thread", "load", i, clock, clock + load))
            spans.append(Span("compute thread", "compute", i, clock + load, clock + load + work))
            clock += load + work
        return spans
    loaded = load_s[0]
    spans.append(Span("loader thread", "load", 0, 0.0, loaded))
    for i, work in enumerate(compute_s):
        start = max(clock, loaded)  # layer i needs its weights and the previous layer's output
        if i + 1 < len(load_s):  # the next load starts with this compute
            spans.append(Span("loader thread", "load", i + 1, start, start + load_s[i + 1]))
            loaded = start + load_s[i + 1]
        spans.append(Span("compute thread", "compute", i, start, start + work))
        clock = start + work
    return spans


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name: what ``functional_call`` swaps into a skeleton."""
    return dict(module.state_dict(keep_vars=True))


# ---- Training: Adam with its state off the device ------------------------------------------------


class OffloadedAdam(torch.optim.Optimizer):
    """Adam whose moments live off the device: ``store="cpu"`` (pinned memory when a GPU is
    present) or ``store="disk"`` (a :class:`TensorFile` at ``path``).

    ``step()`` goes through the parameters one at a time: copy its two moments to the
    parameter's device (host to device), update (:func:`adam_update_`), copy them back (device to
    host). The device holds one parameter's moments at a time instead of all of them.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        store: str = "cpu",
        path: str | Path | None = None,
    ) -> None:
        if store not in ("cpu", "disk"):
            raise ValueError(f"store must be 'cpu' or 'disk', got {store!r}")
        if store == "disk" and path is None:
            raise ValueError("store='disk' needs a path for the state file")
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid Adam settings: lr={lr}, betas={betas}, eps={eps}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.store = store
        all_params = [p for group in self.param_groups for p in group["params"]]
        if store == "disk":  # every moment gets its place in the file now, zero-filled
            specs = {}
            for i, p in enumerate(all_params):
                specs[f"{i}.exp_avg"] = specs[f"{i}.exp_avg_sq"] = (tuple(p.shape), p.dtype)
            self.file = TensorFile.zeros(path, specs)
        for i, p in enumerate(all_params):
            if store == "disk":
                moments = self.file[f"{i}.exp_avg"], self.file[f"{i}.exp_avg_sq"]
            else:
                pin = torch.cuda.is_available()  # pinned pages copy to a GPU asynchronously
                moments = tuple(
                    torch.zeros(p.shape, dtype=p.dtype, pin_memory=pin) for _ in range(2)
                )
            self.state[p] = {"step": 0, "exp_avg": moments[0], "exp_avg_sq": moments[1]}

    def state_bytes_on(self, device: str | torch.device) -> int:
        """Bytes of optimizer state kept on ``device`` between steps."""
        device = torch.device(device)
        return sum(
            t.nbytes
            for s in self.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.device == device
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                # host -> device: this parameter's moments only
                exp_avg = state["exp_avg"].to(p.device, copy=True, non_blocking=True)
                exp_avg_sq = state["exp_avg_sq"].to(p.device, copy=True, non_blocking=True)
                adam_update_(
                    p, p.grad, exp_avg, exp_avg_sq, state["step"],
                    group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                )  # fmt: skip
                # device -> host: the updated moments go back, the device copies are dropped
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


# ---- torch's counterpart: FSDP2 with CPU offload -------------------------------------------------


def fsdp2_offload_train(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    lr: float = 1e-3,
) -> dict[str, torch.Tensor]:
    """Rank function: train ``model`` with torch's FSDP2 (``fully_shard``, one unit per child
    module) under ``CPUOffloadPolicy`` and Adam, every rank on the same full batch; return the
    full parameters. On a CPU-only machine ``pin_memory=False`` is needed (pinning needs a GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from dmlbook.comm.groups import device as rank_device

    # The mesh names this rank's device: FSDP2's default mesh takes ``cuda:<local rank>`` whenever
    # CUDA is present, which fails for rank 1 of a gloo group on a machine with one GPU.
    device = rank_device()
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs a GPU
    for child in model.children():
        fully_shard(child, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    inputs, targets = inputs.to(device), targets.to(device)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()  # gradients reduce-scattered to each shard
        optimizer.step()  # on the CPU: the shards and their Adam state live there
    full = {}
    for name, p in model.named_parameters():
        shard = p.to(device)  # NCCL gathers device tensors only
        full[name] = shard.full_tensor().detach().cpu()  # all-gather the shards
    return full
