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
is an all-gather), so an answer that calls one is told to build it from send and receive. Each
rank's input is drawn at random on that rank, afresh every check, so the only way another rank
can learn it is a message. Every message is recorded (its peer, its bytes, what it carried), so
the checker can say "right answer, but not a ring" when a rank talks to anyone but its right
neighbour, "not a tree" when a rank gets the tensor only after more than ceil(log2 p) rounds, and
where a tensor went astray. Each rank also keeps a journal of its blocking sends and receives, so
that a deadlock is explained by who waits for whom.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dmlbook.exercises import ExerciseFailed, checker, learner_code, run_answer, switched_off
from dmlbook.launch import RankTimeoutError

__all__ = ["check_ring_all_gather", "check_tree_broadcast"]

# (world size, elements per rank's tensor): one launch each, lengths varied
_CASES = ((2, 3), (3, 1), (4, 2))
WORLD_SIZES = tuple(world for world, _ in _CASES)
# seconds per launch: right answers finish in about one, so a wrong schedule that leaves a rank
# waiting for a message is reported soon
TIMEOUT = 8.0

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


def _random_input(rank: int, n: int) -> torch.Tensor:
    """This rank's input: rank + a uniform draw, seeded from the operating system on this rank,
    so no other rank (and no earlier run) can know it: rank 2's might be [2.71, 2.05, 2.93]."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    return rank + torch.rand(n, generator=generator)


def _on_rank(run_one: Callable, fn: Callable, journal: str, *args) -> object:
    """Run ``run_one(fn, recorded, *args)`` on this rank with every collective off. Each call of
    ``recorded()`` starts a new record of the messages: (dst, bytes, a copy of what it carried)
    of each send, (source, the tensor received into) of each receive. The blocking calls are
    also written to the file ``journal/<rank>`` as they start and end, and the record's
    ``returned()`` writes there that the learner's function has returned, so that the checker
    can read who waits for whom if the ranks hang."""
    originals = (dist.send, dist.isend, dist.recv, dist.irecv)
    send, isend, recv, irecv = originals
    rank = dist.get_rank()
    lines = open(Path(journal) / str(rank), "a", buffering=1)  # noqa: SIM115  # closed below

    def recorded() -> dict:
        log: dict = {"sent": [], "received": [], "returned": lambda: lines.write("done\n")}

        def sending(original, blocking: bool):
            @functools.wraps(original)
            def recorded_send(tensor, dst=None, *args, **kwargs):
                log["sent"].append((dst, tensor.numel() * tensor.element_size(), tensor.clone()))
                if not blocking:
                    return original(tensor, dst, *args, **kwargs)
                lines.write(f"send {dst}\n")
                result = original(tensor, dst, *args, **kwargs)
                lines.write("end\n")
                return result

            return recorded_send

        def receiving(original, blocking: bool):
            @functools.wraps(original)
            def recorded_recv(tensor, src=None, *args, **kwargs):
                if blocking:
                    lines.write(f"recv {src}\n")
                result = original(tensor, src, *args, **kwargs)
                if blocking:
                    lines.write("end\n")
                log["received"].append((result if src is None and blocking else src, tensor))
                return result

            return recorded_recv

        dist.send, dist.isend = sending(send, True), sending(isend, False)
        dist.recv, dist.irecv = receiving(recv, True), receiving(irecv, False)
        return log

    with switched_off(ANY_COLLECTIVE, fn):
        try:
            return run_one(fn, recorded, *args)
        finally:
            dist.send, dist.isend, dist.recv, dist.irecv = originals
            lines.close()


def _run_checked(rank_fn: Callable, world: int, fn: Callable, n: int, timeout: float, call: str,
                 deadlock_hint: Callable[[dict, int], str | None]) -> list:  # fmt: skip
    """``run_answer`` with a journal: a hang becomes a failure that says who waits for whom."""
    journal = tempfile.mkdtemp(prefix="dmlbook-ch02-")
    try:
        return run_answer(rank_fn, world, fn, journal, n, timeout=timeout)
    except RankTimeoutError as error:
        hint = deadlock_hint(_blocked(journal, world), world)
        if hint is None:
            raise
        raise ExerciseFailed(
            f"{call} was still running on ranks {error.ranks} after {timeout:g} s: {hint}"
        ) from error
    finally:
        shutil.rmtree(journal, ignore_errors=True)


def _blocked(journal: str, world: int) -> dict[int, tuple[str, int | None]]:
    """Where each rank was when the timeout came: ("send", dst) or ("recv", src) for a blocking
    call that never returned, ("done", None) when the learner's function had returned, else
    ("elsewhere", None) (waiting on an isend/irecv, or computing)."""
    where = {}
    for rank in range(world):
        path = Path(journal) / str(rank)
        lines = path.read_text().splitlines() if path.exists() else []
        last = lines[-1].split() if lines else []
        if last and last[0] in ("send", "recv"):
            where[rank] = (last[0], None if last[1] == "None" else int(last[1]))
        elif last == ["done"]:
            where[rank] = ("done", None)
        else:
            where[rank] = ("elsewhere", None)
    return where


def _who_waits(where: dict[int, tuple[str, int | None]]) -> str | None:
    """The deadlock's cause read off the journals, or None when they do not show it."""
    sending = [r for r, (what, _) in where.items() if what == "send"]
    if sending and all(where[r][0] == "send" for r in where if where[r][0] != "done"):
        if all(where[where[r][1]][0] == "send" for r in sending if where[r][1] in where):
            return (
                f"ranks {sending} all wait in a blocking dist.send, each for its peer to receive, "
                "while that peer is itself sending. A blocking send returns only once the other "
                "side receives: post the send with dist.isend, then recv, then wait() on the "
                "send's request"
            )
    for r, (what, peer) in where.items():
        if peer not in where:
            continue
        other = where[peer][0]
        if what == "send" and other != "recv":
            state = "has returned" if other == "done" else "waits for something else"
            return (
                f"rank {r} waits in dist.send to rank {peer}, which never receives from it "
                f"(rank {peer} {state}): every send needs a matching recv on the rank it names"
            )
        if what == "recv" and other == "done":
            return (
                f"rank {r} waits in dist.recv for a message from rank {peer}, which returned "
                f"without sending it: every recv needs a matching send"
            )
    return None


