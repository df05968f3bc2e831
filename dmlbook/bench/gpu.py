"""The GPU check: everything a session with one borrowed GPU should run, in one command.

    make gpu-check        # = python -m dmlbook.bench gpu-check

runs, in this order, and prints one table at the end:

1. every ``gpu``-marked test (``pytest -m gpu tests``);
2. one chapter on the GPU under nbval: chapter 8, whose offload section streams a model's layers
   to ``cuda`` when a GPU is present (the CPU path otherwise);
3. the GPU benchmarks of :func:`bench_gpu`: a bf16 GEMM's TFLOP/s as a share of the card's dense
   bf16 peak (chapter 5's hardware table, :data:`dmlbook.model_parallel.memory.GPUS`), and
   chapter 5's memory estimator against the CUDA caching allocator's own count.

NCCL needs one GPU per rank, so with one GPU the multi-rank paths run on gloo: what one GPU can
check is the single-device code and the device placement. The whole check is sized to finish in
well under 8 minutes on an H100, so that a session with about 15 minutes of device time spends one
call on it. Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from dmlbook.model_parallel.memory.spec import PRECISIONS

CHAPTER = "08_throughput_and_latency.ipynb"  # the chapter with a CUDA path of its own
GEMM_SIZE = 8192  # large enough to keep a Hopper's Tensor Cores busy


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU whose name torch reports, from chapter 5's table."""
    from dmlbook.model_parallel.memory import GPUS

    words = re.split(r"[^A-Za-z0-9]+", device_name)  # "NVIDIA A100-SXM4-80GB", "NVIDIA H200"
    matches = [gpu for gpu in GPUS if gpu.name.split()[0] in words]
    return max((g.bf16_tflops for g in matches if g.bf16_tflops), default=None)


def gemm_tflops(n: int = GEMM_SIZE, repeats: int = 50) -> float:
    """TFLOP/s of ``n x n @ n x n`` in bf16 on the current GPU (2 n^3 flops each), timed with
    CUDA events after a warm-up, so that cuBLAS's choice of kernel is not in the time."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    return 2 * n**3 / seconds / 1e12


def estimator_vs_allocator(precision: str) -> dict[str, float]:
    """Chapter 5's estimate over what a real step on the GPU held, per component (1.0 = exact)."""
    from dmlbook.model_parallel import memory
    from dmlbook.models import char_gpt

    model = char_gpt(96, seed=0, n_layer=4, n_embd=256, n_head=8, block_size=256)
    got = memory.measure(model, 16, 256, precision=precision, device="cuda")
    est = memory.estimate(memory.spec_of(model), 16, 256, precision=precision, device="cuda")
    predicted, measured = est.components(), got.components()
    ratios = {k: predicted[k] / measured[k] for k in predicted if measured.get(k)}
    ratios["total"] = est.total / got.total
    return ratios


def bench_gpu() -> list[dict]:
    """The GPU benchmarks, printed as they run; returns one record each."""
    name = torch.cuda.get_device_name()
    peak = peak_bf16_tflops(name)
    achieved = gemm_tflops()
    share = f"{achieved / peak:.0%} of {peak:.0f}" if peak else "peak unknown for this card"
    print(f"bf16 GEMM {GEMM_SIZE}^3 on {name}: {achieved:.0f} TFLOP/s ({share})")
    records = [{"bench": "gemm", "device": name, "tflops": achieved, "peak_tflops": peak}]
    for precision in PRECISIONS:
        ratios = estimator_vs_allocator(precision)
        shown = ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        print(f"memory estimate / CUDA allocator, {precision}: {shown}")
        records.append({"bench": "memory", "precision": precision, **ratios})
    return records


def _pytest(args: list[str], junit: Path, timeout: float) -> tuple[str, bool, float]:
    """Run pytest in a child: its verdict ("N passed, M failed, K skipped"), whether nothing
    failed, and the seconds it took."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}", *args]
    try:
        subprocess.run(command, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s", False, time.perf_counter() - started
    if not junit.exists():
        return "no report (pytest did not start)", False, time.perf_counter() - started
    suite = ElementTree.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total, failed, errors, skipped = (
        int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")
    )
    passed, failed = total - failed - errors - skipped, failed + errors
    verdict = f"{passed} passed, {failed} failed, {skipped} skipped"
    return verdict, failed == 0 and passed > 0, time.perf_counter() - started


def gpu_check(out: Path = Path("build/gpu-check")) -> int:
    """Steps 1-3 above; the table at the end. Returns the exit status (0: nothing failed)."""
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; run it on a machine with a GPU.")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MPLBACKEND", "Agg")
    root = Path(__file__).resolve().parents[2]
    rows = []  # (step, result, ok, seconds or None)
    tests = ["-m", "gpu", str(root / "tests")]
    rows.append(("gpu-marked tests", *_pytest(tests, out / "gpu-tests.xml", 300)))
    chapter = [str(root / "chapters" / CHAPTER), "--nbval-lax", "--nbval-current-env"]
    rows.append((f"chapter {CHAPTER[:2]} under nbval", *_pytest(chapter, out / "chapter.xml", 180)))
    started = time.perf_counter()
    try:
        records = bench_gpu()
    except Exception as error:  # noqa: BLE001 (the table says what broke)
        rows.append(("GPU benchmarks", f"{type(error).__name__}: {error}", False, None))
    else:
        gemm = records[0]
        share = (
            f" = {gemm['tflops'] / gemm['peak_tflops']:.0%} of peak" if gemm["peak_tflops"] else ""
        )
        rows.append(("bf16 GEMM", f"{gemm['tflops']:.0f} TFLOP/s{share}", True, None))
        for record in records[1:]:
            step = f"memory estimate/allocator, {record['precision']}"
            rows.append((step, f"total {record['total']:.3f}", True, None))
    rows[-1] = (*rows[-1][:3], time.perf_counter() - started)
    print(f"\ngpu-check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for step, result, ok, took in rows:
        seconds = "" if took is None else f"{took:6.1f} s"
        print(f"  {'ok  ' if ok else 'FAIL'} {step:38s} {result:44s} {seconds}")
    return 0 if all(ok for _, _, ok, _ in rows) else 1
