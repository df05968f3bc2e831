"""Checkers for chapter 2's exercises ("Parameter server and All-Reduce").

1. ``check_ring_all_gather``: write ``all_gather(tensor_list, tensor)`` as a ring, from
   ``dist.send``/``dist.recv`` (or ``isend``/``irecv``): p-1 steps, each rank forwarding to its
   right neighbour the tensor it received one step earlier
   (:func:`dmlbook.comm.collectives.all_gather`).
2. ``check_ring_reduce_scatter``: write ``reduce_scatter(output, input_list)`` (SUM) as a ring:
   p-1 steps, each rank adding the chunk arriving from the left into its running sum and passing
   it on, so that rank r ends with chunk r summed over every rank
   (:func:`dmlbook.comm.collectives.reduce_scatter`).

Both run the learner's function on real ranks at world sizes 2, 3 and 4. Inside those ranks the
built-in collectives are switched off (the point is to build them), and every message is
recorded, so the checker can say "right answer, but not a ring" when a rank talks to anyone but
its right neighbour, or sends more than p-1 messages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from dmlbook import launch
from dmlbook.exercises import ExerciseFailed, checker, learner_code

__all__ = ["check_ring_all_gather", "check_ring_reduce_scatter"]

# (world size, elements per rank's tensor or per chunk): one launch each, lengths varied
CASES = ((2, 3), (3, 1), (4, 2))
WORLD_SIZES = tuple(world for world, _ in CASES)
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
)


def _value(rank: int, index: int, n: int) -> torch.Tensor:
    """A tensor that says whose it is: rank 2's chunk 1 of length 3 is [201.0, 201.01, 201.02]."""
    return 100.0 * rank + index + 0.01 * torch.arange(n, dtype=torch.float32)


def _only_point_to_point() -> list[tuple[int, int]]:
    """In this rank, make the built-in collectives raise and record (dst, bytes) of each send."""
    sent: list[tuple[int, int]] = []

    def refuse(name):
        def collective(*args, **kwargs):
            raise RuntimeError(
                f"dist.{name} is switched off in this exercise: build the collective from "
                "dist.send / dist.recv (or isend / irecv)"
            )

        return collective

    def recorded(send):
        @functools.wraps(send)
        def wrapper(tensor, dst=None, *args, **kwargs):
            sent.append((dst, tensor.numel() * tensor.element_size()))
            return send(tensor, dst, *args, **kwargs)

        return wrapper

    for name in _COLLECTIVES:
        setattr(dist, name, refuse(name))
    dist.send = recorded(dist.send)
    dist.isend = recorded(dist.isend)
    return sent


def _describe(t: torch.Tensor) -> str:
    """Name a tensor by the rank and index its values encode, if they encode one."""
    if torch.isnan(t).any():
        return "nothing (never written)"
    first = t.flatten()[0].item()
    return f"{t.flatten()[:3].tolist()}" + (f" (rank {int(first // 100)}'s)" if first >= 0 else "")


def _check_ring(report: dict, rank: int, world: int, n_bytes: int, what: str) -> None:
    right = (rank + 1) % world
    others = sorted({dst for dst, _ in report["sent"] if dst != right})
    if others:
        raise ExerciseFailed(
            f"right answer, but not a ring: at world size {world} rank {rank} sent to ranks "
            f"{others}; in a ring, rank r sends only to its right neighbour (r + 1) % world_size"
        )
    if len(report["sent"]) != world - 1:
        raise ExerciseFailed(
            f"right answer, but rank {rank} sent {len(report['sent'])} messages at world size "
            f"{world}; a ring {what} needs exactly world_size - 1 = {world - 1}"
        )
    if any(nbytes != n_bytes for _, nbytes in report["sent"]):
        raise ExerciseFailed(
            f"right answer, but rank {rank} sent messages of {[b for _, b in report['sent']]} "
            f"bytes; each step of a ring {what} moves one chunk ({n_bytes} bytes)"
        )


# --------------------------------------------------------------------------- 1. all-gather


def _all_gather_on_rank(fn: Callable, n: int) -> dict:
    sent = _only_point_to_point()
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = _value(rank, 0, n)
    out = [torch.full((n,), float("nan")) for _ in range(world)]
    fn(out, tensor.clone())
    return {"out": out, "sent": sent}


