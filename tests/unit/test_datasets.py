"""Tests for dmlbook.datasets: sharding equals DistributedSampler, loaders read the real formats."""

import gzip
import hashlib
import io
import os
import pickle
import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from dmlbook import datasets as ds

# ---------------------------------------------------------------------------------------------
# shard_indices / ShardSampler vs torch's DistributedSampler
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 5, 7, 10, 17, 100])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_shard_indices_equals_distributed_sampler(length, world_size):
    for shuffle in (True, False):
        for drop_last in (True, False):
            for epoch in (0, 3):
                for rank in range(world_size):
                    ref = DistributedSampler(
                        range(length),
                        num_replicas=world_size,
                        rank=rank,
                        shuffle=shuffle,
                        seed=7,
                        drop_last=drop_last,
                    )
                    ref.set_epoch(epoch)
                    got = ds.shard_indices(
                        length, rank, world_size, shuffle, seed=7, epoch=epoch, drop_last=drop_last
                    )
                    assert got == list(ref), (shuffle, drop_last, epoch, rank)
                    assert len(got) == len(ref)


def test_shard_indices_partition_and_padding():
    # Without drop_last every index is seen, and the padding repeats the first ones.
    shards = [ds.shard_indices(10, r, 4, shuffle=False) for r in range(4)]
    assert sorted(i for s in shards for i in s) == sorted(list(range(10)) + [0, 1])
    # With drop_last the ranks' shards are disjoint and the tail is dropped.
    shards = [ds.shard_indices(10, r, 4, shuffle=False, drop_last=True) for r in range(4)]
    assert sorted(i for s in shards for i in s) == list(range(8))
    # A new epoch reshuffles; the same epoch does not.
    assert ds.shard_indices(50, 0, 2, epoch=1) != ds.shard_indices(50, 0, 2, epoch=2)
    assert ds.shard_indices(50, 0, 2, epoch=1) == ds.shard_indices(50, 0, 2, epoch=1)


def test_strided_split_gives_the_same_global_batch_at_every_world_size():
    global_batch = 12
    expected = None
    for world_size in (1, 2, 3, 4, 6):
        local = global_batch // world_size
        shards = [ds.shard_indices(48, r, world_size, seed=3) for r in range(world_size)]
        batches = [
            sorted(i for s in shards for i in s[t * local : (t + 1) * local]) for t in range(4)
        ]
        expected = expected or batches
        assert batches == expected, world_size


def test_shard_sampler_matches_distributed_sampler_across_epochs():
    sampler = ds.ShardSampler(23, rank=2, world_size=3, seed=5)
    ref = DistributedSampler(range(23), num_replicas=3, rank=2, seed=5)
    seen = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        ref.set_epoch(epoch)
        assert list(sampler) == list(ref)
        assert len(sampler) == len(ref) == 8
        seen.append(list(sampler))
    assert seen[0] != seen[1]
    dropped = ds.ShardSampler(23, rank=1, world_size=3, drop_last=True)
    assert len(dropped) == len(list(dropped)) == 7
    # Works as a DataLoader sampler.
    loader = DataLoader(list(range(100, 123)), batch_size=4, sampler=sampler)
    assert torch.cat(list(loader)).tolist() == [100 + i for i in seen[2]]


def test_shard_sampler_defaults_to_single_process():
    sampler = ds.ShardSampler(9, shuffle=False)
    assert (sampler.rank, sampler.world_size) == (0, 1)
    assert list(sampler) == list(range(9))


@pytest.mark.parametrize(
    "length, rank, world_size, match",
    [(10, 0, 0, "world_size"), (10, 2, 2, "rank"), (10, -1, 2, "rank"), (-1, 0, 1, "length")],
)
def test_shard_bad_arguments(length, rank, world_size, match):
    with pytest.raises(ValueError, match=match):
        ds.shard_indices(length, rank, world_size)
    with pytest.raises(ValueError, match=match):
        ds.ShardSampler(length, rank=rank, world_size=world_size)


# ---------------------------------------------------------------------------------------------
# IDX files and MNIST
# ---------------------------------------------------------------------------------------------


