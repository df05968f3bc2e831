"""Checkers for chapter 2's exercises ("Parameter server and All-Reduce").

1. ``check_ring_all_gather``: write ``all_gather(tensor_list, tensor)`` as a ring, from
   ``dist.send``/``dist.recv`` (or ``isend``/``irecv``): p-1 steps, each rank forwarding to its
   right neighbour the tensor it received one step earlier: the second half of the ring
   all-reduce, whose first half (:func:`dmlbook.comm.algorithms.ring_reduce_scatter_step`) the
   chapter shows.
2. ``check_tree_broadcast``: write ``broadcast(tensor, src)`` as a binomial tree: every rank that
   holds the tensor sends it on, so the holders double each round and ceil(log2 p) rounds
   suffice (the second half of the tree all-reduce the chapter draws).

Both run the learner's function on real ranks at world sizes 2, 3 and 4 (:func:`run_answer`).
There, the collectives that do the job (``writes``: dmlbook's and torch's) are switched off, and
so is every other collective that could stand in for one (an all-reduce of a zero-padded buffer
is an all-gather), so an answer that calls one is told to build it from send and receive. Every
message is recorded, so the checker can say "right answer, but not a ring" when a rank talks to
anyone but its right neighbour, or "right answer, but not a tree" when a rank gets the tensor
only after more than ceil(log2 p) rounds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from dmlbook.exercises import ExerciseFailed, checker, learner_code, run_answer, switched_off

__all__ = ["check_ring_all_gather", "check_tree_broadcast"]

# (world size, elements per rank's tensor): one launch each, lengths varied
CASES = ((2, 3), (3, 1), (4, 2))
WORLD_SIZES = tuple(world for world, _ in CASES)
TIMEOUT = 20.0  # seconds: a wrong schedule usually leaves a rank waiting for a message

# Every other collective, torch's and dmlbook's, is off on the ranks too: any of them can stand
# in for the one the exercise asks for.
ANY_COLLECTIVE = tuple(
    [
        f"torch.distributed.{name}"
        for name in (
            "all_reduce",
            "all_gather",
            "all_gather_into_tensor",
            "all_gather_object",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "broadcast",
            "broadcast_object_list",
            "reduce",
            "gather",
            "scatter",
            "all_to_all",
            "all_to_all_single",
        )
    ]
    + [
        f"dmlbook.comm.collectives.{name}"
        for name in (
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "reduce",
            "gather",
            "scatter",
        )
    ]
    + ["dmlbook.comm.alltoall.all_to_all_single"]
)


def _value(rank: int, index: int, n: int) -> torch.Tensor:
    """A tensor that says whose it is: rank 2's chunk 1 of length 3 is [201.0, 201.01, 201.02]."""
    return 100.0 * rank + index + 0.01 * torch.arange(n, dtype=torch.float32)


def _on_rank(run_one: Callable, fn: Callable, *args) -> object:
    """Run ``run_one(fn, recorded, *args)`` on this rank with every collective off. Each call of
    ``recorded()`` starts a new record of the messages: (dst, bytes) of each send, the source of
    each receive."""
    originals = (dist.send, dist.isend, dist.recv, dist.irecv)
    send, isend, recv, irecv = originals

    def recorded() -> dict[str, list]:
        log: dict[str, list] = {"sent": [], "received": []}

        def sending(original):
            @functools.wraps(original)
            def wrapper(tensor, dst=None, *args, **kwargs):
                log["sent"].append((dst, tensor.numel() * tensor.element_size()))
                return original(tensor, dst, *args, **kwargs)

            return wrapper

        def receiving(original, returns_source: bool):
            @functools.wraps(original)
            def wrapper(tensor, src=None, *args, **kwargs):
                result = original(tensor, src, *args, **kwargs)
                log["received"].append(result if src is None and returns_source else src)
                return result

            return wrapper

        dist.send, dist.isend = sending(send), sending(isend)
        dist.recv, dist.irecv = receiving(recv, True), receiving(irecv, False)
        return log

    with switched_off(ANY_COLLECTIVE, fn):
        try:
            return run_one(fn, recorded, *args)
        finally:
            dist.send, dist.isend, dist.recv, dist.irecv = originals


