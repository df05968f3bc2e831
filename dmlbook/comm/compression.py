"""Gradient compression on the wire: fp16 / bf16, int8, 1-bit and top-k, as DDP communication hooks.

Chapter 4 ("Bottlenecks and solutions") uses this module to trade bits on the wire for accuracy.
Each hook has torch's contract ``hook(state, bucket) -> Future[Tensor]``, so it plugs into
``DistributedDataParallel.register_comm_hook(state, hook)`` (and into our own DDP, which offers
the same contract). It reads only ``bucket.buffer()`` (the flat gradients of one bucket) and
``bucket.index()``, and its future holds the bucket's gradient *averaged* over the ranks, as
torch's default hook does.

* ``allreduce_hook``: fp32 all-reduce, the baseline (what DDP does without a hook).
* ``fp16_hook`` / ``bf16_hook``: cast, divide by W, all-reduce, cast back; half the bytes.
  Bit for bit torch's ``fp16_compress_hook`` / ``bf16_compress_hook``.
* ``int8_hook``: quantise each rank's bucket with its own scale, all-gather, dequantise and sum
  locally. Summing int8 on the wire would overflow, so the sum happens in fp32 after the gather.
* ``sign_hook``: 1-bit with error feedback (EF-SignSGD, Karimireddy et al. 2019; 1-bit SGD, Seide
  et al. 2014): send ``sign(g + e) * mean|g + e|``, 8 signs a byte, and keep the rest as ``e``.
* ``topk_hook``: send the k largest-magnitude entries of ``g + e`` and their indices (Aji and
  Heafield 2017; Lin et al. 2018, "Deep Gradient Compression"); the rest stays in ``e``.
  ``topk_compress`` is that step on one flat gradient, which the hook runs on its bucket.

Compressed values cannot be summed on the wire, so the last three *gather* every rank's payload,
which costs ``(W - 1) * payload`` bytes per rank where a ring all-reduce costs
``2 (W - 1) / W * payload``: at W ranks int8 costs ``W / 8`` of fp32 and 1-bit ``W / 64``, so
int8 stops paying off at 8 ranks. Production 1-bit schemes (1-bit Adam) compress a reduce-scatter
and then an all-gather instead. ``state.bytes_sent`` counts what a hook sent by these formulas;
:class:`WireMeter` *measures* what the kernel's TCP really sent. :data:`SCHEMES` names each hook
with a factory for its state. Chapter 4's experiment, which trains the digits MLP under each and
tables both counts with the accuracy reached, lives with the data-parallel code that it trains
on: :mod:`dmlbook.data_parallel.compression_experiment`.
"""

import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "CompressionState",
    "TopKState",
    "SignState",
    "allreduce_hook",
    "fp16_hook",
    "bf16_hook",
    "int8_hook",
    "sign_hook",
    "topk_hook",
    "topk_compress",
    "pack_bits",
    "unpack_bits",
    "TcpCount",
    "WireMeter",
    "SCHEMES",
]

# The return annotation that DDP's register_comm_hook checks (hence no postponed annotations).
Future = torch.futures.Future[torch.Tensor]


