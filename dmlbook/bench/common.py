"""What the benchmarks of :mod:`dmlbook.bench` share: a ratio line against torch, the JSON
records, the machine's load, and the one all-reduce that warms a process group (every
benchmark; ``python -m dmlbook.bench``)."""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist


def _report(name: str, ours: list[float], theirs: list[float], unit: str = "s") -> float:
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{name:38s} ours {a:8.3f} {unit}   torch {b:8.3f} {unit}   ratio {a / b:5.2f}x")
    return a / b


def _write_json(records: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {path}")


def _load_average() -> str:
    """Timings on a shared box mean little without it."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start"


def _one_all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