def write_idx(path: Path, array: np.ndarray, type_byte: int = 0x08) -> Path:
    """Write `array` in the IDX format (big-endian), gzipped if the name ends in .gz."""
    big_endian = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    header = bytes([0, 0, type_byte, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(big_endian[type_byte]).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return path


@pytest.mark.parametrize(
    "type_byte, values",
    [
        (0x08, [0, 7, 255]),
        (0x09, [-128, 0, 127]),
        (0x0B, [-300, 2, 30000]),
        (0x0C, [-(2**31), 1, 2**31 - 1]),
        (0x0D, [-1.5, 0.25, 3e38]),
        (0x0E, [-1e300, 0.1, 2.0]),
    ],
)
@pytest.mark.parametrize("name", ["x-idx2", "x-idx2.gz"])
def test_read_idx_round_trip(tmp_path, type_byte, values, name):
    array = np.array([values, values[::-1]])  # (2, 3)
    got = ds.read_idx(write_idx(tmp_path / name, array, type_byte))
    assert got.shape == (2, 3)
    assert got.dtype.isnative and got.flags.writeable
    np.testing.assert_array_equal(got, array.astype(got.dtype))


def test_read_idx_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad-magic"
    bad.write_bytes(b"\x01\x00\x08\x01" + struct.pack(">I", 2) + b"\x00\x00")
    with pytest.raises(ValueError, match="bad-magic.*not an IDX"):
        ds.read_idx(bad)
    short = write_idx(tmp_path / "short", np.zeros((4, 5), np.uint8))
    short.write_bytes(short.read_bytes()[:-3])
    with pytest.raises(ValueError, match="short.*expected 20 data bytes, found 17"):
        ds.read_idx(short)
    header_only = tmp_path / "header"
    header_only.write_bytes(b"\x00\x00\x08\x03\x00\x00")
    with pytest.raises(ValueError, match="truncated"):
        ds.read_idx(header_only)
    corrupt = tmp_path / "corrupt.gz"
    corrupt.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x05abcde")[:-6])
    with pytest.raises(ValueError, match="corrupt.gz"):
        ds.read_idx(corrupt)


def fake_mnist(folder: Path, prefix: str, count: int, gz: bool = False) -> np.ndarray:
    """Write count 28x28 images whose pixels encode their index, and labels i % 10."""
    images = (np.arange(count)[:, None, None] * 10 + np.zeros((1, 28, 28), int)).astype(np.uint8)
    images[:, 3, 4] = 255
    suffix = ".gz" if gz else ""
    write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images)
    write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(count) % 10)
    return images


