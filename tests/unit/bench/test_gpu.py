"""The GPU check (:mod:`dmlbook.bench.gpu`): what runs here without a GPU, and on one with."""

from __future__ import annotations

import pytest
import torch

from dmlbook.bench import gpu


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),  # torch's spelling glues the form factor on
        ("NVIDIA A100 80GB PCIe", 312),
        ("Tesla V100-SXM2-16GB", None),  # no bf16 at all
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_peak_comes_from_chapter_5s_table(name, peak):
    assert gpu.peak_bf16_tflops(name) == peak


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_gpu_check_without_a_gpu_says_so_and_fails(capsys, tmp_path):
    assert gpu.gpu_check(tmp_path) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_a_pytest_step_reports_its_counts(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip\n"
        "def test_skipped(): pass\n"
    )
    verdict, ok, seconds = gpu._pytest([str(tmp_path / "test_two.py")], tmp_path / "r.xml", 60)
    assert (verdict, ok) == ("1 passed, 1 failed, 1 skipped", False)
    assert seconds > 0


@pytest.mark.gpu
def test_the_gpu_benchmarks_run_and_the_estimate_holds():
    records = gpu.bench_gpu()
    assert records[0]["tflops"] > 0
    for record in records[1:]:
        assert abs(record["total"] - 1) <= 0.10, record  # test_memory's tolerance
