"""Data for every chapter: shipped digits, generated tasks, offline loaders, and sharding by rank.

Every chapter trains on something from here. Chapter 1 ("Splitting input data") is the main
user: `shard_indices` is the data-parallel split written from scratch and checked index for index
against `torch.utils.data.DistributedSampler`, and the loaders give its measurement of
data-loading against training bandwidth real files to read.

Nothing here downloads. `load_digits` reads the shipped `data/digits.npz`, `char_corpus` reads
text that ships with CPython, the `make_*` functions generate data, and `load_mnist` /
`load_cifar10` read the standard files if you already have them (see data/README.md). Every
loader looks in `$DMLBOOK_DATA` first, then in the shipped data, which the installed package
carries (`dmlbook.book`): a wheel needs no checkout.
"""

from __future__ import annotations

import codecs
import gzip
import math
import os
import pickle
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from dmlbook import book

# The shipped data, inside the installed package (in a checkout, the repository's data/).
DATA_DIR = book.data_dir()
# The runnable scripts that torchrun starts (chapters 3, 4, 11 and 13), also inside the package:
# notebooks find them here wherever they are run from, a learner's copy or an exercise copy too.
EXAMPLES_DIR = book.examples_dir()


def data_roots() -> list[Path]:
    """Folders searched for data files: `$DMLBOOK_DATA` (if set) first, then the shipped data."""
    env = os.environ.get("DMLBOOK_DATA")
    return ([Path(env).expanduser()] if env else []) + [DATA_DIR]


def find_data(name: str) -> Path:
    """The first file called `name` in `data_roots()`: yours in `$DMLBOOK_DATA`, else shipped."""
    searched = data_roots()
    for folder in searched:
        if (folder / name).is_file():
            return folder / name
    places = "\n".join(f"  {p}" for p in searched)
    raise FileNotFoundError(
        f"{name} not found in\n{places}\nIt ships with dmlbook: reinstall the package, or put "
        f"the file in a folder named by $DMLBOOK_DATA. Nothing is downloaded."
    )


# ---- Shipped and generated data -----------------------------------------------------------


