"""What a GPU's kernels take from the allocator beyond their outputs (chapter 5's estimate on CUDA).

CUDA's reduction kernel stages a long sum's partial results in a global buffer from the caching
allocator; in a Linear's backward the bias gradient is such a sum, and on an H200 its buffer set
the step's peak (32 MiB for 4096 x 1024 in bf16). Its size follows the kernel's launch plan for
the GPU at hand, so it is measured, not derived: once per shape, on that GPU.
"""

from __future__ import annotations

import functools


def reduction_scratch_bytes(rows: int, cols: int, element_bytes: int, device: str) -> int:
    """Scratch bytes that summing a ``(rows, cols)`` gradient over its rows takes from the
    allocator: a bias's gradient in a Linear's backward. CUDA's reduction kernel splits a long
    sum over many thread blocks and stages their partial sums in a global buffer whose size
    depends on the kernel's launch plan for this GPU (32 MiB for 4096 x 1024 in bf16 on an
    H200), so it is measured here, once per shape, on the GPU at hand. The CPU sums in place: 0.
    """
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return 0
    return _cuda_reduction_scratch(rows, cols, element_bytes)


@functools.cache
def _cuda_reduction_scratch(rows: int, cols: int, element_bytes: int) -> int:
    import torch

    from dmlbook.model_parallel.recompute import cuda_peak_bytes

    dtype = {2: torch.bfloat16, 4: torch.float32}[element_bytes]
    # A gradient over PROBE_BYTES is probed by its first rows, so that estimating a large model
    # takes no large allocation. That assumes the launch plan is as wide as the GPU allows by then:
    # an assumption, since gpu-check measures only the 4096 x 1024 case in full.
    rows = max(1, min(rows, PROBE_BYTES // (cols * element_bytes)))
    gradient = torch.empty(rows, cols, dtype=dtype, device="cuda")
    return max(0, cuda_peak_bytes(lambda: gradient.sum(0)) - cols * element_bytes)


PROBE_BYTES = 256 * 2**20
