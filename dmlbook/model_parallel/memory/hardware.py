"""The chapter's hardware table: GPUs, their memory and links (chapter 5)."""

from __future__ import annotations

from dataclasses import dataclass

# ---- Hardware -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    """A data-center GPU's headline figures (SXM form factor), from NVIDIA's own documents."""

    name: str
    year: int
    memory_gb: float  # HBM capacity, GB (the larger variant where two exist is listed separately)
    hbm_gb_per_s: float  # memory bandwidth
    fp16_tflops: float  # dense FP16 matmul: Tensor Cores from Volta on, plain FP16 units on Pascal
    bf16_tflops: float | None  # dense BF16 Tensor Core matmul (None: no bf16 support)
    nvlink_gb_per_s: float  # total NVLink bandwidth per GPU, both directions
    nvlink_links: int
    source: str


GPUS = (
    GPU("P100", 2016, 16, 732, 21.2, None, 160, 4,
        "NVIDIA Tesla P100 whitepaper (Pascal GP100) and P100 datasheet; no Tensor Cores"),
    GPU("V100", 2017, 16, 900, 125, None, 300, 6,
        "NVIDIA Tesla V100 GPU Architecture whitepaper (2017) and V100 datasheet; also 32 GB"),
    GPU("A100", 2020, 40, 1555, 312, 312, 600, 12,
        "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020) and A100 datasheet"),
    GPU("A100 80GB", 2020, 80, 2039, 312, 312, 600, 12,
        "NVIDIA A100 80GB datasheet"),
    GPU("H100", 2022, 80, 3350, 989, 989, 900, 18,
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) and H100 SXM datasheet"),
    GPU("H200", 2024, 141, 4800, 989, 989, 900, 18,
        "NVIDIA H200 Tensor Core GPU datasheet (2024): the H100's compute with HBM3e"),
)  # fmt: skip

# DGX-1 (P100, 2016) "hybrid cube-mesh": two fully connected quads of 4 GPUs, and each GPU linked
# to its partner in the other quad, using all 4 NVLinks of every P100 (NVIDIA DGX-1 System
# Architecture whitepaper). The V100 DGX-1 keeps this layout and doubles some links with its 6.
DGX1_NVLINK = tuple(
    (i, j) for i in range(8) for j in range(i + 1, 8) if i // 4 == j // 4 or j == i + 4
)
