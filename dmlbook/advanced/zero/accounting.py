"""What each ZeRO stage holds and sends, by formula and by measurement (chapter 9b).

:class:`MemoryMeter` records the bytes an engine holds at each point of a step;
:func:`expected_bytes` is the paper's formula with this layout's padding and the unit in flight;
:func:`paper_bytes` is the formula as the paper writes it; :func:`comm_bytes_per_step` the
bytes a rank sends per step over a ring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dmlbook.comm.groups import padded_size

ZERO_STAGES = (0, 1, 2, 3)
COLLECTIVES = ("torch", "dmlbook")
PARTS = ("parameters", "gradients", "optimizer state")

# --------------------------------------------------------------------------- memory


def distinct_storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage behind ``tensors`` (views count once)."""
    found = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


@dataclass
class MemoryMeter:
    """Samples of the bytes a rank holds, per part; ``peak`` is the sample with the largest total.

    Autograd's in-flight temporaries (a gradient between its computation and the hook that takes
    it), activations and the collectives' own scratch buffers are not model states and are not
    counted, as in the paper."""

    samples: list[dict[str, int]] = field(default_factory=list)

    def record(self, where: str, held: dict[str, int]) -> None:
        self.samples.append({"where": where, **held})

    @property
    def peak(self) -> dict[str, int]:
        """The sample with the largest total: {part: bytes, ..., "total": bytes, "where": ...}."""
        if not self.samples:
            raise ValueError("nothing measured yet: run a step first")
        best = max(self.samples, key=lambda s: sum(s[p] for p in PARTS))
        return {**{p: best[p] for p in PARTS}, "total": sum(best[p] for p in PARTS),
                "where": best["where"]}  # fmt: skip

    def reset(self) -> None:
        self.samples.clear()


def paper_bytes(
    psi: int, world_size: int, stage: int, k: int = 12, param_bytes: int = 2, grad_bytes: int = 2
) -> dict[str, float]:
    """The ZeRO paper's model-state bytes per rank: parameters, gradients, optimizer state.

    Mixed-precision Adam (the paper): 2-byte parameters and gradients and K = 12 bytes of fp32
    master copy and moments. Pure fp32 Adam (this package's runs): ``param_bytes=4,
    grad_bytes=4, k=8``. Baseline (2+2+K)Psi; P_os 2Psi + 2Psi + K Psi/N; P_os+g 2Psi + (2+K)Psi/N;
    P_os+g+p (2+2+K)Psi/N."""
    check_stage(stage)
    n = world_size
    return {
        "parameters": param_bytes * psi / (n if stage >= 3 else 1),
        "gradients": grad_bytes * psi / (n if stage >= 2 else 1),
        "optimizer state": k * psi / (n if stage >= 1 else 1),
    }


def expected_bytes(
    unit_sizes: Sequence[int], world_size: int, stage: int, element_size: int = 4
) -> dict[str, int]:
    """What a ZeRO engine (:class:`ZeroStage0` ... :class:`ZeroStage3`) should hold at its peak,
    per part: the paper's formula for Adam (2 moments, so K = 2 x element_size) on the padded
    units, plus the transients of this layout: at stages 2 and 3 the full gradient of one unit
    (the largest) waits for its reduce-scatter, and at stage 3 that unit's parameters are
    gathered at the same time."""
    check_stage(stage)
    padded = [padded_size(n, world_size) for n in unit_sizes]
    full, shard, largest = sum(padded), sum(padded) // world_size, max(padded, default=0)
    params = shard + largest if stage == 3 else full
    grads = full if stage <= 1 else shard + largest
    moments = 2 * (full if stage == 0 else shard)
    return {
        "parameters": params * element_size,
        "gradients": grads * element_size,
        "optimizer state": moments * element_size,
    }


def comm_bytes_per_step(numel: int, world_size: int, stage: int, element_size: int = 4) -> float:
    """Bytes one rank sends per step over a ring: all-reduce 2(N-1)/N Psi for stage 0;
    reduce-scatter + all-gather, the same 2(N-1)/N Psi, for stages 1 and 2; two all-gathers (for
    forward and for backward) and a reduce-scatter, 3(N-1)/N Psi (1.5x), for stage 3."""
    check_stage(stage)
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * numel * element_size


def check_stage(stage) -> None:
    """A ValueError unless ``stage`` is one of :data:`ZERO_STAGES` (0-3)."""
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(
            f"stage must be one of {ZERO_STAGES} (0 = plain data parallelism), got {stage!r}"
        )
