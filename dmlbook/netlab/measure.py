"""What a shaped link of the network lab carries, measured with real TCP streams (chapter 4).

:func:`tcp_throughput` times one stream between two hosts, to set beside the rate the link is
shaped to (chapter 4; ``python -m dmlbook.bench netlab``). :func:`split_transfer` sends one message
split over a host's two links at the same moment: chapter 4's hybrid data transfer. Server and
client are small Python programs run inside the hosts' namespaces.
"""

from __future__ import annotations

import subprocess
import sys
import time

from dmlbook.netlab.lab import Lab, NetlabError

__all__ = ["split_transfer", "tcp_throughput"]


TCP_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n, start = 0, None
while b := c.recv(1 << 20):
    start = start or time.perf_counter(); n += len(b)
print(n * 8 / (time.perf_counter() - start))
"""
TCP_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); block = bytes(1 << 16)
end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    c.sendall(block)
c.close()
"""


def tcp_throughput(
    lab: Lab, src: str | int, dst: str | int, seconds: float = 1.5, link: int = 0
) -> float:
    """Bits per second that one TCP stream carries from ``src`` to ``dst`` over ``link``."""
    addr, port = lab.address(dst, link), "5201"
    server = lab.popen(
        dst, [sys.executable, "-c", TCP_SERVER, addr, port], stdout=subprocess.PIPE, text=True
    )
    try:
        server.stdout.readline()  # "ready"
        lab.run(
            src,
            [sys.executable, "-c", TCP_CLIENT, addr, port, str(seconds)],
            check=True,
            timeout=seconds + 30,
        )
        return float(server.communicate(timeout=30)[0])
    finally:
        server.kill()
        server.wait()


SIZED_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while b := c.recv(1 << 20):
    n += len(b)
c.close(); print(n)
"""
SIZED_CLIENT = """
import socket, sys, time
addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((addr, port)); block = bytes(1 << 16)
print("ready", flush=True)
start_at = float(sys.stdin.readline())  # the common start, sent once every client is connected
time.sleep(max(0.0, start_at - time.time()))
sent = 0
while sent < nbytes:
    sent += c.send(block[: min(len(block), nbytes - sent)])
c.shutdown(socket.SHUT_WR)
c.recv(1)  # returns when the receiver has read everything and closed: the transfer is over
print(time.time() - start_at)
"""


def split_transfer(lab: Lab, src: str | int, dst: str | int, sizes: list[int]) -> list[float]:
    """Send ``sizes[link]`` bytes from ``src`` to ``dst`` over each link *at the same moment*
    (chapter 4's hybrid data transfer: one message split over two links); returns the seconds
    each part took, from the common start until its last byte was received."""
    if len(sizes) > (2 if lab.second_bandwidth else 1):
        raise ValueError(
            f"{len(sizes)} parts but the lab has {1 + bool(lab.second_bandwidth)} link(s)"
        )
    servers, clients = [], []
    try:
        for link, _ in enumerate(sizes):
            addr = lab.address(dst, link)
            server = lab.popen(
                dst,
                [sys.executable, "-c", SIZED_SERVER, addr, str(5301 + link)],
                stdout=subprocess.PIPE,
                text=True,
            )
            servers.append(server)
            server.stdout.readline()  # "ready"
        for link, nbytes in enumerate(sizes):
            cmd = [sys.executable, "-c", SIZED_CLIENT, lab.address(dst, link), str(5301 + link)]
            clients.append(
                lab.popen(
                    src,
                    [*cmd, str(nbytes)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        # Every client connects first, then all start together. The start is set only once the
        # last one is connected: a client that a loaded machine started late must not count its
        # own start-up as transfer time (a fixed start 0.5 s ahead did, beside other tests).
        for client in clients:
            client.stdout.readline()  # "ready"
        start_at = time.time() + 0.05
        for client in clients:
            client.stdin.write(f"{start_at!r}\n")
            client.stdin.flush()
        seconds = [float(c.communicate(timeout=120)[0]) for c in clients]
        received = [int(s.communicate(timeout=30)[0]) for s in servers]
        if received != list(sizes):
            raise NetlabError(f"sent {list(sizes)} bytes but {received} arrived")
        return seconds
    finally:
        for proc in servers + clients:
            proc.kill()
            proc.wait()
