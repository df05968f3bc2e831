"""The input pipeline, measured: files on disk -> decoded, augmented tensors -> a training step.

Chapter 1 ("Splitting input data") uses it to measure the book's key point: the bottleneck is the
mismatch between *data-loading bandwidth* (how many samples a second the pipeline can read, decode
and augment) and *model-training bandwidth* (how many samples a second the model can consume),
not the size of the data. Chapter 3 reuses the same loader as the first stage of its data-parallel
pipeline (pre-processing, partition, loading).

The files are a real image-folder tree (``root/<label>/<index>.png``, the layout that
``torchvision.datasets.ImageFolder`` reads), written from the shipped digits and enlarged to the
32 x 32 of CIFAR-10, so that opening and decoding a file costs what it costs.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dmlbook.cpu_wait import cpu_wait_s

__all__ = [
    "export_png_folder",
    "PngFolder",
    "Throughput",
    "loading_throughput",
    "training_throughput",
    "fed_training_throughput",
    "measure_pipeline",
    "jpeg_decode_seconds",
]


def export_png_folder(
    images: np.ndarray, labels: np.ndarray, root: str | Path, max_value: float, size: int = 32
) -> Path:
    """Write ``images`` (N, H, W), values 0..max_value, as 8-bit ``root/<label>/<i>.png`` files."""
    if max_value <= 0:
        raise ValueError(f"max_value must be > 0, got {max_value}")
    root = Path(root)
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        gray = np.clip(np.asarray(image, dtype=np.float64) / max_value * 255, 0, 255).round()
        pixels = Image.fromarray(gray.astype(np.uint8))
        pixels.resize((size, size), Image.BILINEAR).save(folder / f"{i:05d}.png")
    return root


class PngFolder(Dataset):
    """An image-folder dataset: open, decode, augment (pad-and-crop, noise), scale to [0, 1].

    The augmentation of sample ``i`` is drawn from ``(seed, epoch, i)``: reproducible, and new
    every epoch once the training loop calls :meth:`set_epoch`, as with a DistributedSampler.
    """

    def __init__(self, root: str | Path, augment: bool = True, seed: int = 0):
        self.files = sorted(Path(root).glob("*/*.png"))
        if not self.files:
            raise FileNotFoundError(f"no <label>/<name>.png files under {root}")
        self.labels = [int(f.parent.name) for f in self.files]
        self.augment, self.seed, self.epoch = augment, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as img:  # read + decode
            pixels = np.asarray(img, dtype=np.float32) / 255.0  # (H, W)
        if self.augment:  # the standard CIFAR recipe: pad by 2, random 32x32 crop, light noise
            rng = np.random.default_rng((self.seed, self.epoch, i))
            h, w = pixels.shape
            padded = np.pad(pixels, 2)
            top, left = rng.integers(0, 5, size=2)
            pixels = padded[top : top + h, left : left + w]
            pixels = pixels + rng.normal(0.0, 0.02, size=pixels.shape).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(pixels))[None], self.labels[i]  # (1, H, W)


@dataclass
class Throughput:
    """Samples processed in some seconds; bandwidth counts the bytes of the tensors produced.

    ``cpu_seconds`` is the CPU time that *this* process spent (``time.process_time``), which a
    loader's worker process does not add to, and which other work on the machine barely moves."""

    samples: int
    seconds: float
    bytes_per_sample: int
    cpu_seconds: float = 0.0

    @property
    def cpu_ms_per_sample(self) -> float:
        return 1e3 * self.cpu_seconds / self.samples

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.samples_per_s * self.bytes_per_sample / 1e6


def loading_throughput(loader: DataLoader, max_batches: int | None = None) -> Throughput:
    """How fast ``loader`` delivers batches when nothing consumes them."""
    samples, bytes_per_sample = 0, 0
    start, cpu = time.perf_counter(), time.process_time()
    for b, (x, _) in enumerate(loader):
        samples += len(x)
        bytes_per_sample = x[0].numel() * x.element_size()
        if max_batches is not None and b + 1 >= max_batches:
            break
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Throughput(samples, seconds, bytes_per_sample, cpu)


