"""``python -m dmlbook.bench composed``: chapter 13's composed step, measured against the
planner's prediction, rank by rank.

For each layout (world size 8, float32, the char-GPT of ``planner.netlab_model`` and its MoE
variant), one :func:`~dmlbook.advanced.composition.training.train_composed` run measures every
rank's memory (parameters, gradients, ZeRO-1 state, activations saved for backward) and the bytes
it sent per dimension; :func:`~dmlbook.advanced.composition.planner.predict_memory` and
``predict_traffic`` predict the same. Printed as measured / predicted, the range over the ranks,
and the TCP bytes the kernel counted over the bytes the messages carried (gloo's framing). A
measurement, never an assertion.
"""

from __future__ import annotations

import json
import statistics

from dmlbook.advanced.composition import planner
from dmlbook.advanced.composition import training as composed
from dmlbook.advanced.composition.layout import Layout
from dmlbook.advanced.expert_parallel.moe import moe_char_gpt
from dmlbook.launch import run

__all__ = ["bench_composed"]

MEMORY = ("params", "grads", "optimizer", "activations")


def _moe_model():
    return moe_char_gpt(planner.NETLAB_VOCAB, 0, n_experts=4, top_k=2, capacity_factor=None,
                        **planner.NETLAB_MODEL)  # fmt: skip


LAYOUTS = {
    "dense, dp2 x tp2 x pp2": (Layout(dp=2, tp=2, pp=2), planner.netlab_model),
    "MoE, pp2 x cp2 x tp2 x ep2": (Layout(pp=2, cp=2, tp=2, ep=2), _moe_model),
    "MoE, dp2 x cp2 x tp2 x ep4": (Layout(dp=2, cp=2, tp=2, ep=4), _moe_model),
}


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.3f}x" if abs(high - low) < 5e-4 else f"{low:.3f}-{high:.3f}x"


def bench_composed(steps: int = 3, microbatches: int = 2, json_path: str | None = None) -> list:
    """Run each layout of :data:`LAYOUTS` and print measured / predicted per quantity."""
    batches = planner.netlab_batches(steps)
    records = []
    for name, (layout, make) in LAYOUTS.items():
        ranks = run(composed.train_composed, layout.world_size, make, batches, layout,
                    microbatches, 1e-2, None, True)  # fmt: skip
        work = planner.Workload.of(make(), planner.NETLAB_BATCH, planner.NETLAB_SEQ, microbatches)
        ratios: dict[str, list[float]] = {}
        for r in ranks:
            m = r.measurement
            memory = planner.predict_memory(work, layout, r.rank)
            traffic = planner.predict_traffic(work, layout, r.rank).sent
            for key in MEMORY:
                ratios.setdefault(key, []).append(getattr(m, key) / memory[key])
            for dim, sent in m.sent.items():
                if traffic[dim]:
                    ratios.setdefault(f"{dim} bytes", []).append(sent / traffic[dim])
            wire = m.wire["forward/backward"] + m.wire["gradient sync"]
            ratios.setdefault("TCP / counted", []).append(wire / sum(m.sent.values()))
        step = statistics.median(max(r.step_s[i] for r in ranks) for i in range(1, steps))
        print(f"composed step, {name}: {1e3 * step:.0f} ms (slowest rank, median)")
        for key, values in ratios.items():
            what = (
                "kernel's TCP bytes / message bytes"
                if key == "TCP / counted"
                else ("measured / predicted")
            )
            print(f"  {key:14s} {what} {_span(values)}")
        records.append({"layout": name, "step_s": step, "ratios": ratios})
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return records
