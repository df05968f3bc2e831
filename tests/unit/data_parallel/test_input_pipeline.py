"""The chapter 1 input pipeline: a real image-folder tree, decoding, augmentation, throughput."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dmlbook.data_parallel import input_pipeline as ip
from dmlbook.models import mlp


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 17, size=(12, 8, 8)).astype(np.uint8)  # digits-like: 0..16
    labels = np.arange(12) % 3
    root = ip.export_png_folder(images, labels, tmp_path_factory.mktemp("png"), 16, size=16)
    return root, images, labels


def test_export_writes_an_image_folder_tree(folder):
    root, images, labels = folder
    files = sorted(root.glob("*/*.png"))
    assert len(files) == len(images)
    assert sorted({f.parent.name for f in files}) == ["0", "1", "2"]
    plain = ip.PngFolder(root, augment=False)
    assert sorted(plain.labels) == sorted(labels.tolist())
    x, label = plain[0]
    assert x.shape == (1, 16, 16) and x.dtype == torch.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert x.max() > 0.5  # 16 of 16 is full scale before the resize blurs it


def test_export_scales_by_max_value(tmp_path):
    image = np.array([[[0, 8], [16, 16]]], dtype=np.uint8)
    ip.export_png_folder(image, [0], tmp_path, max_value=16, size=2)
    x, _ = ip.PngFolder(tmp_path, augment=False)[0]
    torch.testing.assert_close(x[0], torch.tensor([[0.0, 128 / 255], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="max_value"):
        ip.export_png_folder(image, [0], tmp_path, max_value=0)


def test_augmentation_is_seeded_and_changes_pixels(folder):
    root, _, _ = folder
    a, b = ip.PngFolder(root, seed=1), ip.PngFolder(root, seed=1)
    torch.testing.assert_close(a[3][0], b[3][0])  # same seed, same sample: same augmentation
    assert not torch.equal(a[3][0], ip.PngFolder(root, seed=2)[3][0])
    assert not torch.equal(a[3][0], ip.PngFolder(root, augment=False)[3][0])
    before = a[3][0]
    a.set_epoch(1)  # a new epoch draws a new augmentation of the same sample
    assert not torch.equal(a[3][0], before)


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="png"):
        ip.PngFolder(tmp_path)


def test_throughputs_count_every_sample(folder):
    root, _, _ = folder
    loader = DataLoader(ip.PngFolder(root), batch_size=4)
    loading = ip.loading_throughput(loader)
    assert loading.samples == 12 and loading.bytes_per_sample == 16 * 16 * 4
    assert loading.mb_per_s == pytest.approx(loading.samples_per_s * 1024 / 1e6)
    fed = ip.fed_training_throughput(mlp(seed=0, in_features=256), loader, max_batches=2)
    assert fed.samples == 8
    x, y = torch.randn(40, 1, 16, 16), torch.randint(0, 3, (40,))
    train = ip.training_throughput(mlp(seed=0, in_features=256), x, y, batch_size=8, steps=7)
    assert train.samples == 56 and train.seconds > 0


def test_throughputs_count_this_process_cpu_time(folder):
    root, _, _ = folder
    loader = DataLoader(ip.PngFolder(root), batch_size=4)
    fed = ip.fed_training_throughput(mlp(seed=0, in_features=256), loader)
    assert fed.cpu_seconds > 0 and fed.cpu_ms_per_sample == 1e3 * fed.cpu_seconds / fed.samples


def test_measure_pipeline_keeps_a_median_of_each_quantity(folder):
    root, _, _ = folder
    loader = DataLoader(ip.PngFolder(root), batch_size=4)
    x, y = torch.randn(64, 1, 16, 16), torch.randint(0, 3, (64,))
    candidates = {"mlp": (mlp(seed=0, in_features=256), 2, 2)}
    m = ip.measure_pipeline(loader, loader, candidates, x, y, rounds=3, loading_batches=2)
    assert m.loading.samples == 8
    assert set(m.training) == set(m.in_turn) == set(m.overlapped) == {"mlp"}
    assert m.in_turn["mlp"].samples == 8 and m.training["mlp"].samples == 2 * 64


def test_jpeg_decode_is_timed_on_a_photo_sized_file():
    seconds, nbytes = ip.jpeg_decode_seconds(repeats=3)
    assert seconds > 0 and 50_000 < nbytes < 250_000
