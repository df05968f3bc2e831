"""What the benchmarks of :mod:`dmlbook.bench` share: a ratio line against torch, the JSON
records, the machine's load, and the one all-reduce that warms a process group (every
benchmark; ``python -m dmlbook.bench``)."""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist


def report_ratio(name: str, ours: list[float], theirs: list[float], unit: str = "s") -> dict:
    """Print one figure beside its baseline (medians, their ratio); return it as a record."""
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{name:38s} ours {a:8.3f} {unit}   torch {b:8.3f} {unit}   ratio {a / b:5.2f}x")
    return dict(name=name, median=a, baseline_median=b, ratio=a / b, unit=unit, runs=len(ours))


def write_json(records: list[dict], path: str | None) -> None:
    """Write ``records`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    if path:
        partial = f"{path}.{os.getpid()}.partial"
        try:
            with open(partial, "w") as f:
                json.dump(records, f, indent=1, default=str)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        print(f"wrote {len(records)} records to {path}")


def load_average() -> str:
    """Timings on a shared box mean little without it."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start"


def one_all_reduce() -> float:
    """Rank function: one all-reduce of one element (what warms a process group)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
