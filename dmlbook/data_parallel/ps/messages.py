"""The parameter server's messages: request kinds, tags, and the bytes each rank counts (ch. 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PULL, PUSH, DONE, LOST = 0, 1, 2, 3  # request kinds (LOST only on a server's event queue)
REQUEST, GRADIENT, REPLY, PARAMS = 1, 2, 3, 4  # message tags: one stream of each kind per pair


@dataclass(frozen=True)
class Cluster:
    """Who serves and who works, which slices each server owns, and the group messages use."""

    servers: int  # ranks 0..servers-1
    workers: int  # ranks servers..servers+workers-1
    ranges: list  # ranges[s]: the (start, stop) slices of the flat vector server s owns
    comm: object = None  # the gloo group of the messages (None: the default group)


@dataclass
class Traffic:
    """Bytes this rank put on and took off the wire: tensor payloads and int64 headers."""

    payload_sent: int = 0
    payload_received: int = 0
    header_sent: int = 0
    header_received: int = 0

    @property
    def sent(self) -> int:
        return self.payload_sent + self.header_sent

    @property
    def received(self) -> int:
        return self.payload_received + self.header_received


def send_counted(t: torch.Tensor, dst: int, tag: int, traffic: Traffic, comm, wait=True):
    """Send ``t`` to ``dst``, counting its bytes; return the request if ``wait`` is False."""
    size = t.numel() * t.element_size()
    if t.dtype == torch.int64:
        traffic.header_sent += size
    else:
        traffic.payload_sent += size
    work = dist.isend(t, dst, group=comm, tag=tag)
    return work.wait() if wait else work


def count_received(t: torch.Tensor, traffic: Traffic) -> None:
    """Count a received ``t``'s bytes in ``traffic`` (int64: a header, else payload)."""
    size = t.numel() * t.element_size()
    if t.dtype == torch.int64:
        traffic.header_received += size
    else:
        traffic.payload_received += size