def load_digits(
    split: str = "train", test_fraction: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """UCI 8x8 digits as (x (N, 64) float32 in [0, 1], y int64): a real task that trains fast.

    Reads digits.npz from `$DMLBOOK_DATA` if it holds one, else the shipped file."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    with np.load(find_data("digits.npz"), allow_pickle=False) as f:
        # Each value counts the "on" pixels of a 4x4 block, 0..16.
        x = torch.from_numpy(f["images"]).reshape(-1, 64).float() / 16.0  # (1797, 64)
        y = torch.from_numpy(f["target"]).long()  # (1797,)
    if split == "all":
        return x, y
    # One seeded permutation; the first n_test indices are the test set, the rest train.
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(y) * test_fraction)
    keep = order[:n_test] if split == "test" else order[n_test:]
    return x[keep], y[keep]


def char_corpus() -> str:
    """CPython's own help topics (about 460k characters): a text corpus that needs no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class CharVocab:
    """Character-level tokenizer: each distinct character of the text gets an id in sorted order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Text to a 1-D LongTensor of ids; an unseen character is an error, not a silent id."""
        try:
            return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids (tensor or list) back to text."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"id {bad[0]} is outside the vocabulary of size {len(self.chars)}")
        return "".join(self.chars[i] for i in ids)


def char_blocks(
    ids: torch.Tensor, block_size: int, seed: int = 0, n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-character training pairs (x, y), both (B, block_size), where y is x shifted by one."""
    if block_size < 1 or ids.dim() != 1 or len(ids) <= block_size:
        raise ValueError(f"need a 1-D tensor longer than block_size={block_size}, got {ids.shape}")
    if n is None:
        # Windows of block_size + 1 starting every block_size: non-overlapping inputs.
        windows = ids.unfold(0, block_size + 1, block_size)  # (B, block_size + 1)
    else:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(ids) - block_size, (n,), generator=g)
        windows = ids.unfold(0, block_size + 1, 1)[starts]  # (n, block_size + 1)
    return windows[:, :-1].clone(), windows[:, 1:].clone()


def make_classification(
    n: int, dim: int = 20, classes: int = 4, seed: int = 0, noise: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs: x (n, dim) float32 around one random mean per class, y (n,) int64."""
    g = torch.Generator().manual_seed(seed)
    means = 2.0 * torch.randn(classes, dim, generator=g)  # (classes, dim)
    y = torch.randint(classes, (n,), generator=g)
    x = means[y] + noise * torch.randn(n, dim, generator=g)  # (n, dim)
    return x, y


def make_regression(
    n: int, dim: int = 20, noise: float = 0.1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear teacher plus noise: x (n, dim), y = x @ w + noise * eps of shape (n, 1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, 1, generator=g)  # the teacher
    x = torch.randn(n, dim, generator=g)
    return x, x @ w + noise * torch.randn(n, 1, generator=g)


# ---- Standard files the user already has: MNIST (IDX) and CIFAR-10 (python batches) -------

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, bottom of page).
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Parse an IDX file (the MNIST format), plain or .gz, into a native-byte-order numpy array."""
    path = Path(path)
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rb") as f:
                raw = f.read()
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise ValueError(f"{path}: corrupt gzip data ({err})") from err
    else:
        raw = path.read_bytes()
    # Header: two zero bytes, a type byte, the number of dimensions, then one uint32 per dimension.
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4].hex()})")
    ndim, dtype = raw[3], np.dtype(_IDX_DTYPES[raw[2]])
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path}: expected {expected} data bytes, found {len(raw) - header}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # a writable copy in native byte order


def _missing(what: str, names: list[str], searched: list[Path], put_in: str) -> FileNotFoundError:
    """The error for absent data: what was looked for, where, and where to put it."""
    places = "\n".join(f"  {p}" for p in searched)
    return FileNotFoundError(
        f"{what} not found: looked for {', '.join(names)} in\n{places}\n"
        f"Nothing is downloaded (dmlbook works offline). Put the files in {put_in}, "
        f"or in a folder named by $DMLBOOK_DATA, or pass root=."
    )


def _plain_or_gz(path: Path) -> Path | None:
    """`path` if it exists, else `path.gz` if that does, else None."""
    return next((p for p in (path, path.with_name(path.name + ".gz")) if p.is_file()), None)


def load_mnist(
    train: bool = True, root: str | Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from local IDX files as (x (N, 1, H, W) float32 in [0, 1], y (N,) int64)."""
    prefix = "train" if train else "t10k"
    names = [f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"]
    bases = [Path(root).expanduser()] if root is not None else data_roots()
    searched = [d for b in bases for d in (b, b / "mnist", b / "MNIST" / "raw")]
    for folder in searched:
        # Both files must sit in the same folder; each may be gzipped.
        found = [_plain_or_gz(folder / n) for n in names]
        if None not in found:
            images, labels = read_idx(found[0]), read_idx(found[1])
            if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                raise ValueError(
                    f"{folder}: images {images.shape} and labels {labels.shape} do not match"
                )
            x = torch.from_numpy(images).float().div_(255.0).unsqueeze(1)  # (N, 1, H, W)
            return x, torch.from_numpy(labels).long()
    raise _missing("MNIST", names, searched, "data/mnist/")


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds numpy arrays and nothing else, so a hostile file cannot run code."""

    # The array rebuilder's module moved in numpy 2 (numpy.core -> numpy._core); the original
    # CIFAR files name the old one. ndarray.__reduce__ hands us the function under either name.
    _reconstruct = np.empty(0).__reduce__()[0]
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # how Python 3 protocol-2 pickles store bytes
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not numpy data")
        return self._ALLOWED[module, name]


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: (data uint8 (N, 3072), labels (N,))."""
    with path.open("rb") as f:
        batch = _SafeUnpickler(f, encoding="bytes").load()
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"{path}: expected uint8 data of shape (N, 3072), got {data.shape}")
    if len(labels) != len(data):
        raise ValueError(f"{path}: {len(data)} images but {len(labels)} labels")
    return data, labels


def load_cifar10(
    train: bool = True, root: str | Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 from the local python batches as (x (N, 3, 32, 32) float32 in [0, 1], y int64)."""
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    bases = [Path(root).expanduser()] if root is not None else data_roots()
    searched = [d for b in bases for d in (b / "cifar-10-batches-py", b)]
    for folder in searched:
        if all((folder / n).is_file() for n in names):
            batches = [_read_cifar_batch(folder / n) for n in names]
            data = np.concatenate([d for d, _ in batches])  # (N, 3072): 1024 R, 1024 G, 1024 B
            labels = np.concatenate([lab for _, lab in batches])
            x = torch.from_numpy(data).reshape(-1, 3, 32, 32).float().div_(255.0)
            return x, torch.from_numpy(labels).long()
    raise _missing("CIFAR-10", names, searched, "data/cifar-10-batches-py/")


# ---- Splitting input data across ranks (chapter 1) ----------------------------------------


def _check_shard_args(length: int, rank: int, world_size: int) -> None:
    """Reject impossible shardings with a message that says which argument is wrong."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, {world_size - 1}] for world_size {world_size}, got {rank}"
        )
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")


def _per_rank(length: int, world_size: int, drop_last: bool) -> int:
    """How many indices each rank gets: rounded down if we drop the tail, else up."""
    return length // world_size if drop_last else -(-length // world_size)


def shard_indices(
    length: int,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> list[int]:
    """The dataset indices `rank` trains on this epoch, as DistributedSampler gives (chapter 1)."""
    _check_shard_args(length, rank, world_size)
    # 1. Every rank computes the SAME global order: the generator is seeded identically on all of
    #    them (seed + epoch), so no communication is needed to agree on the shuffle.
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(length, generator=g).tolist()
    else:
        order = list(range(length))
    # 2. Make the length divisible by world_size, so every rank runs the same number of steps
    #    (a rank with fewer batches would hang the others at the next all-reduce).
    total = _per_rank(length, world_size, drop_last) * world_size
    if drop_last:
        order = order[:total]  # drop the tail
    else:
        order = [order[i % length] for i in range(total)]  # pad by wrapping around to the start
    # 3. Strided split: rank r takes positions r, r + W, r + 2W, ... So the t-th local batches of
    #    all ranks together hold one contiguous run of the global order, whatever W is: the
    #    global batch is the same at every world size, which is what lets us compare them.
    return order[rank::world_size]


class ShardSampler(Sampler[int]):
    """A DataLoader sampler over `shard_indices`: call set_epoch(e) each epoch for a new shuffle."""

    def __init__(
        self,
        length: int,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialised else 1
        _check_shard_args(length, rank, world_size)
        self.length, self.rank, self.world_size = length, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Pick the epoch whose shuffle the next pass uses (as DistributedSampler.set_epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        where = (self.length, self.rank, self.world_size)
        how = dict(shuffle=self.shuffle, seed=self.seed, epoch=self.epoch, drop_last=self.drop_last)
        return iter(shard_indices(*where, **how))

    def __len__(self) -> int:
        return _per_rank(self.length, self.world_size, self.drop_last)