@dataclass
class CompressionState:
    """A hook's memory: error-feedback residuals by bucket index, and what it put on the wire."""

    group: dist.ProcessGroup | None = None  # None: the default (world) group
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket index -> e
    bytes_sent: int = 0  # payload bytes this rank sent, by the collectives' formulas
    collectives: int = 0  # how many collectives the hook launched

    def residual(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s residual: zeros the first time, and again if the bucket changed size
        (DDP rebuilds its buckets once, after the first step)."""
        e = self.residuals.get(index)
        if e is None or e.shape != like.shape:
            e = self.residuals[index] = torch.zeros_like(like)
        return e


@dataclass
class TopKState(CompressionState):
    """State of :func:`topk_hook`: also the fraction of each bucket's entries to send."""

    fraction: float = 0.01


@dataclass
class SignState(CompressionState):
    """State of :func:`sign_hook`: also how many entries share one scale (None: the bucket).

    Smaller chunks follow the gradient's magnitude more closely (each layer, say) for
    ``4 / chunk`` more bytes per entry: they help when momentum amplifies 1-bit's error.
    """

    chunk: int | None = None


# --------------------------------------------------------------------------- collectives


def _all_reduce(state: CompressionState, tensor: torch.Tensor) -> Future:
    """Sum ``tensor`` in place over the ranks; the future holds it."""
    world = dist.get_world_size(state.group)
    state.bytes_sent += 2 * (world - 1) * tensor.numel() * tensor.element_size() // world  # ring
    state.collectives += 1
    work = dist.all_reduce(tensor, group=state.group, async_op=True)  # communication
    return work.get_future().then(lambda _: tensor)


def _all_gather(state: CompressionState, payload: torch.Tensor) -> Future:
    """Every rank's 1-D ``payload``; the future holds them as rows ``(W, len(payload))``."""
    world = dist.get_world_size(state.group)
    out = payload.new_empty(world * payload.numel())
    state.bytes_sent += (world - 1) * payload.numel() * payload.element_size()  # ring
    state.collectives += 1
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    work = gather(out, payload, group=state.group, async_op=True)  # communication
    return work.get_future().then(lambda _: out.view(world, -1))


def _with_scales(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Append float32 scales to a 1-D byte payload, so that one collective sends both."""
    return torch.cat([data, scales.reshape(-1).float().view(data.dtype)])


def _split_scales(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_with_scales` on gathered rows: ``(W, n)`` data, ``(W, m)`` scales."""
    scales = rows[:, n:].flatten().clone().view(torch.float32)  # clone: 4-byte aligned for .view
    return rows[:, :n], scales.view(len(rows), -1)


# --------------------------------------------------------------------------- hooks


def allreduce_hook(state: CompressionState, bucket: dist.GradBucket) -> Future:
    """The bucket's fp32 average: the uncompressed baseline, and what chapter 3's
    :class:`~dmlbook.data_parallel.BucketedDDP` (like torch's DDP) does without a hook.

    It divides by the world size *before* the sum, as torch's default hook does, so that a sum
    of low-precision values cannot overflow.
    """
    buffer = bucket.buffer().div_(dist.get_world_size(state.group))
    return _all_reduce(state, buffer)


def _cast_hook(dtype: torch.dtype, state: CompressionState, bucket: dist.GradBucket) -> Future:
    buffer = bucket.buffer()
    # Divide *before* the sum (as torch's hook does): W fp16 values cannot overflow their sum.
    wire = buffer.to(dtype).div_(dist.get_world_size(state.group))  # (n,) in fp16 or bf16
    return _all_reduce(state, wire).then(lambda fut: buffer.copy_(fut.value()))  # cast back


def fp16_hook(state: CompressionState, bucket: dist.GradBucket) -> Future:
    """Average in float16: 2 bytes a value, 10-bit mantissa, overflows past 65504."""
    return _cast_hook(torch.float16, state, bucket)


def bf16_hook(state: CompressionState, bucket: dist.GradBucket) -> Future:
    """Average in bfloat16: 2 bytes a value, fp32's range, but only a 7-bit mantissa."""
    return _cast_hook(torch.bfloat16, state, bucket)


def int8_hook(state: CompressionState, bucket: dist.GradBucket) -> Future:
    """Quantise to int8 with a per-rank scale, all-gather, dequantise and average in fp32.

    Each rank's error is at most half its step ``absmax / 127``. Bytes: ``n + 4`` per rank.
    """
    buffer = bucket.buffer()
    n = buffer.numel()
    scale = buffer.abs().max().clamp(min=torch.finfo(torch.float32).tiny) / 127  # one step
    q = torch.round(buffer / scale).clamp_(-127, 127).to(torch.int8)  # (n,) in [-127, 127]

    def dequantise_and_average(fut: Future) -> torch.Tensor:
        values, scales = _split_scales(fut.value(), n)  # (W, n) int8, (W, 1) fp32
        return buffer.copy_((values.float() * scales).mean(dim=0))  # the sum, in fp32

    return _all_gather(state, _with_scales(q, scale)).then(dequantise_and_average)


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans ``(n,)`` to bytes ``(ceil(n / 8),)``, the first bit in the highest place."""
    padded = F.pad(bits.to(torch.uint8), (0, -bits.numel() % 8)).view(-1, 8)  # (n/8, 8)
    return (padded * _BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)  # (n/8,)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: bytes ``(..., n/8)`` to the first ``n`` bits ``(..., n)``."""
    bits = packed.unsqueeze(-1) & _BIT_WEIGHTS.to(packed.device)  # (..., n/8, 8)
    return bits.ne(0).flatten(-2)[..., :n]


def _decode_signs(rows: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """Gathered 1-bit payloads ``(W, n/8 + 4 n/chunk)`` to the values they stand for, ``(W, n)``."""
    packed, scales = _split_scales(rows, -(-n // 8))  # (W, n/8) packed, (W, n/chunk) scales
    signs = unpack_bits(packed, n).float() * 2 - 1  # (W, n) of +-1
    signs = F.pad(signs, (0, -n % chunk)).view(len(rows), -1, chunk)  # (W, n/chunk, chunk)
    return (signs * scales.unsqueeze(-1)).flatten(1)[:, :n]  # (W, n)


def sign_hook(state: SignState, bucket: dist.GradBucket) -> Future:
    """1-bit with error feedback: send ``sign(g + e) * mean|g + e|``; what it misses stays in e."""
    buffer, index = bucket.buffer(), bucket.index()
    n = buffer.numel()
    chunk = state.chunk or n
    residual = state.residual(index, buffer)
    corrected = buffer + residual  # (n,) g + e: last steps' error is fed back
    # One scale per chunk (zero-padded at the end): mean |.| of that chunk's entries.
    scales = F.pad(corrected, (0, -n % chunk)).view(-1, chunk).abs().mean(dim=1)  # (n/chunk,)
    payload = _with_scales(pack_bits(corrected >= 0), scales)  # n/8 + 4 n/chunk bytes
    sent = _decode_signs(payload.unsqueeze(0), n, chunk)[0]  # what the others will decode
    residual.copy_(corrected - sent)  # error feedback: keep what was not sent
    return _all_gather(state, payload).then(
        lambda fut: buffer.copy_(_decode_signs(fut.value(), n, chunk).mean(dim=0))
    )


def topk_compress(
    grad: torch.Tensor, residual: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k with error feedback on one flat gradient: ``(values, indices, new_residual)``.

    Add last step's residual, send the k entries of largest magnitude and their places, and keep
    everything not sent as the new residual: nothing is lost, only delayed.
    """
    corrected = grad + residual  # (n,) g + e: last steps' error is fed back
    where = corrected.abs().topk(k, sorted=False).indices  # (k,)
    values = corrected[where]  # (k,)
    new_residual = corrected.index_fill(0, where, 0.0)  # error feedback: keep what was not sent
    return values, where, new_residual


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> Future:
    """Top-k with error feedback: send the k largest ``|g + e|`` and their places; keep the rest."""
    buffer, index = bucket.buffer(), bucket.index()
    n = buffer.numel()
    k = max(1, math.ceil(state.fraction * n))
    residual = state.residual(index, buffer)
    values, where, new_residual = topk_compress(buffer, residual, k)  # (k,), (k,), (n,)
    residual.copy_(new_residual)
    payload = torch.cat([values.view(torch.int32), where.to(torch.int32)])  # 8k bytes

    def scatter_and_average(fut: Future) -> torch.Tensor:
        rows = fut.value()  # (W, 2k): values (as int32 bits), then indices
        values, where = rows[:, :k].view(torch.float32), rows[:, k:].long()  # (W, k) each
        dense = torch.zeros_like(buffer).index_add_(0, where.flatten(), values.flatten())  # sum
        return buffer.copy_(dense.div_(len(rows)))

    return _all_gather(state, payload).then(scatter_and_average)


# --------------------------------------------------------------------------- measuring the wire

# Offsets in Linux's ``struct tcp_info`` (include/uapi/linux/tcp.h): ``tcpi_segs_out`` (u32),
# ``tcpi_bytes_sent`` (u64, Linux 4.19+; payload bytes, retransmissions included) and, just after
# it, ``tcpi_bytes_retrans`` (u64; the retransmitted part).
_SEGS_OUT, _BYTES_SENT, _BYTES_RETRANS, _TCP_INFO_LEN = 136, 200, 208, 216


@dataclass
class TcpCount:
    """What TCP sent: payload bytes (gloo's own framing included, each byte once), the bytes it
    sent again (a loaded machine drops the odd segment even on loopback) and segments (ACKs and
    retransmissions included).

    Each segment adds 52 bytes of IPv4 and TCP headers (with timestamps): on loopback the
    interface counter (``/proc/net/dev``'s ``lo``, of the ranks' own network namespace) grows by
    ``bytes + retransmitted + 52 * segments``.
    """

    bytes: int = 0
    segments: int = 0
    retransmitted: int = 0


def _tcp_sockets() -> dict[str, TcpCount]:
    """The kernel's send counters of every TCP socket this process holds, by socket inode."""
    if not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
        raise OSError("tcp_sent() reads Linux's TCP_INFO; this system does not have it")
    counts: dict[str, TcpCount] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it is harmless
        except OSError:  # the descriptor closed meanwhile
            continue
        with sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
                sent = struct.unpack_from("Q", info, _BYTES_SENT)[0]
                again = struct.unpack_from("Q", info, _BYTES_RETRANS)[0]
                segments = struct.unpack_from("I", info, _SEGS_OUT)[0]
                counts[link] = TcpCount(sent - again, segments, again)
    return counts


def tcp_sent() -> TcpCount:
    """Sum the kernel's send counters over every TCP socket this process holds (Linux only).

    Per-socket counters see only our own traffic, unlike the counters of the ``lo`` interface,
    which also count every other program talking over loopback at the same time.
    """
    sockets = _tcp_sockets().values()
    return TcpCount(
        sum(c.bytes for c in sockets),
        sum(c.segments for c in sockets),
        sum(c.retransmitted for c in sockets),
    )


class WireMeter:
    """``with WireMeter() as wire: ...`` then ``wire.bytes``: the payload TCP sent while the block
    ran, each byte once (``wire.retransmitted``: what it had to send again).

    Counted per socket, as end minus start (a socket opened inside the block from zero), so a
    socket that closes meanwhile cannot subtract its whole history from the total.
    """

    def __enter__(self) -> "WireMeter":
        self._start = _tcp_sockets()
        return self

    def __exit__(self, *exc) -> None:
        end, start = _tcp_sockets(), self._start
        for name in ("bytes", "segments", "retransmitted"):
            grew = (
                getattr(c, name) - getattr(start.get(k, TcpCount()), name) for k, c in end.items()
            )
            setattr(self, name, sum(grew))


# --------------------------------------------------------------------------- the hooks by name

Scheme = tuple[Callable, Callable[[], CompressionState]]  # (hook, a factory for its state)

SCHEMES: dict[str, Scheme] = {
    "fp32": (allreduce_hook, CompressionState),
    "fp16": (fp16_hook, CompressionState),
    "bf16": (bf16_hook, CompressionState),
    "int8": (int8_hook, CompressionState),
    "1-bit+EF": (sign_hook, SignState),
    "top-k+EF": (topk_hook, lambda: TopKState(fraction=0.02)),
}