def _sgd_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def training_throughput(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 64, steps: int = 30
) -> Throughput:
    """How fast ``model`` trains on batches already in memory (no loading at all)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
    batches = [b for b in batches if len(b[0]) == batch_size]
    _sgd_step(model, opt, *batches[0])  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    for s in range(steps):
        _sgd_step(model, opt, *batches[s % len(batches)])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Throughput(steps * batch_size, seconds, x[0].numel() * x.element_size(), cpu)


def fed_training_throughput(
    model: nn.Module, loader: DataLoader, max_batches: int | None = None
) -> Throughput:
    """How fast ``model`` trains when every batch comes through ``loader``: the real pipeline."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    samples = 0
    start, cpu = time.perf_counter(), time.process_time()  # wall clock; this process's CPU
    for b, (x, y) in enumerate(loader):  # the loader reads, decodes, augments (or its worker)
        _sgd_step(model, opt, x, y)  # forward, backward, update
        samples += len(x)
        if max_batches is not None and b + 1 >= max_batches:
            break
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    bytes_per_sample = x[0].numel() * x.element_size()
    return Throughput(samples, seconds, bytes_per_sample, cpu)


@dataclass
class PipelineMeasurement:
    """:func:`measure_pipeline`'s result: each a median :class:`Throughput` of the rounds.

    ``loading``: the loader alone; per model name, ``training`` (batches in memory), ``in_turn``
    (fed by the loader in this process) and ``overlapped`` (fed by the loader's worker).
    ``cpu_ms``: the median over the rounds of each one's CPU ms per sample, keyed like
    ``("in_turn", name)`` (and ``("loading", None)``)."""

    loading: Throughput
    training: dict[str, Throughput]
    in_turn: dict[str, Throughput]
    overlapped: dict[str, Throughput]
    cpu_ms: dict[tuple[str, str | None], float]
    cpu_wait_share: float = 0.0  # of the measuring time, this process waited for a free CPU


def measure_pipeline(
    in_process: DataLoader,
    in_worker: DataLoader,
    candidates: dict[str, tuple[nn.Module, int, int]],
    x: torch.Tensor,
    y: torch.Tensor,
    rounds: int = 3,
    loading_batches: int = 20,
) -> PipelineMeasurement:
    """Measure loading alone and each model of ``candidates`` (``name: (model, steps of training
    alone on x, y, batches fed)``) trained alone, fed in turn and fed by a worker.

    ``rounds`` rounds, each measuring everything once, so that a slow moment on a shared machine
    hits one round of every quantity rather than all repeats of one; the median round of each
    quantity (by samples per second) is kept. ``cpu_wait_share`` says how busy the machine was:
    the share of the time this process was ready to run but found no free CPU."""
    loading_throughput(in_process, max_batches=3)  # warm the file cache and the decoder
    loading_throughput(in_worker, max_batches=3)  # start the worker process
    waited, began = cpu_wait_s(), time.perf_counter()
    measured: list[dict] = []
    for _ in range(rounds):
        r = {"loading": loading_throughput(in_process, max_batches=loading_batches)}
        for name, (model, steps, batches) in candidates.items():
            r[name] = (
                training_throughput(model, x, y, steps=steps),
                fed_training_throughput(model, in_process, max_batches=batches),
                fed_training_throughput(model, in_worker, max_batches=batches),
            )
        measured.append(r)

    def median(pick) -> Throughput:
        ordered = sorted((pick(r) for r in measured), key=lambda t: t.samples_per_s)
        return ordered[len(ordered) // 2]

    def per_model(i: int) -> dict[str, Throughput]:
        return {n: median(lambda r, n=n: r[n][i]) for n in candidates}

    def median_cpu(pick) -> float:
        ordered = sorted(pick(r).cpu_ms_per_sample for r in measured)
        return ordered[len(ordered) // 2]

    cpu_ms = {("loading", None): median_cpu(lambda r: r["loading"])}
    for i, kind in enumerate(("training", "in_turn", "overlapped")):
        for n in candidates:
            cpu_ms[kind, n] = median_cpu(lambda r, n=n, i=i: r[n][i])
    cpu_wait_share = (cpu_wait_s() - waited) / (time.perf_counter() - began)
    return PipelineMeasurement(
        median(lambda r: r["loading"]),
        per_model(0),
        per_model(1),
        per_model(2),
        cpu_ms,
        cpu_wait_share,
    )


def jpeg_decode_seconds(
    width: int = 500, height: int = 375, quality: int = 90, repeats: int = 20, seed: int = 0
) -> tuple[float, int]:
    """Seconds to open and decode one colour JPEG of ``width`` x ``height`` (the median of
    ``repeats``; the defaults are a typical ImageNet photo), and the file's bytes: what one
    ImageNet image costs a loader before any augmentation. The image is smoothed noise, so that
    it compresses to about the ~110 KB of an ImageNet photo."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(height // 3, width // 3, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    noisy = np.asarray(image, dtype=np.int16) + rng.integers(-8, 9, size=(height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    times = []
    for _ in range(repeats):
        buffer.seek(0)
        start = time.perf_counter()
        with Image.open(buffer) as img:
            img.convert("RGB").load()  # read + decode
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], buffer.getbuffer().nbytes