def _describe(t: torch.Tensor) -> str:
    """Name a tensor by the rank and index its values encode, if they encode one."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    if torch.isnan(t).any():
        return "NaN: never written, or a copy of an entry its sender had not filled yet"
    first = t.flatten()[0].item()
    return f"{t.flatten()[:3].tolist()}" + (f" (rank {int(first // 100)}'s)" if first >= 0 else "")


# --------------------------------------------------------------------------- 1. all-gather


def _check_ring(report: dict, rank: int, world: int, n_bytes: int, what: str) -> None:
    right = (rank + 1) % world
    others = sorted({dst for dst, _ in report["sent"] if dst != right}, key=str)
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


def _all_gather_once(fn: Callable, recorded: Callable, n: int) -> dict:
    log = recorded()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.full((n,), float("nan")) for _ in range(world)]
    fn(out, _value(rank, 0, n))
    return {"out": out, "sent": log["sent"]}


def _all_gather_on_rank(fn: Callable, n: int) -> dict:
    return _on_rank(_all_gather_once, fn, n)


@checker(
    "ring_all_gather",
    writes=(
        "dmlbook.comm.collectives.all_gather",
        "dmlbook.comm.algorithms._ring_all_gather",
        "torch.distributed.all_gather",
        "torch.distributed.all_gather_into_tensor",
        "torch.distributed.all_gather_object",
    ),
)
def check_ring_all_gather(
    fn: Callable[[list, torch.Tensor], None], timeout: float = TIMEOUT
) -> str:
    """Check ``fn(tensor_list, tensor)``: every rank's ``tensor_list[j]`` becomes rank j's tensor,
    built from send/recv as a ring, at world sizes 2, 3 and 4."""
    for world, n in CASES:
        call = f"your all_gather on {world} ranks with tensors of {n} elements"
        with learner_code(call):
            reports = run_answer(_all_gather_on_rank, world, fn, n, timeout=timeout)
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
        written = f" ({missing} of the {world} entries hold NaN)" if missing else ""
        return (
            f".\nYour loop ran world_size - 1 = {world - 1} steps, so none is missing{written}: "
            "a chunk index is off by one. Rank r starts holding only its own entry r, so that is "
            "what it sends at step 0; at step s it sends what it received at step s - 1, and "
            "what arrives from the left is the entry the left neighbour sent"
        )
    if missing:
        return (
            f".\n{missing} of the {world} entries hold NaN on this rank: does the "
            f"loop run world_size - 1 steps ({world - 1} here)?"
        )
    return ""


# --------------------------------------------------------------------------- 2. tree broadcast


def _sources(world: int) -> list[int]:
    """The roots each launch tries: 0, 1 and the last rank."""
    return sorted({0, 1, world - 1})


def _broadcast_once(fn: Callable, recorded: Callable, n: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reports = {}
    for src in _sources(world):
        log = recorded()
        tensor = _value(rank, 0, n)
        fn(tensor, src)
        reports[src] = {"out": tensor, "sent": log["sent"], "received": log["received"]}
        dist.barrier()  # the next root's messages never meet this one's
    return reports


def _broadcast_on_rank(fn: Callable, n: int) -> dict:
    return _on_rank(_broadcast_once, fn, n)


def _rounds(sends: list[list[int]], src: int) -> dict[int, int]:
    """The round in which each rank gets the tensor: a rank that got it in round t sends its
    k-th message (k = 0, 1, ...) in round t + k + 1, one message at a time."""
    got = {src: 0}
    todo = [src]
    while todo:
        u = todo.pop(0)
        for k, v in enumerate(sends[u]):
            if v not in got:
                got[v] = got[u] + k + 1
                todo.append(v)
    return got


@checker(
    "tree_broadcast",
    writes=(
        "dmlbook.comm.collectives.broadcast",
        "dmlbook.comm.algorithms._tree_broadcast",
        "torch.distributed.broadcast",
        "torch.distributed.broadcast_object_list",
    ),
)
def check_tree_broadcast(fn: Callable[[torch.Tensor, int], None], timeout: float = TIMEOUT) -> str:
    """Check ``fn(tensor, src)``: every rank's ``tensor`` becomes rank ``src``'s, from send/recv,
    each rank receiving once, in at most ceil(log2 p) rounds, at world sizes 2, 3 and 4 and
    several roots."""
    for world, n in CASES:
        call = f"your broadcast on {world} ranks with tensors of {n} elements"
        with learner_code(call):
            per_rank = run_answer(_broadcast_on_rank, world, fn, n, timeout=timeout)
        for src in _sources(world):
            reports = [r[src] for r in per_rank]
            where = f"{call}, src={src}"
            _check_broadcast_result(reports, where, world, src, n)
            _check_tree(reports, where, world, src, n)
    return (
        f"tree broadcast right at world sizes {WORLD_SIZES} from several roots, each rank "
        "receiving once, in ceil(log2 p) rounds"
    )


def _check_broadcast_result(reports: list, where: str, world: int, src: int, n: int) -> None:
    want = _value(src, 0, n)
    rooted_at_zero = src != 0 and all(torch.equal(r["out"], _value(0, 0, n)) for r in reports)
    for rank, report in enumerate(reports):
        got = report["out"]
        if torch.equal(got, want):
            continue
        hint = ""
        if rooted_at_zero:
            hint = (
                ": every rank holds rank 0's tensor. Your tree is rooted at rank 0; number the "
                "ranks relative to the root, (rank - src) % world_size, and turn them back into "
                "real ranks to send"
            )
        elif torch.equal(got, _value(rank, 0, n)):
            hint = (
                f": its own tensor, so it never received. Every rank but src receives once; "
                f"number the ranks relative to the root, (rank - src) % world_size, so that the "
                f"tree hangs from src ({src} here) and not from rank 0"
            )
        raise ExerciseFailed(
            f"{where}: rank {rank} should hold rank {src}'s tensor {want[:3].tolist()}, but holds "
            f"{_describe(got)}{hint}"
        )


def _check_tree(reports: list, where: str, world: int, src: int, n: int) -> None:
    for rank, report in enumerate(reports):
        received = report["received"]
        expected = 0 if rank == src else 1
        if len(received) != expected:
            raise ExerciseFailed(
                f"right answer, but {where}: rank {rank} received {len(received)} messages; "
                + (
                    "the root already holds the tensor and receives none"
                    if rank == src
                    else "in a broadcast each rank needs the tensor once"
                )
            )
        if any(nbytes != 4 * n for _, nbytes in report["sent"]):
            raise ExerciseFailed(
                f"right answer, but {where}: rank {rank} sent messages of "
                f"{[b for _, b in report['sent']]} bytes; each message of a broadcast is the "
                f"whole tensor ({4 * n} bytes)"
            )
    sends = [[dst for dst, _ in r["sent"]] for r in reports]
    rounds = _rounds(sends, src)
    bound = math.ceil(math.log2(world))
    last = max(rounds.values())
    if last <= bound:
        return
    slowest = max(rounds, key=rounds.get)
    if len(sends[src]) == world - 1:
        why = (
            f"the root sends to every rank itself, {world - 1} messages one after another. "
            "Let the ranks that already hold the tensor help"
        )
    elif all(len(s) <= 1 for s in sends):
        why = "each rank passes the tensor to one other, a chain of world_size - 1 rounds"
    else:
        why = "some ranks that hold the tensor wait while others send"
    raise ExerciseFailed(
        f"right answer, but not a tree: {where}, rank {slowest} gets the tensor only in round "
        f"{last} (a rank sends one message per round): {why}. In a binomial tree every rank "
        f"that holds the tensor sends it on in the next round, so the holders double each round "
        f"and ceil(log2 {world}) = {bound} rounds suffice"
    )