@checker("ring_all_gather")
def check_ring_all_gather(fn: Callable[[list, torch.Tensor], None], timeout: float = 30.0) -> str:
    """Check ``fn(tensor_list, tensor)``: every rank's ``tensor_list[j]`` becomes rank j's tensor,
    built from send/recv as a ring, at world sizes 2, 3 and 4."""
    for world, n in CASES:
        call = f"your all_gather on {world} ranks with tensors of {n} elements"
        with learner_code(call):
            reports = launch.run(_all_gather_on_rank, world, fn, n, timeout=timeout)
        for rank, report in enumerate(reports):
            for j, got in enumerate(report["out"]):
                want = _value(j, 0, n)
                if not (isinstance(got, torch.Tensor) and torch.equal(got, want)):
                    raise ExerciseFailed(
                        f"{call}: on rank {rank}, tensor_list[{j}] should hold rank {j}'s "
                        f"tensor {want[:3].tolist()}, but holds {_describe(got)}"
                        + _missing_step_hint(report, world)
                    )
            _check_ring(report, rank, world, n * 4, "all-gather")
    return f"ring all-gather right at world sizes {WORLD_SIZES}, p-1 messages to the right"


def _missing_step_hint(report: dict, world: int) -> str:
    """Name the cause: too few steps, or the right number of steps with an index off by one."""
    missing = sum(bool(torch.isnan(t).any()) for t in report["out"])
    if len(report["sent"]) == world - 1:  # the loop ran every step: an index is wrong
        written = f" ({missing} of the {world} entries were never written)" if missing else ""
        return (
            f".\nYour loop ran world_size - 1 = {world - 1} steps, so none is missing{written}: "
            "a chunk index is off by one. At step s rank r sends entry (r - s) % world_size, "
            "and receives from its left neighbour entry (r - s - 1) % world_size, the one that "
            "neighbour sent"
        )
    if missing:
        return (
            f".\n{missing} of the {world} entries were never written on this rank: does the "
            f"loop run world_size - 1 steps ({world - 1} here)?"
        )
    return ""


# --------------------------------------------------------------------------- 2. reduce-scatter


def _reduce_scatter_on_rank(fn: Callable, n: int) -> dict:
    sent = _only_point_to_point()
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [_value(rank, j, n) for j in range(world)]
    output = torch.full((n,), float("nan"))
    fn(output, [t.clone() for t in inputs])
    return {"out": output, "sent": sent}


@checker("ring_reduce_scatter")
def check_ring_reduce_scatter(
    fn: Callable[[torch.Tensor, list], None], timeout: float = 30.0
) -> str:
    """Check ``fn(output, input_list)``: rank r's ``output`` becomes the sum over ranks of their
    ``input_list[r]``, built from send/recv as a ring, at world sizes 2, 3 and 4."""
    for world, n in CASES:
        call = f"your reduce_scatter on {world} ranks with chunks of {n} elements"
        with learner_code(call):
            reports = launch.run(_reduce_scatter_on_rank, world, fn, n, timeout=timeout)
        for rank, report in enumerate(reports):
            got, want = report["out"], sum(_value(r, rank, n) for r in range(world))
            if not torch.allclose(got, want):
                raise ExerciseFailed(
                    f"{call}: on rank {rank}, output should be {want[:3].tolist()} (chunk "
                    f"{rank} summed over the ranks), got {got[:3].tolist()}"
                    + _reduce_scatter_hint(got, rank, world, n, len(report["sent"]))
                )
            _check_ring(report, rank, world, n * 4, "reduce-scatter")
    return f"ring reduce-scatter right at world sizes {WORLD_SIZES}, p-1 messages to the right"


def _reduce_scatter_hint(got: torch.Tensor, rank: int, world: int, n: int, sent: int) -> str:
    """Name the cause of a wrong output: a chunk index off by one, or a step too few."""
    for chunk in range(world):
        if torch.allclose(got, sum(_value(r, chunk, n) for r in range(world))):
            return (
                f": that is the full sum of chunk {chunk}. Rank r should end with chunk r; "
                "a chunk index is off by one: check the chunk you send at each step, "
                "(r - s - 1) % world_size at step s"
            )
    for ranks in range(1, world):
        if any(
            torch.allclose(got, sum(_value((first + i) % world, c, n) for i in range(ranks)))
            for first in range(world)
            for c in range(world)
        ):
            if sent == world - 1:  # every step ran: the sums went into the wrong chunks
                return (
                    f": that sums only {ranks} of the {world} ranks' chunks, although your loop "
                    f"ran world_size - 1 = {world - 1} steps. A chunk index is off by one: what "
                    "arrives from the left at step s is chunk (r - s - 2) % world_size, so add "
                    "it into that chunk, the one you send on at step s + 1"
                )
            return (
                f": that sums only {ranks} of the {world} ranks' chunks. Does the loop run "
                f"world_size - 1 steps ({world - 1} here), adding what arrives each time?"
            )
    return ""
