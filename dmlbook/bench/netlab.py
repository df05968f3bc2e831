"""``python -m dmlbook.bench netlab``: a shaped link of the network lab (chapters 3, 4 and 13)
against its setting; it needs root, for network namespaces and tc."""

from __future__ import annotations

import statistics


def bench_netlab(settings: tuple[str, ...] = ("100mbit", "300mbit", "1gbit")) -> list[dict]:
    """One TCP stream between two netlab hosts against the rate the link is shaped to."""
    from dmlbook import netlab

    if reason := netlab.available():
        print(f"netlab: skipped ({reason})")
        return [dict(skipped=reason)]
    records = []
    for rate in settings:
        with netlab.Lab(2, bandwidth=rate, prefix="bench") as lab:
            runs = [netlab.tcp_throughput(lab, "h0", "h1", seconds=1.5) for _ in range(3)]
        measured, target = statistics.median(runs) / 1e6, netlab.parse_rate(rate) / 1e6
        print(
            f"netlab TCP over a {rate:>8s} link          measured {measured:7.1f} Mbit/s   "
            f"setting {target:7.1f} Mbit/s   ratio {measured / target:5.2f}x"
        )
        records.append(dict(link=rate, measured_Mbps=measured, setting_Mbps=target))
    return records
