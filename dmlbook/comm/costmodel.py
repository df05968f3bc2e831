"""The alpha-beta (latency-bandwidth) cost model of communication (chapters 2 and 4).

One message of ``n`` bytes over a link takes ``alpha + n * beta`` seconds: ``alpha`` is the fixed
cost of a message (latency, software overhead), ``beta`` the seconds per byte (1 / bandwidth).
Reducing ``n`` bytes locally costs ``n * gamma`` more. A collective algorithm is then three numbers,
counted along its *critical path* (the chain of steps that cannot overlap)::

    time = messages * alpha + bytes * beta + bytes_reduced * gamma

:func:`terms` gives those three numbers for each algorithm of :mod:`dmlbook.comm.collectives`,
:func:`all_reduce_time` and :func:`ps_time` turn them into seconds for a :class:`Link`, and
:func:`fit` goes the other way: from measured times to the link's ``alpha``, ``beta`` (and
``gamma``). :func:`ping_pong`, a rank function (``run(ping_pong, 2)[0]``), measures a real link
between two ranks, so that the model always sits *beside* a measurement, never instead of one.

The model is what makes the chapters' claims quantitative: ring All-Reduce moves about ``2 n``
bytes per rank whatever the world size, but pays ``2 (p - 1)`` latencies; tree and recursive
doubling pay only ``~log2 p`` latencies but move the full ``n`` in every round; a parameter server
with one shard funnels every worker through one link. Which one wins depends on ``n``, ``p`` and
the link, and :func:`crossover_bytes` says where.
"""

from __future__ import annotations

import itertools
import math
import numbers
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dmlbook.comm.algorithms import ALGORITHMS

__all__ = [
    "Link",
    "terms",
    "all_reduce_time",
    "ps_time",
    "crossover_bytes",
    "predict_all_reduce",
    "predict_ps",
    "fit",
    "ping_pong",
    "fit_point_to_point",
]

P2P = "p2p"  # one message between two ranks; fit() accepts it beside the ALGORITHMS
DEFAULT_P2P_SIZES = tuple(1024 * 4**k for k in range(8))  # 1 KiB, 4 KiB, ..., 16 MiB
SMALL_MESSAGE, SMALL_REPEAT_FACTOR = 1 << 20, 5  # ping-pongs under 1 MiB are repeated 5x more


