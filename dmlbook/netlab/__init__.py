"""Several hosts on one machine: network namespaces on a shared switch, links shaped with tc.

Chapter 3 runs data-parallel training under ``torchrun --nnodes 2`` across two such hosts, which
is what "several machines" really means; chapter 4 sets the links' bandwidth to study
communication bottlenecks. Each host is a Linux network namespace ``<name>-h<i>`` whose
``eth0`` (address ``10.213.0.<i+1>``) is one end of a veth pair; the other end is a port of a
bridge inside a switch namespace ``<name>-sw``. Nothing is created in the machine's own
namespace, so the lab's subnet is unreachable from, and never routed to, the outside, and two
labs never see each other. A lab's ``name`` is its prefix plus a unique id (``ch13-3fa9c2d1``):
two runs of a chapter at once get two labs, each recorded with its owner, and a lab whose owner
died is removed by the next one (:mod:`~dmlbook.netlab.claims`).

With ``second_bandwidth`` every host also gets ``eth1`` (``10.213.0.<i+129>``) on a second
bridge: two links of different rates between the same hosts, for chapter 4's hybrid transfer.
Each link is shaped in both directions (the host's ``eth0`` and its switch port): ``tbf`` limits
the rate; ``netem`` adds delay and loss where the kernel has it.

    python -m dmlbook.netlab up --hosts 2 --bandwidth 1gbit [--delay 0.2ms] [--loss 0.1]
    python -m dmlbook.netlab status
    python -m dmlbook.netlab run h0 -- python -c "print('hello from h0')"
    python -m dmlbook.netlab down [--force]

From Python, ``with Lab(hosts=2, bandwidth="1gbit") as lab: lab.run("h1", [...])`` always tears
the hosts down, even on error; a lab left up goes when its process ends. Needs root and
iproute2 (``ip``, ``tc``).

Four modules: :mod:`~dmlbook.netlab.lab` makes, runs on and removes the hosts (:class:`Lab`,
:func:`down`, :func:`sweep`, :func:`status`); :mod:`~dmlbook.netlab.claims` records who owns
each lab; :mod:`~dmlbook.netlab.measure` measures what a shaped link carries
(:func:`tcp_throughput`, :func:`split_transfer`); ``__main__`` is the command line.
"""

from dmlbook.netlab.lab import (
    Lab,
    NetlabError,
    available,
    burst_bytes,
    down,
    parse_rate,
    parse_time,
    status,
    sweep,
)
from dmlbook.netlab.measure import split_transfer, tcp_throughput

__all__ = [
    "Lab",
    "NetlabError",
    "available",
    "burst_bytes",
    "down",
    "parse_rate",
    "parse_time",
    "split_transfer",
    "status",
    "sweep",
    "tcp_throughput",
]
