"""Checkers for the exercises of chapter 9b ("Beyond the book: ZeRO and FSDP").

1. ``check_bytes_per_rank``: write ``bytes_per_rank(psi, world_size, stage)``, the bytes of model
   states (parameters, gradients, Adam's two moments) one rank holds for ``psi`` fp32 parameters
   at ZeRO stage 0 (plain data parallelism), 1, 2 or 3: the paper's formulas with 4 + 4 + 8 bytes
   per parameter, no padding; raise ValueError for any other stage.
2. ``check_shard_range``: write ``shard_range(numel, world_size, rank) -> (start, stop)``, the
   elements of a flat buffer that ``rank`` owns when the buffer is padded up to a multiple of
   ``world_size`` and cut into equal shards.
3. ``check_comm_bytes``: write ``comm_bytes(psi, world_size, stage)``, the bytes one rank sends per
   step over ring collectives for ``psi`` fp32 parameters: an all-reduce moves 2(N-1)/N of the
   tensor, a reduce-scatter or an all-gather (N-1)/N.
"""

from __future__ import annotations

from collections.abc import Callable

from dmlbook.advanced import zero
from dmlbook.comm.groups import padded_block
from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code

__all__ = ["check_bytes_per_rank", "check_comm_bytes", "check_shard_range"]

FP32 = 4


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def _expects_valueerror(fn: Callable, args: tuple, why: str) -> None:
    expect_value_error(f"{fn.__name__}{args}", lambda: fn(*args), why)


# --------------------------------------------------------------------------- 1. bytes per rank


def _bytes(psi: int, n: int, stage: int, params=4, grads=4, k=8) -> float:
    return sum(zero.paper_bytes(psi, n, stage, k=k, param_bytes=params, grad_bytes=grads).values())


_CASES = [(10**9, 64, 0), (10**9, 64, 1), (10**9, 64, 2), (10**9, 64, 3), (7_500_000, 8, 2),
          (1000, 3, 1), (1000, 3, 3), (153, 1, 3), (153, 4, 2), (12_345, 5, 1)]  # fmt: skip


@checker("bytes_per_rank")
def check_bytes_per_rank(fn: Callable[[int, int, int], float]) -> str:
    """Check ``fn(psi, world_size, stage)`` is the bytes of fp32 Adam model states per rank:
    16 psi; 8 psi + 8 psi/N; 4 psi + 12 psi/N; 16 psi/N for stages 0-3; ValueError otherwise."""
    for psi, n, stage in _CASES:
        call = f"your bytes_per_rank(psi={psi}, world_size={n}, stage={stage})"
        with learner_code(call):
            got = float(fn(psi, n, stage))
        want = _bytes(psi, n, stage)
        if _close(got, want):
            continue
        wrong = {
            "the mixed-precision figure (2 + 2 + 12 bytes per parameter); here everything is "
            "fp32 Adam: 4 (parameter) + 4 (gradient) + 8 (two moments)": _bytes(
                psi, n, stage, 2, 2, 12
            ),
            "Adam with one moment (K = 4); Adam keeps two, the mean and the mean square": _bytes(
                psi, n, stage, k=4
            ),
            "the next stage's figure: stage 1 shards only the optimizer state, stage 2 adds the "
            "gradients, stage 3 the parameters": _bytes(psi, n, min(stage + 1, 3)),
            "the previous stage's figure: stage 1 shards the optimizer state, stage 2 adds the "
            "gradients, stage 3 the parameters": _bytes(psi, n, max(stage - 1, 0)),
            "the whole model's bytes divided by N, which only stage 3 reaches": 16 * psi / n,
        }
        hint = next(
            (f": that is {why}" for why, value in wrong.items() if _close(got, value)),
            ". Add up parameters (4 psi), gradients (4 psi) and Adam's moments (8 psi), dividing "
            "by N what the stage shards",
        )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g}{hint}")
    for stage in (4, -1):
        _expects_valueerror(fn, (1000, 4, stage), f"ZeRO has stages 0-3, not {stage}")
    return f"right for {len(_CASES)} models, world sizes and stages, and ValueError for stage 4"


