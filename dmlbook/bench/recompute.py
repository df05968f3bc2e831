"""``python -m dmlbook.bench recompute``: chapter 4's activation checkpointing, measured.

Activation bytes saved and step-time overhead at sqrt(n) segments, ours and
``torch.utils.checkpoint``'s, against no checkpointing, as
:func:`dmlbook.model_parallel.recompute.benchmark` measures them.
"""

from __future__ import annotations

from dmlbook.bench.common import load_average, write_json


def bench_recompute(repeats: int = 10, json_path: str | None = None) -> list[dict]:
    """Checkpointing at sqrt(n) segments, ours and torch.utils.checkpoint's, against none:
    activation bytes saved (counted) and step-time overhead (median of ``repeats``)."""
    from dmlbook.model_parallel import recompute

    records = recompute.benchmark(repeats=repeats)
    print(f"recomputation at sqrt(n) segments, median of {repeats} steps, {load_average()}")
    for r in records:
        print(
            f"{r['model']:9s} {r['implementation']:6s} {r['segments']:2d} of {r['layers']:2d} "
            f"segments: {100 * r['activation_bytes_saved_fraction']:5.1f}% less activation "
            f"memory, {100 * r['time_overhead_fraction']:+6.1f}% step time"
        )
    write_json(records, json_path)
    return records