def _describe(t: object, inputs: list[torch.Tensor]) -> str:
    """Name a tensor by the rank whose input it is, if it is one."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    if torch.isnan(t).any():
        return "NaN: never written, or a copy of an entry its sender had not filled yet"
    whose = [j for j, x in enumerate(inputs) if x.shape == t.shape and torch.equal(t, x)]
    values = [round(v, 2) for v in t.flatten()[:3].tolist()]
    return f"rank {whose[0]}'s tensor {values}" if whose else f"{values}, no rank's tensor"


def _short(t: torch.Tensor) -> list[float]:
    return [round(v, 2) for v in t.flatten()[:3].tolist()]


# --------------------------------------------------------------------------- 1. all-gather


def _check_ring(report: dict, rank: int, world: int, n_bytes: int, what: str) -> None:
    right = (rank + 1) % world
    others = sorted({dst for dst, _, _ in report["sent"] if dst != right}, key=str)
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
    if any(nbytes != n_bytes for _, nbytes, _ in report["sent"]):
        raise ExerciseFailed(
            f"right answer, but rank {rank} sent messages of "
            f"{[b for _, b, _ in report['sent']]} bytes; each step of a ring {what} moves one "
            f"chunk ({n_bytes} bytes)"
        )


def _all_gather_once(fn: Callable, recorded: Callable, n: int) -> dict:
    log = recorded()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _random_input(rank, n)
    out = [torch.full((n,), float("nan")) for _ in range(world)]
    slots = list(out)
    fn(out, mine.clone())
    log["returned"]()
    return {
        "input": mine,
        "out": out,
        "replaced": len(out) != world or any(a is not b for a, b in zip(out, slots, strict=False)),
        "sent": log["sent"],
        "received": [(src, t.clone()) for src, t in log["received"]],
    }


def _all_gather_on_rank(fn: Callable, journal: str, n: int) -> dict:
    return _on_rank(_all_gather_once, fn, journal, n)


def _all_gather_deadlock(where: dict, world: int) -> str | None:
    return _who_waits(where)


@checker(
    "ring_all_gather",
    writes=(
        "dmlbook.comm.collectives.all_gather",
        "dmlbook.comm.algorithms.sliced_ring_all_gather",
        "torch.distributed.all_gather",
        "torch.distributed.all_gather_into_tensor",
        "torch.distributed.all_gather_object",
    ),
)
def check_ring_all_gather(
    fn: Callable[[list, torch.Tensor], None], timeout: float = TIMEOUT
) -> str:
    """Check ``fn(tensor_list, tensor)``: every rank's ``tensor_list[j]`` (given filled with NaN)
    becomes rank j's tensor, in place, built from send/recv as a ring, at world sizes 2, 3 and
    4, each rank's tensor drawn at random on that rank."""
    for world, n in _CASES:
        call = f"your all_gather on {world} ranks with tensors of {n} elements"
        with learner_code(call):
            reports = _run_checked(
                _all_gather_on_rank, world, fn, n, timeout, call, _all_gather_deadlock
            )
        inputs = [r["input"] for r in reports]
        for rank, report in enumerate(reports):
            if report["replaced"]:
                raise ExerciseFailed(
                    f"{call}: on rank {rank}, tensor_list holds other tensors than the ones it "
                    "was given (an entry was assigned, or the list resized). Fill the tensors "
                    "the list holds, in place: recv into them, or copy_ into them, as "
                    "dist.all_gather does"
                )
            for j in [rank] + [j for j in range(world) if j != rank]:  # its own entry first
                got = report["out"][j]
                if not torch.equal(got, inputs[j]):
                    raise ExerciseFailed(
                        f"{call}: on rank {rank}, tensor_list[{j}] should hold rank {j}'s "
                        f"tensor {_short(inputs[j])}, but holds {_describe(got, inputs)}"
                        + _all_gather_hint(report, rank, j, world, inputs)
                    )
            _check_ring(report, rank, world, n * 4, "all-gather")
    return f"ring all-gather right at world sizes {WORLD_SIZES}, p-1 messages to the right"