# --------------------------------------------------------------------------- 2. shard range


@checker("shard_range")
def check_shard_range(fn: Callable[[int, int, int], tuple[int, int]]) -> str:
    """Check ``fn(numel, world_size, rank)`` gives rank's ``(start, stop)``: equal shards of
    ceil(numel / N) elements, the last ones running into the padding."""
    cases = [(80, 4), (55, 3), (55, 4), (18, 4), (5, 8), (1, 2), (12, 3), (153, 1)]
    for numel, n in cases:
        call = f"your shard_range({numel}, world_size={n}, rank=...)"
        with learner_code(call):
            got = [tuple(int(v) for v in fn(numel, n, r)) for r in range(n)]
        want = [padded_block(numel, rank=r, world_size=n) for r in range(n)]
        if got == want:
            continue
        sizes = {b - a for a, b in got}
        if got[-1][1] < numel:
            hint = (
                f": the shards end at {got[-1][1]}, so elements {got[-1][1]}..{numel - 1} belong "
                "to no rank. Round the shard size up (ceil), and pad"
            )
        elif len(sizes) > 1:
            hint = (
                f": the shards have sizes {sorted(sizes)}. Collectives such as reduce_scatter "
                "need equal shards: pad the buffer up to a multiple of world_size instead"
            )
        elif numel % n == 0 and sizes == {numel // n + 1}:
            hint = (
                f": shards of {numel // n + 1} are one too many when {numel} divides by {n}. "
                "numel // world_size + 1 is not the ceiling; -(-numel // world_size) is"
            )
        elif got[0][0] != 0:
            hint = (
                f": rank 0's shard starts at {got[0][0]}; the buffer starts at 0, so rank r owns "
                "[r * S, (r + 1) * S), an off-by-one?"
            )
        else:
            hint = ". Rank r owns [r * S, (r + 1) * S) with S = ceil(numel / world_size)"
        raise ExerciseFailed(f"{call} gave {got} for ranks 0..{n - 1}, expected {want}{hint}")
    return f"right for {len(cases)} buffer sizes and world sizes, padded ones included"


# --------------------------------------------------------------------------- 3. comm bytes


@checker("comm_bytes")
def check_comm_bytes(fn: Callable[[int, int, int], float]) -> str:
    """Check ``fn(psi, world_size, stage)`` = 2(N-1)/N * 4 psi for stages 0-2 and 3(N-1)/N * 4 psi
    for stage 3 (two all-gathers and a reduce-scatter)."""
    for psi, n, stage in _CASES:
        call = f"your comm_bytes(psi={psi}, world_size={n}, stage={stage})"
        with learner_code(call):
            got = float(fn(psi, n, stage))
        want = zero.comm_bytes_per_step(psi, n, stage, FP32)
        if _close(got, want):
            continue
        ring = (n - 1) / n
        wrong = {
            "two passes for stage 3 too: stage 3 gathers each layer twice, before its forward "
            "and again before its backward, and reduce-scatters once": 2 * ring * 4 * psi,
            "without the ring's (N-1)/N: each rank sends N-1 of the N chunks": (
                (3 if stage == 3 else 2) * 4 * psi
            ),
            "one pass too few: stages 1 and 2 reduce-scatter the gradients AND all-gather the "
            "parameters, as much as an all-reduce": (2 if stage == 3 else 1) * ring * 4 * psi,
            "in elements, not bytes (fp32: 4 bytes each)": (3 if stage == 3 else 2) * ring * psi,
        }
        hint = next(
            (f": that is {why}" for why, value in wrong.items() if value and _close(got, value)),
            ". A ring all-reduce sends 2(N-1)/N of the tensor; reduce-scatter and all-gather "
            "(N-1)/N each",
        )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g}{hint}")
    return f"right for {len(_CASES)} models, world sizes and stages"