def test_load_mnist_from_root_plain_and_gz(tmp_path):
    images = fake_mnist(tmp_path / "mnist", "train", 12)
    fake_mnist(tmp_path / "MNIST" / "raw", "t10k", 3, gz=True)
    x, y = ds.load_mnist(train=True, root=tmp_path)
    assert x.shape == (12, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [i % 10 for i in range(12)]
    assert x.min() == 0.0 and x.max() == 1.0
    torch.testing.assert_close(x[:, 0], torch.from_numpy(images).float() / 255)
    x_test, y_test = ds.load_mnist(train=False, root=tmp_path)
    assert x_test.shape == (3, 1, 28, 28) and y_test.tolist() == [0, 1, 2]


def test_load_mnist_via_env_var(tmp_path, monkeypatch):
    fake_mnist(tmp_path, "train", 5, gz=True)
    monkeypatch.setenv("DMLBOOK_DATA", str(tmp_path))
    assert ds.data_roots() == [tmp_path, ds.DATA_DIR]
    x, y = ds.load_mnist()
    assert x.shape == (5, 1, 28, 28) and y.tolist() == [0, 1, 2, 3, 4]
    monkeypatch.delenv("DMLBOOK_DATA")
    assert ds.data_roots() == [ds.DATA_DIR]


def test_load_mnist_missing_names_places_and_says_no_download(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        ds.load_mnist(train=False, root=tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and str(tmp_path / "mnist") in message
    assert "t10k-images-idx3-ubyte" in message and "Nothing is downloaded" in message
    assert "DMLBOOK_DATA" in message


def test_load_mnist_mismatched_counts(tmp_path):
    fake_mnist(tmp_path, "train", 4)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        ds.load_mnist(root=tmp_path)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 python batches
# ---------------------------------------------------------------------------------------------


class Py2StylePickler(pickle._Pickler):
    """Writes str and bytes as Python 2 wrote str (BINSTRING), like the original CIFAR files."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_binstring(self, obj):
        raw = obj.encode("latin-1") if isinstance(obj, str) else obj
        self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = _save_binstring
    dispatch[bytes] = _save_binstring


def dump_py2_style(obj) -> bytes:
    buf = io.BytesIO()
    Py2StylePickler(buf, protocol=2).dump(obj)
    # Files written before numpy 2 name the array rebuilder by its old module.
    return buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def fake_cifar(folder: Path, dump) -> dict:
    """Write 5 train batches of 2 images and a test batch of 3; pixel values encode the image."""
    folder.mkdir(parents=True, exist_ok=True)
    written, start = {}, 0
    for name, count in [(f"data_batch_{i}", 2) for i in range(1, 6)] + [("test_batch", 3)]:
        ids = np.arange(start, start + count)
        data = (ids[:, None] + np.arange(3072)[None, :] // 1024 * 50).astype(np.uint8)
        batch = {
            b"batch_label": name.encode(),
            b"labels": [int(i % 10) for i in ids],
            b"data": data,
            b"filenames": [f"img_{i}.png".encode() for i in ids],
        }
        (folder / name).write_bytes(dump(batch))
        written[name], start = batch, start + count
    return written


@pytest.mark.parametrize(
    "dump", [lambda obj: pickle.dumps(obj, protocol=2), dump_py2_style], ids=["py3", "py2"]
)
def test_load_cifar10(tmp_path, dump):
    written = fake_cifar(tmp_path / "cifar-10-batches-py", dump)
    x, y = ds.load_cifar10(train=True, root=tmp_path)
    assert x.shape == (10, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == list(range(10))  # batch 1 first, then 2, ...
    # Row layout is 1024 red, 1024 green, 1024 blue values; channel c of image i is i + 50 c.
    assert x[7, :, 5, 9].mul(255).round().tolist() == [7.0, 57.0, 107.0]
    expected = np.concatenate([written[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    torch.testing.assert_close(x.reshape(10, -1), torch.from_numpy(expected).float() / 255)
    x_test, y_test = ds.load_cifar10(train=False, root=tmp_path / "cifar-10-batches-py")
    assert x_test.shape == (3, 3, 32, 32) and y_test.tolist() == [0, 1, 2]


def test_load_cifar10_via_env_var_and_missing(tmp_path, monkeypatch):
    fake_cifar(tmp_path / "cifar-10-batches-py", lambda obj: pickle.dumps(obj, protocol=2))
    monkeypatch.setenv("DMLBOOK_DATA", str(tmp_path))
    assert ds.load_cifar10(train=False)[1].tolist() == [0, 1, 2]
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4") as err:
        ds.load_cifar10(root=tmp_path)
    assert str(tmp_path / "cifar-10-batches-py") in str(err.value)
    assert "Nothing is downloaded" in str(err.value)


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_load_cifar10_refuses_malicious_pickle(tmp_path):
    written = fake_cifar(tmp_path, lambda obj: pickle.dumps(obj, protocol=2))
    marker = tmp_path / "pwned"
    batch = {**written["test_batch"], b"batch_label": Evil(marker)}
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        ds.load_cifar10(train=False, root=tmp_path)
    assert not marker.exists()
    pickle.loads((tmp_path / "test_batch").read_bytes())  # the plain unpickler would run it
    assert marker.exists()


# ---------------------------------------------------------------------------------------------
# Shipped digits
# ---------------------------------------------------------------------------------------------


def test_digits_file_matches_recorded_sha256():
    readme = (ds.DATA_DIR / "README.md").read_text()
    recorded = re.search(r"sha256 \| `([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256((ds.DATA_DIR / "digits.npz").read_bytes()).hexdigest() == recorded


def test_load_digits_shapes_and_values():
    x, y = ds.load_digits("all")
    assert x.shape == (1797, 64) and x.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert x.min() == 0.0 and x.max() == 1.0
    assert (x * 16 == (x * 16).round()).all()  # exactly the 0..16 counts, rescaled
    assert (
        sorted(Counter(y.tolist())) == list(range(10)) and min(Counter(y.tolist()).values()) > 170
    )


def test_load_digits_split_is_disjoint_covering_and_deterministic():
    def rows(x, y):
        return Counter(zip(map(tuple, x.tolist()), y.tolist(), strict=True))

    train, test = ds.load_digits("train"), ds.load_digits("test")
    assert len(train[1]) == 1438 and len(test[1]) == 359
    assert rows(*train) + rows(*test) == rows(*ds.load_digits("all"))
    again = ds.load_digits("train")
    assert torch.equal(train[0], again[0]) and torch.equal(train[1], again[1])
    assert not torch.equal(train[1], ds.load_digits("train", seed=1)[1])
    assert len(ds.load_digits("test", test_fraction=0.5)[1]) == 898  # round(898.5), even
    with pytest.raises(ValueError, match="split"):
        ds.load_digits("validation")


# ---------------------------------------------------------------------------------------------
# Characters
# ---------------------------------------------------------------------------------------------


def test_char_corpus():
    text = ds.char_corpus()
    assert len(text) > 300_000
    assert 'The "assert" statement' in text or "The assert statement" in text
    assert text == ds.char_corpus()


def test_char_vocab_round_trip_and_unknown():
    vocab = ds.CharVocab("hello world")
    assert len(vocab) == 8 and vocab.chars[0] == " "
    ids = vocab.encode("hello")
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 2, 4, 4, 5]
    assert vocab.decode(ids) == "hello" and vocab.decode([7, 5]) == "wo"
    with pytest.raises(ValueError, match="','"):
        vocab.encode("hello, wizard")
    with pytest.raises(ValueError, match="outside"):
        vocab.decode([8])
    corpus = ds.char_corpus()[:5000]
    assert ds.CharVocab(corpus).decode(ds.CharVocab(corpus).encode(corpus)) == corpus


def test_char_blocks():
    ids = torch.arange(23)
    x, y = ds.char_blocks(ids, block_size=5)
    assert x.shape == y.shape == (4, 5)
    assert torch.equal(x.flatten(), ids[:20]) and torch.equal(y, x + 1)
    x, y = ds.char_blocks(ids, block_size=5, n=50, seed=1)
    assert x.shape == (50, 5) and torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(50, 4, dtype=torch.long))  # windows
    assert x.min() >= 0 and y.max() <= 22
    assert torch.equal(x, ds.char_blocks(ids, 5, n=50, seed=1)[0])
    assert not torch.equal(x, ds.char_blocks(ids, 5, n=50, seed=2)[0])
    with pytest.raises(ValueError):
        ds.char_blocks(ids[:5], block_size=5)


# ---------------------------------------------------------------------------------------------
# Generated tasks
# ---------------------------------------------------------------------------------------------


def test_make_classification():
    x, y = ds.make_classification(600, dim=10, classes=3, seed=4)
    assert x.shape == (600, 10) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(y.tolist()) == {0, 1, 2}
    x2, y2 = ds.make_classification(600, dim=10, classes=3, seed=4)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, ds.make_classification(600, dim=10, classes=3, seed=5)[0])
    # Learnable: nearest class mean is far above chance.
    means = torch.stack([x[y == c].mean(0) for c in range(3)])
    assert (torch.cdist(x, means).argmin(1) == y).float().mean() > 0.9


def test_make_regression():
    x, y = ds.make_regression(500, dim=8, noise=0.1, seed=2)
    assert x.shape == (500, 8) and y.shape == (500, 1) and y.dtype == torch.float32
    x2, y2 = ds.make_regression(500, dim=8, noise=0.1, seed=2)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(y, ds.make_regression(500, dim=8, noise=0.1, seed=3)[1])
    # A linear model explains y up to the noise level.
    w = torch.linalg.lstsq(x, y).solution
    assert 0.07 < (x @ w - y).std() < 0.13


def test_load_digits_honours_dmlbook_data(tmp_path, monkeypatch):
    """Your digits.npz in $DMLBOOK_DATA comes first; without one, the shipped file is read."""
    images = np.arange(5 * 64, dtype=np.uint8).reshape(5, 8, 8) % 17
    np.savez(tmp_path / "digits.npz", images=images, target=np.arange(5, dtype=np.uint8))
    monkeypatch.setenv("DMLBOOK_DATA", str(tmp_path))
    assert ds.find_data("digits.npz") == tmp_path / "digits.npz"
    x, y = ds.load_digits("all")
    assert y.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(x, torch.from_numpy(images).reshape(5, 64).float() / 16)
    # a $DMLBOOK_DATA without the file falls back to the shipped one
    monkeypatch.setenv("DMLBOOK_DATA", str(tmp_path / "elsewhere"))
    assert ds.find_data("digits.npz") == ds.DATA_DIR / "digits.npz"
    assert len(ds.load_digits("all")[1]) == 1797


def test_missing_shipped_data_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "DATA_DIR", tmp_path / "shipped")
    monkeypatch.setenv("DMLBOOK_DATA", str(tmp_path / "mine"))
    with pytest.raises(FileNotFoundError) as err:
        ds.load_digits()
    message = str(err.value)
    assert str(tmp_path / "shipped") in message and str(tmp_path / "mine") in message
    assert "DMLBOOK_DATA" in message and "Nothing is downloaded" in message