def _all_gather_hint(report: dict, rank: int, j: int, world: int, inputs: list) -> str:
    """Name the cause of a wrong ``tensor_list[j]`` on ``rank``, from what it sent and got."""
    got = report["out"][j]
    arrivals = [
        (step, k)
        for step, (_, t) in enumerate(report["received"])
        for k, x in enumerate(inputs)
        if t.shape == x.shape and torch.equal(t, x)
    ]
    nan_sent = [s for s, (_, _, t) in enumerate(report["sent"]) if torch.isnan(t).any()]
    whose = [k for k, x in enumerate(inputs) if x.shape == got.shape and torch.equal(got, x)]
    if whose:
        k = whose[0]
        step = next((s for s, kk in arrivals if kk == k), None)
        when = f", which arrived at your step {step}," if step is not None else ""
        return (
            f".\nRank {k}'s tensor{when} landed in the wrong entry: an index is off by one. "
            "At step s the entry arriving from the left is the one the left neighbour sent at "
            "its step s, and each rank sends at step s the entry it received at step s - 1 "
            "(at step 0: its own)"
        )
    if j == rank:
        never = "was never filled" if torch.isnan(got).any() else "holds something else"
        return (
            f".\nThe list comes filled with NaN, and your own entry tensor_list[rank] {never}: "
            "copy your tensor into it first (tensor_list[rank].copy_(tensor)); at step 0 that is "
            "the entry you send"
        )
    if nan_sent:
        return (
            f".\nAt step {nan_sent[0]} this rank sent an entry that still held NaN: it passed "
            "on an entry it had not received yet. At step s send the entry received at step "
            "s - 1 (at step 0: your own)"
        )
    here = [s for s, k in arrivals if k == j]
    if here:
        return (
            f".\nRank {j}'s tensor did arrive, at step {here[0]}, but never reached "
            f"tensor_list[{j}]: receive into tensor_list[{j}] itself (or copy it there)"
        )
    if len(report["sent"]) < world - 1:
        return (
            f".\nThis rank sent {len(report['sent'])} messages: does the loop run "
            f"world_size - 1 steps ({world - 1} here)?"
        )
    return (
        f".\nRank {j}'s tensor never reached this rank: at step s each rank sends the entry it "
        "received at step s - 1 (at step 0: its own), so that every tensor goes round the ring"
    )


