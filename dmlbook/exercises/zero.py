"""Checkers for the exercises of chapter 9b ("Beyond the book: ZeRO and FSDP").

1. ``check_bytes_per_rank``: write ``bytes_per_rank(psi, world_size, stage, param_bytes,
   grad_bytes, state_bytes)``, the bytes of model states one rank holds for ``psi`` parameters at
   ZeRO stage 0 (plain data parallelism), 1, 2 or 3, no padding; ValueError for any other stage.
   Mixed precision (2, 2, 12) and bf16 parameters with fp32 gradients (2, 4, 12) tell a stage 2
   that shards the parameters from one that shards the gradients.
2. ``check_fsdp_linear``: write ``fsdp_linear(x, weight_shard, out_features, in_features,
   group)``, stage 3 for one linear layer: each rank keeps only its flat, padded shard of the
   weight; forward gathers the whole weight, backward gathers it again and reduce-scatters the
   weight's gradient (averaged over the ranks) to the shards. Checked on 3 ranks with torch's
   differentiable collectives and FSDP switched off.
3. ``check_comm_bytes``: write ``comm_bytes(psi, world_size, stage, param_bytes, grad_bytes)``,
   the bytes one rank sends per step over ring collectives: an all-reduce moves 2(N-1)/N of the
   tensor, a reduce-scatter or an all-gather (N-1)/N; gradients at ``grad_bytes`` per element,
   parameters at ``param_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dmlbook.advanced import zero
from dmlbook.exercises import (
    ExerciseFailed,
    checker,
    expect_value_error,
    learner_code,
    run_answer,
)

__all__ = ["check_bytes_per_rank", "check_comm_bytes", "check_fsdp_linear"]


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def _expects_valueerror(fn: Callable, args: tuple, why: str) -> None:
    expect_value_error(f"{fn.__name__}{args}", lambda: fn(*args), why)


# --------------------------------------------------------------------------- 1. bytes per rank


def _bytes(psi: int, n: int, stage: int, params: int, grads: int, state: int) -> float:
    return sum(
        zero.paper_bytes(psi, n, stage, k=state, param_bytes=params, grad_bytes=grads).values()
    )


MIXED, FP32, BF16_FP32_GRADS = (2, 2, 12), (4, 4, 8), (2, 4, 12)
_CASES = [(7_500_000_000, 64, s, *MIXED) for s in range(4)] + [
    (10**9, 64, 2, *BF16_FP32_GRADS), (10**9, 64, 3, *BF16_FP32_GRADS),
    (10**9, 8, 1, *BF16_FP32_GRADS), (10**9, 8, 0, *BF16_FP32_GRADS),
    (7_500_000, 8, 2, *FP32), (1000, 3, 1, *FP32), (1000, 3, 3, *FP32),
    (153, 1, 3, *MIXED), (12_345, 5, 1, *MIXED),
]  # fmt: skip


def _wrong_bytes(psi, n, stage, p, g, k) -> dict[str, float]:
    """The typical wrong answers, each with what it got wrong."""
    sharded = {
        "at stage 2 you divided the parameters by N and kept the gradients whole: stage 2 "
        "shards the gradients (each rank keeps only the reduce-scattered average of its "
        "shard); the parameters stay whole until stage 3 (or you swapped param_bytes and "
        "grad_bytes)": (p / n + g + k / n) * psi,
        "the next stage's figure: stage 1 shards only the optimizer state, stage 2 adds the "
        "gradients, stage 3 the parameters": _bytes(psi, n, min(stage + 1, 3), p, g, k),
        "the previous stage's figure: stage 1 shards the optimizer state, stage 2 adds the "
        "gradients, stage 3 the parameters": _bytes(psi, n, max(stage - 1, 0), p, g, k),
        "the fp32 figure (4 + 4 + 8 bytes); use the byte sizes you are given": _bytes(
            psi, n, stage, *FP32
        ),
        "the whole model's bytes divided by N, which only stage 3 reaches": (p + g + k) * psi / n,
    }
    if stage != 2 or p == g:
        del sharded[next(iter(sharded))]  # the same number as the right one: no hint from it
    return sharded


@checker("bytes_per_rank", writes=("dmlbook.advanced.zero.accounting.paper_bytes",))
def check_bytes_per_rank(fn: Callable[..., float]) -> str:
    """Check ``fn(psi, world_size, stage, param_bytes, grad_bytes, state_bytes)`` is the bytes of
    model states per rank: (p + g + k) psi; p psi + g psi + k psi / N; p psi + (g + k) psi / N;
    (p + g + k) psi / N for stages 0-3, and ValueError for any other stage. Among the cases:
    the paper's Figure 1 (7.5B parameters, 64 GPUs, mixed precision) and bf16 parameters with
    fp32 gradients, where sharding the parameters instead of the gradients shows."""
    for psi, n, stage, p, g, k in _CASES:
        call = (
            f"your bytes_per_rank(psi={psi}, world_size={n}, stage={stage}, param_bytes={p}, "
            f"grad_bytes={g}, state_bytes={k})"
        )
        with learner_code(call):
            got = float(fn(psi, n, stage, p, g, k))
        want = _bytes(psi, n, stage, p, g, k)
        if _close(got, want):
            continue
        hint = next(
            (
                f": that is {why}"
                for why, value in _wrong_bytes(psi, n, stage, p, g, k).items()
                if _close(got, value)
            ),
            ". Add up parameters (param_bytes x psi), gradients (grad_bytes x psi) and optimizer "
            "state (state_bytes x psi), dividing by N what the stage shards",
        )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g}{hint}")
    for stage in (4, -1):
        _expects_valueerror(fn, (1000, 4, stage, *MIXED), f"ZeRO has stages 0-3, not {stage}")
    return (
        f"right for {len(_CASES)} models, world sizes, stages and precisions (the paper's 120, "
        "31.4, 16.6 and 1.9 GB among them), and ValueError for stage 4"
    )


# --------------------------------------------------------------------------- 2. a stage-3 linear

_OUT, _IN, _ROWS, _WORLD = 4, 5, 2, 3  # 20 weights, padded to 21 on 3 ranks: shards of 7


def _full_weight() -> torch.Tensor:
    return (torch.arange(_OUT * _IN, dtype=torch.float64).view(_OUT, _IN) - 9.5) / 10


def _rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows x and the weights of its loss, sum(y * g): different on every rank."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(_ROWS, _IN, generator=g, dtype=torch.float64)
    upstream = torch.randn(_ROWS, _OUT, generator=g, dtype=torch.float64)
    return x, upstream


def _fsdp_linear_on_rank(fn: Callable) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    size = -(-_OUT * _IN // world)
    padded = torch.zeros(size * world, dtype=torch.float64)
    padded[: _OUT * _IN] = _full_weight().reshape(-1)
    shard = padded[rank * size : (rank + 1) * size].clone().requires_grad_()
    x, upstream = _rank_inputs(rank)
    x.requires_grad_()
    y = fn(x, shard, _OUT, _IN, dist.group.WORLD)
    if not isinstance(y, torch.Tensor):
        return {"type": type(y).__name__}
    out = {"y": y.detach().clone(), "connected": y.requires_grad}
    if y.requires_grad and y.shape == upstream.shape:
        (y * upstream).sum().backward()
    out["x_grad"] = None if x.grad is None else x.grad.clone()
    out["shard_grad"] = None if shard.grad is None else shard.grad.clone()
    return out


def _shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = -(-full.numel() // world)
    padded = torch.zeros(size * world, dtype=full.dtype)
    padded[: full.numel()] = full.reshape(-1)
    return padded[rank * size : (rank + 1) * size]


@checker(
    "fsdp_linear",
    writes=(
        "torch.distributed.nn.functional.all_gather",
        "torch.distributed.nn.functional.reduce_scatter",
        "torch.distributed.fsdp.fully_shard",
        "dmlbook.advanced.zero.stages.zero_data_parallel",
    ),
)
def check_fsdp_linear(fn: Callable) -> str:
    """Check ``fn(x, weight_shard, out_features, in_features, group)`` on 3 ranks: ``y = x W^T``
    with W gathered from every rank's flat shard; backward gives ``x`` its gradient and the shard
    this rank's part of W's gradient averaged over the ranks (each rank had its own rows)."""
    call = f"your fsdp_linear(x of shape ({_ROWS}, {_IN}), weight_shard, {_OUT}, {_IN}, group)"
    with learner_code(f"{call} on {_WORLD} ranks"):
        ranks = run_answer(_fsdp_linear_on_rank, _WORLD, fn)
    W = _full_weight()
    local_grads = []
    for rank in range(_WORLD):
        x, upstream = _rank_inputs(rank)
        local_grads.append(upstream.T @ x)  # (out, in): this rank's gradient of W
    mean_grad = sum(local_grads) / _WORLD
    for rank, r in enumerate(ranks):
        where = f"{call} on rank {rank}"
        if "type" in r:
            raise ExerciseFailed(f"{where} returned {r['type']}, not a tensor")
        x, upstream = _rank_inputs(rank)
        want_y = x @ W.T
        if r["y"].shape != want_y.shape or not torch.allclose(r["y"], want_y, atol=1e-12):
            hint = (
                "the gathered weight is the first out_features * in_features elements of the "
                "padded buffer (every rank's shard, in rank order), viewed as (out_features, "
                "in_features) as nn.Linear stores it; y = x @ W.T"
            )
            raise ExerciseFailed(f"{where} returned\n{r['y']}\nexpected\n{want_y}: {hint}")
        if not r["connected"] or r["shard_grad"] is None:
            raise ExerciseFailed(
                f"{where}: no gradient reached weight_shard. A gather with dist's collectives is "
                "outside autograd: write a torch.autograd.Function whose backward returns the "
                "shard's gradient (and x's)"
            )
        if r["x_grad"] is None or not torch.allclose(r["x_grad"], upstream @ W, atol=1e-12):
            raise ExerciseFailed(
                f"{where}: x's gradient was\n{r['x_grad']}\nexpected grad_y @ W\n{upstream @ W}"
                " (backward needs the whole W again: gather it)"
            )
        got = r["shard_grad"]
        want = _shard_of(mean_grad, rank, _WORLD)
        if got.shape == want.shape and torch.allclose(got, want, atol=1e-12):
            continue
        mine = _shard_of(local_grads[rank], rank, _WORLD)
        if got.shape != want.shape:
            hint = (
                f"shape {tuple(got.shape)}, not the shard's {tuple(want.shape)}: return the "
                "gradient of weight_shard only (reduce-scatter the padded flat gradient)"
            )
        elif torch.allclose(got, mine, atol=1e-12):
            hint = (
                "that is your own rank's gradient of your shard. Each rank trained on its own "
                "rows, so the shard's gradient is the average over the ranks: reduce-scatter "
                "W's padded flat gradient (ReduceOp.AVG)"
            )
        elif torch.allclose(got, _WORLD * want, atol=1e-12):
            hint = f"that is the sum over the {_WORLD} ranks; data parallelism averages"
        elif any(
            torch.allclose(got, _shard_of(mean_grad, k, _WORLD), atol=1e-12) for k in range(_WORLD)
        ):
            hint = "that is another rank's shard of the averaged gradient: keep your own"
        else:
            hint = "expected your shard of W's gradient, averaged over the ranks"
        raise ExerciseFailed(
            f"{where}: weight_shard's gradient was\n{got}\nexpected\n{want}: {hint}"
        )
    return f"forward, x's gradient and the shard's averaged gradient right on {_WORLD} ranks"


# --------------------------------------------------------------------------- 3. comm bytes


def _comm(psi: int, n: int, stage: int, p: int, g: int) -> float:
    ring = (n - 1) / n  # a reduce-scatter or an all-gather sends (N-1)/N of its tensor
    if stage == 0:
        return 2 * ring * g * psi  # all-reduce of the gradients
    if stage in (1, 2):
        return ring * (g + p) * psi  # reduce-scatter the gradients, all-gather the parameters
    return ring * (g + 2 * p) * psi  # and the parameters gathered twice: forward, backward


@checker("comm_bytes", writes=("dmlbook.advanced.zero.accounting.comm_bytes_per_step",))
def check_comm_bytes(fn: Callable[..., float]) -> str:
    """Check ``fn(psi, world_size, stage, param_bytes, grad_bytes)``: the bytes one rank sends
    per step over ring collectives, gradients moving at ``grad_bytes`` and parameters at
    ``param_bytes`` per element."""
    for psi, n, stage, p, g, _ in _CASES:
        call = (
            f"your comm_bytes(psi={psi}, world_size={n}, stage={stage}, param_bytes={p}, "
            f"grad_bytes={g})"
        )
        with learner_code(call):
            got = float(fn(psi, n, stage, p, g))
        want = _comm(psi, n, stage, p, g)
        if _close(got, want):
            continue
        ring = (n - 1) / n
        wrong = {
            "stage 3 with one all-gather: stage 3 gathers each unit twice, before its forward "
            "and again before its backward, and reduce-scatters once": ring * (g + p) * psi,
            "without the ring's (N-1)/N: each rank sends N-1 of the N chunks": want / ring
            if ring
            else -1.0,
            "in elements, not bytes": (3 if stage == 3 else 2) * ring * psi,
            "the all-gather moving gradients: it moves the updated parameters "
            "(param_bytes), the reduce-scatter the gradients (grad_bytes)": (
                2 * ring * g * psi if stage in (1, 2) else ring * 3 * g * psi
            ),
            "the all-reduce moving parameters: stage 0 all-reduces the gradients (grad_bytes)": (
                2 * ring * p * psi
            ),
            "one collective too few: stages 1 and 2 reduce-scatter the gradients AND all-gather "
            "the parameters": ring * g * psi,
        }
        hint = next(
            (f": that is {why}" for why, value in wrong.items() if value and _close(got, value)),
            ". A ring all-reduce sends 2(N-1)/N of the tensor; reduce-scatter and all-gather "
            "(N-1)/N each; gradients at grad_bytes, parameters at param_bytes",
        )
        raise ExerciseFailed(f"{call} returned {got:.6g}, expected {want:.6g}{hint}")
    return f"right for {len(_CASES)} models, world sizes, stages and precisions"
