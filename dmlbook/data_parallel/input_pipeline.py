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

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "export_png_folder",
    "PngFolder",
    "Throughput",
    "loading_throughput",
    "training_throughput",
    "fed_training_throughput",
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
    """Samples processed in some seconds; bandwidth counts the bytes of the tensors produced."""

    samples: int
    seconds: float
    bytes_per_sample: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.samples_per_s * self.bytes_per_sample / 1e6


def loading_throughput(loader: DataLoader, max_batches: int | None = None) -> Throughput:
    """How fast ``loader`` delivers batches when nothing consumes them."""
    samples, nbytes = 0, 0
    start = time.perf_counter()
    for b, (x, _) in enumerate(loader):
        samples += len(x)
        nbytes = x[0].numel() * x.element_size()
        if max_batches is not None and b + 1 >= max_batches:
            break
    return Throughput(samples, time.perf_counter() - start, nbytes)


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
    start = time.perf_counter()
    for s in range(steps):
        _sgd_step(model, opt, *batches[s % len(batches)])
    seconds = time.perf_counter() - start
    return Throughput(steps * batch_size, seconds, x[0].numel() * x.element_size())


def fed_training_throughput(
    model: nn.Module, loader: DataLoader, max_batches: int | None = None
) -> Throughput:
    """How fast ``model`` trains when every batch comes through ``loader``: the real pipeline."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    samples, nbytes = 0, 0
    start = time.perf_counter()
    for b, (x, y) in enumerate(loader):
        _sgd_step(model, opt, x, y)
        samples += len(x)
        nbytes = x[0].numel() * x.element_size()
        if max_batches is not None and b + 1 >= max_batches:
            break
    return Throughput(samples, time.perf_counter() - start, nbytes)