@dataclass(frozen=True)
class Link:
    """A link in the alpha-beta model: one message of ``n`` bytes takes ``alpha + n * beta`` s.

    ``alpha`` is seconds per message (latency), ``beta`` seconds per byte (1 / bandwidth) and
    ``gamma`` seconds per byte reduced by local arithmetic (0 to ignore the reduction's cost).
    """

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Link.{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_bandwidth(cls, latency_s: float, gbit_per_s: float, gamma: float = 0.0) -> Link:
        """The link of a data sheet: latency in seconds, bandwidth in gigabits per second."""
        if not _is_real(gbit_per_s) or not math.isfinite(gbit_per_s) or gbit_per_s <= 0:
            raise ValueError(f"gbit_per_s must be a finite number > 0, got {gbit_per_s!r}")
        return cls(alpha=latency_s, beta=8.0 / (gbit_per_s * 1e9), gamma=gamma)

    @property
    def bandwidth_GBps(self) -> float:
        """Bandwidth in gigabytes (1e9 bytes) per second: ``1 / beta / 1e9`` (inf if beta is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta / 1e9

    def send_time(self, nbytes: float) -> float:
        """Seconds to send one message of ``nbytes`` bytes: ``alpha + nbytes * beta``."""
        return self.alpha + _check_bytes(nbytes) * self.beta

    def __str__(self) -> str:
        text = f"Link(alpha={self.alpha * 1e6:.3g} us, bandwidth={self.bandwidth_GBps:.3g} GB/s"
        if self.gamma:
            text += f", reduction={1.0 / self.gamma / 1e9:.3g} GB/s"
        return text + ")"


# --------------------------------------------------------------------------- the model


def terms(algorithm: str, world_size: int, nbytes: float) -> tuple[float, float, float]:
    """(messages, bytes, bytes reduced) on ``algorithm``'s critical path; see the table below.

    The time is ``messages * alpha + bytes * beta + reduced * gamma``. With ``p = world_size``,
    ``n = nbytes``, ``L = ceil(log2 p)``, ``p'`` the largest power of two <= p, ``k = log2 p'``
    and ``e = 1`` if ``p > p'`` else 0:

    ======================  ================  ======================  =================
    algorithm               messages          bytes                   bytes reduced
    ======================  ================  ======================  =================
    ring                    2 (p - 1)         2 (p - 1) / p * n       (p - 1) / p * n
    tree                    2 L               2 L n                   L n
    recursive_doubling      k + 2 e           (k + 2 e) n             (k + e) n
    naive                   2 (p - 1)         2 (p - 1) n             (p - 1) n
    p2p (one message)       1                 n                       0
    ======================  ================  ======================  =================

    * ring: reduce-scatter then all-gather, each ``p - 1`` steps that pass one chunk of ``n / p``;
    * tree: binomial-tree reduce to rank 0, then binomial-tree broadcast, ``L`` rounds each;
    * recursive_doubling: the ``p - p'`` extra ranks first hand their ``n`` to a partner (one
      step), the ``p'`` ranks exchange the full ``n`` in ``k`` rounds, then the partners send the
      result back (one step);
    * naive: every rank sends ``n`` to rank 0, which receives them one after another, reduces, and
      sends the result back to each: all ``2 (p - 1)`` messages pass rank 0's link.

    At world size 1 there is nothing to send: (0, 0, 0) for every algorithm. ``p2p`` ignores
    ``world_size``.
    """
    n = _check_bytes(nbytes)
    if algorithm == P2P:
        return 1.0, n, 0.0
    p = _check_world_size(world_size)
    _check_algorithm(algorithm)
    if p == 1:
        return 0.0, 0.0, 0.0
    if algorithm == "ring":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * n, (p - 1) / p * n
    if algorithm == "tree":
        rounds = (p - 1).bit_length()  # ceil(log2 p), exact in integers
        return 2.0 * rounds, 2.0 * rounds * n, rounds * n
    if algorithm == "recursive_doubling":
        k = p.bit_length() - 1  # log2 of the largest power of two <= p
        extra = 1 if p > 1 << k else 0
        messages = k + 2 * extra
        return float(messages), messages * n, (k + extra) * n
    # naive
    return 2.0 * (p - 1), 2.0 * (p - 1) * n, (p - 1) * n


def all_reduce_time(algorithm: str, world_size: int, nbytes: float, link: Link) -> float:
    """Predicted seconds for an All-Reduce of ``nbytes`` on ``world_size`` ranks (see terms)."""
    _check_algorithm(algorithm)
    return _time(terms(algorithm, world_size, nbytes), _check_link(link))


def ps_time(nbytes: float, workers: int, servers: int, link: Link) -> float:
    """Predicted seconds for one synchronous parameter-server step (push gradients, pull model).

    ``servers`` (S) shards each hold ``n / S`` of the ``n = nbytes`` model; each of the
    ``workers`` (W) pushes ``n / S`` to every server and pulls ``n / S`` back. Every link carries
    the push one way and the pull the other, and the step is as slow as the busiest link:

    * a server's link: W messages of ``n / S`` bytes each way -> ``W (alpha + n / S * beta)``;
    * a worker's link: S messages, ``n`` bytes in all, each way -> ``S alpha + n beta``.

    so ``time = 2 max(W (alpha + n/S beta), S alpha + n beta) + gamma W n / S``, the last term
    being the server's sum of W gradient shards. With one server, its link carries W times what
    a worker's does (the PS bottleneck of chapter 2); with S = W shards the two sides balance
    and the bandwidth term is ``2 n beta``, the same as ring All-Reduce's for large W.
    """
    n = _check_bytes(nbytes)
    w = _check_positive_int(workers, "workers")
    s = _check_positive_int(servers, "servers")
    link = _check_link(link)
    server_side = w * (link.alpha + n / s * link.beta)
    worker_side = s * link.alpha + n * link.beta
    return 2.0 * max(server_side, worker_side) + link.gamma * w * n / s


def crossover_bytes(first: str, second: str, world_size: int, link: Link) -> float | None:
    """Message size in bytes at which ``first`` and ``second`` are predicted equally fast.

    Both times are linear in ``n``, so they cross at most once: below the crossover the
    algorithm with fewer messages wins, above it the one that moves fewer bytes. Returns None
    where they never cross at a positive size (one is at least as fast at every size). Example:
    ``crossover_bytes("recursive_doubling", "ring", 8, link)``, where ring starts to win.
    """
    _check_algorithm(first), _check_algorithm(second)
    link = _check_link(link)
    m1, b1, r1 = terms(first, world_size, 1.0)
    m2, b2, r2 = terms(second, world_size, 1.0)
    extra_latency = (m2 - m1) * link.alpha  # what second pays more per call
    saving_per_byte = (b1 - b2) * link.beta + (r1 - r2) * link.gamma  # what it saves per byte
    if saving_per_byte == 0:
        return None
    n = extra_latency / saving_per_byte
    return n if n > 0 else None


def predict_all_reduce(
    link: Link,
    world_sizes: Iterable[int],
    sizes: Iterable[float],
    algorithms: Sequence[str] = ALGORITHMS,
) -> list[dict]:
    """Model predictions (not measurements) for every algorithm, world size and size.

    Answers questions no laptop can measure, e.g. "1,024 GPUs on 400 Gb/s links":
    ``predict_all_reduce(Link.from_bandwidth(5e-6, 400), [1024], [4e8])``. Each row is
    ``{"algorithm", "world_size", "bytes", "predicted_s"}``; the key says it is a prediction.
    """
    world_sizes, sizes = list(world_sizes), list(sizes)
    return [
        dict(
            algorithm=a,
            world_size=p,
            bytes=n,
            predicted_s=all_reduce_time(a, p, n, link),
        )
        for a in algorithms
        for p in world_sizes
        for n in sizes
    ]


def predict_ps(
    link: Link, workers: Iterable[int], servers: Iterable[int], sizes: Iterable[float]
) -> list[dict]:
    """Model predictions (not measurements) of :func:`ps_time` for each workers x servers x size.

    Rows are ``{"workers", "servers", "bytes", "predicted_s"}``.
    """
    workers, servers, sizes = list(workers), list(servers), list(sizes)
    return [
        dict(workers=w, servers=s, bytes=n, predicted_s=ps_time(n, w, s, link))
        for w in workers
        for s in servers
        for n in sizes
    ]


# --------------------------------------------------------------------------- fitting


def fit(records: Iterable[Mapping], *, fit_gamma: bool = False) -> Link:
    """The non-negative ``alpha``, ``beta`` (and ``gamma``) that best explain measured times.

    Each record is a dict with ``"algorithm"`` (one of :data:`ALGORITHMS`, or ``"p2p"`` for one
    message), ``"world_size"`` (ignored for p2p), ``"bytes"`` and the measured seconds as
    ``"median_s"`` (the format of ``python -m dmlbook.bench allreduce --json``) or ``"seconds"``
    (the format of :func:`ping_pong`). Other keys are ignored.

    Every record gives one equation ``messages alpha + bytes beta (+ reduced gamma) = seconds``
    (see :func:`terms`). Each equation is divided by its measured time, so the fit minimises the
    *relative* error: a 10 us message counts as much as a 10 ms one, and ``alpha`` is not drowned
    by the large messages. The solution is the exact non-negative least-squares optimum: with two
    or three unknowns we solve the least-squares problem on every subset of them (the others held
    at 0) and keep the best one whose values are all >= 0. Records at world size 1 predict 0 s
    whatever the link, so they carry no information and are skipped.

    With ``fit_gamma=False`` (the default) ``gamma`` is 0 and the reduction's cost is folded into
    ``beta``. In every algorithm above, bytes reduced are exactly half the bytes sent, except in
    recursive doubling at a non-power-of-two world size, so ``gamma`` can only be told apart from
    ``beta`` when the records mix such runs or p2p records with collectives.

    Raises ValueError for unknown algorithms, bad values, or records that cannot determine the
    unknowns (too few, or all with the same ratio of messages to bytes).
    """
    rows, times = [], []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise ValueError(f"record {i} must be a dict, got {type(record).__name__}")
        try:
            algorithm, nbytes = record["algorithm"], record["bytes"]
        except KeyError as e:
            raise ValueError(f"record {i} lacks the key {e.args[0]!r}: {dict(record)}") from None
        if algorithm != P2P and algorithm not in ALGORITHMS:
            raise ValueError(
                f"record {i}: unknown algorithm {algorithm!r}; expected one of {(*ALGORITHMS, P2P)}"
            )
        seconds = record.get("median_s", record.get("seconds"))
        if seconds is None:
            raise ValueError(f"record {i} has neither 'median_s' nor 'seconds': {dict(record)}")
        if not _is_real(seconds) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"record {i}: measured seconds must be >= 0, got {seconds!r}")
        if algorithm == P2P:
            row = terms(P2P, 2, nbytes)
        else:
            if "world_size" not in record:
                raise ValueError(f"record {i} lacks the key 'world_size': {dict(record)}")
            row = terms(algorithm, record["world_size"], nbytes)
        if not any(row):
            continue  # world size 1: nothing sent, nothing to learn about the link
        if seconds == 0:
            raise ValueError(f"record {i}: a message cannot take 0 s: {dict(record)}")
        rows.append(row if fit_gamma else row[:2])
        times.append(float(seconds))
    unknowns = 3 if fit_gamma else 2
    names = ("alpha", "beta", "gamma")[:unknowns]
    if len(rows) < unknowns:
        raise ValueError(
            f"fit needs at least {unknowns} records with world size > 1 to determine "
            f"{', '.join(names)}; got {len(rows)}"
        )
    t = np.asarray(times)
    a = np.asarray(rows, dtype=float) / t[:, None]  # each equation divided by its own time
    b = np.ones_like(t)
    scale = np.linalg.norm(a, axis=0)
    if np.any(scale == 0) or np.linalg.matrix_rank(a / scale) < unknowns:
        raise ValueError(
            f"the records cannot tell {', '.join(names)} apart: they need different message "
            "counts per byte (e.g. several message sizes"
            + (
                "; for gamma, p2p records or recursive doubling at a non-power-of-two"
                if fit_gamma
                else ""
            )
            + ")"
        )
    x = _nnls(a / scale, b) / scale
    return Link(*(float(v) for v in x))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly, for a handful of columns (all active sets)."""
    columns = a.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(b**2))
    for k in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), k):
            idx = list(subset)
            sol, *_ = np.linalg.lstsq(a[:, idx], b, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(columns)
            x[idx] = sol
            residual = float(np.sum((a @ x - b) ** 2))
            if residual < best_residual:
                best, best_residual = x, residual
    return best


# --------------------------------------------------------------------------- measuring


def ping_pong(
    sizes: Iterable[int] = DEFAULT_P2P_SIZES, repeats: int = 20, *, warmup: int = 3
) -> list[dict]:
    """Rank function: measure one-way message times between rank 0 and rank 1 (a ping-pong).

    ``run(ping_pong, 2)[0]`` measures the link between two real ranks. For each size, after a
    barrier and ``warmup`` untimed round trips, rank 0 sends a ``bytes``-long tensor to rank 1,
    which sends it straight back; the one-way time is half the median round trip over ``repeats``
    (5 x ``repeats`` under 1 MiB, where round trips are cheap and noisy). Ranks >= 2 only join the
    barriers. Rank 0 returns one record per size, ``{"algorithm": "p2p", "world_size": 2,
    "bytes", "seconds" (one way), "round_trip_s", "fastest_round_trip_s"}``, ready for
    :func:`fit_point_to_point` or :func:`fit`; the other ranks return ``[]``. The median is the
    typical cost; the fastest round trip is the link's floor, since a busy machine's scheduling
    only ever lengthens a round trip. The default sizes (1 KiB to 16 MiB) take a few
    seconds, mostly starting the ranks.
    """
    import torch
    import torch.distributed as dist

    from dmlbook.comm.groups import device, group_rank_size

    sizes = [_check_positive_int(n, "every size") for n in sizes]
    if not sizes:
        raise ValueError("sizes must not be empty")
    repeats = _check_positive_int(repeats, "repeats")
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    rank, world_size = group_rank_size()
    if world_size < 2:
        raise ValueError(f"a ping-pong needs world_size >= 2, got {world_size}")
    dev = device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    records = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        # Small messages are cheap and the noisiest (scheduling, timer): give them more samples.
        count = repeats if nbytes >= SMALL_MESSAGE else SMALL_REPEAT_FACTOR * repeats
        round_trips = []
        dist.barrier()
        for i in range(warmup + count):
            if rank == 0:
                sync()
                start = time.perf_counter()
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
                sync()
                if i >= warmup:
                    round_trips.append(time.perf_counter() - start)
            elif rank == 1:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
        if rank == 0:
            round_trip = statistics.median(round_trips)
            records.append(
                dict(
                    algorithm=P2P,
                    world_size=2,
                    bytes=nbytes,
                    seconds=round_trip / 2,
                    round_trip_s=round_trip,
                    fastest_round_trip_s=min(round_trips),
                )
            )
    dist.barrier()
    return records


def fit_point_to_point(records: Iterable[Mapping]) -> Link:
    """The link (alpha, beta) behind one-way times ``{"bytes", "seconds"}``, e.g. as measured
    by :func:`ping_pong`: a relative-error, non-negative fit of ``alpha + n beta``."""
    return fit([{**r, "algorithm": P2P} for r in records])


# --------------------------------------------------------------------------- checks


def _time(t: tuple[float, float, float], link: Link) -> float:
    messages, nbytes, reduced = t
    return messages * link.alpha + nbytes * link.beta + reduced * link.gamma


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_bytes(nbytes) -> float:
    if not _is_real(nbytes) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    return float(nbytes)


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_world_size(world_size) -> int:
    return _check_positive_int(world_size, "world_size")


def _check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    return algorithm


def _check_link(link) -> Link:
    if not isinstance(link, Link):
        raise ValueError(f"link must be a Link, got {type(link).__name__}")
    return link