# --------------------------------------------------------------------------- 2. tree broadcast


def _sources(world: int) -> list[int]:
    """The roots each launch tries: 0, 1 and the last rank."""
    return sorted({0, 1, world - 1})


def _broadcast_once(fn: Callable, recorded: Callable, n: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reports = {}
    for src in _sources(world):
        log = recorded()
        mine = _random_input(rank, n)
        tensor = mine.clone()
        fn(tensor, src)
        log["returned"]()
        reports[src] = {
            "input": mine,
            "out": tensor,
            "sent": log["sent"],
            "received": [src for src, _ in log["received"]],
        }
        dist.barrier()  # the next root's messages never meet this one's
    return reports


def _broadcast_on_rank(fn: Callable, journal: str, n: int) -> dict:
    return _on_rank(_broadcast_once, fn, journal, n)


def _broadcast_deadlock(where: dict, world: int) -> str | None:
    hint = _who_waits(where)
    if hint is None or world & (world - 1) == 0:
        return hint
    return hint + (
        f". With {world} ranks, not a power of two, a rank's relative rank plus the distance it "
        "sends over can be world_size or more: there is no such rank, and % world_size wraps it "
        "round to a rank that already holds the tensor and never receives again. Skip the sends "
        "past the last rank"
    )


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
        "dmlbook.comm.algorithms.tree_broadcast",
        "torch.distributed.broadcast",
        "torch.distributed.broadcast_object_list",
    ),
)
def check_tree_broadcast(fn: Callable[[torch.Tensor, int], None], timeout: float = TIMEOUT) -> str:
    """Check ``fn(tensor, src)``: every rank's ``tensor`` becomes rank ``src``'s, from send/recv,
    each rank receiving once, in at most ceil(log2 p) rounds, at world sizes 2, 3 and 4 and
    several roots, each rank's tensor drawn at random on that rank."""
    for world, n in _CASES:
        call = f"your broadcast on {world} ranks with tensors of {n} elements"
        with learner_code(call):
            per_rank = _run_checked(
                _broadcast_on_rank, world, fn, n, timeout, call, _broadcast_deadlock
            )
        for src in _sources(world):
            reports = [r[src] for r in per_rank]
            where = f"{call}, src={src}"
            _check_broadcast_result(reports, where, world, src)
            _check_tree(reports, where, world, src, n)
    return (
        f"tree broadcast right at world sizes {WORLD_SIZES} from several roots, each rank "
        "receiving once, in ceil(log2 p) rounds"
    )


def _check_broadcast_result(reports: list, where: str, world: int, src: int) -> None:
    inputs = [r["input"] for r in reports]
    want = inputs[src]
    rooted_at_zero = src != 0 and all(torch.equal(r["out"], inputs[0]) for r in reports)
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
        elif torch.equal(got, inputs[rank]):
            hint = (
                f": its own tensor, so it never received. Every rank but src receives once; "
                f"number the ranks relative to the root, (rank - src) % world_size, so that the "
                f"tree hangs from src ({src} here) and not from rank 0"
            )
        raise ExerciseFailed(
            f"{where}: rank {rank} should hold rank {src}'s tensor {_short(want)}, but holds "
            f"{_describe(got, inputs)}{hint}"
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
        if any(nbytes != 4 * n for _, nbytes, _ in report["sent"]):
            raise ExerciseFailed(
                f"right answer, but {where}: rank {rank} sent messages of "
                f"{[b for _, b, _ in report['sent']]} bytes; each message of a broadcast is the "
                f"whole tensor ({4 * n} bytes)"
            )
    sends = [[dst for dst, _, _ in r["sent"]] for r in reports]
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
