"""Plots drawn from real runs, shared by every chapter: the one plotting package.

``from dmlbook import viz`` then ``viz.bars(...)``: every public name of the topic modules is
re-exported here. Each module names the chapters that use it:

* ``charts``: bars, curves and spans (chapters 1-10 and 12), and the benchmarks' figures;
* ``collectives``: the parameter server and the collectives, step by step (chapter 2);
* ``model_split``: a model cut into stages, and who waits (chapter 5);
* ``pipeline``: recomputation's segments (chapter 4), pipeline timelines (chapters 6, 7 and 13);
* ``sharding``: tensor-parallel splits (chapter 9) and a ZeRO step (chapter 9b);
* ``zero``: a ZeRO unit's flat buffer (chapter 9b);
* ``layouts``: ranks on a mesh, who holds what, experts and ring attention (chapters 9, 9b, 13);
* ``clients``: federated learning's rounds, drift and masks (chapter 10);
* ``elastic``: agents, workers and the serving pool (chapter 11).

Each function returns the matplotlib ``Axes`` (or ``Figure``) it drew on.
"""

from dmlbook.viz.charts import (
    bars,
    bench_figures,
    curves,
    spans,
    stacked_bars,
)
from dmlbook.viz.clients import (
    client_drift,
    fedavg_round,
    pairwise_masks,
)
from dmlbook.viz.collectives import (
    chunk_grid,
    message_schedule,
    ps_layout,
    ps_timeline,
    ps_timeline_legend,
    schedule_legend,
)
from dmlbook.viz.elastic import (
    Generation,
    agents_and_workers,
    epoch_by_generation,
    serving_pool,
)
from dmlbook.viz.layouts import (
    checkpoint_reads,
    expert_load,
    gemm_split,
    moe_round_trip,
    rank_grid,
    ring_attention_blocks,
    sequence_parallel_block,
    who_holds_what,
    zero_stages,
)
from dmlbook.viz.model_split import model_split
from dmlbook.viz.pipeline import (
    checkpoint_segments,
    gantt,
    held_activations,
    idle_gaps,
    pipeline_sweep,
    schedule_and_held,
)
from dmlbook.viz.sharding import (
    attention_heads,
    gemm_splits,
    tp_block,
    vocab_split,
    zero_step,
    zero_step_ops,
)
from dmlbook.viz.zero import (
    draw_flat_buffer,
)

__all__ = [
    "bars",
    "bench_figures",
    "curves",
    "spans",
    "stacked_bars",
    "client_drift",
    "fedavg_round",
    "pairwise_masks",
    "chunk_grid",
    "message_schedule",
    "model_split",
    "ps_layout",
    "ps_timeline",
    "ps_timeline_legend",
    "schedule_legend",
    "agents_and_workers",
    "epoch_by_generation",
    "Generation",
    "serving_pool",
    "expert_load",
    "gemm_split",
    "moe_round_trip",
    "checkpoint_reads",
    "rank_grid",
    "ring_attention_blocks",
    "sequence_parallel_block",
    "who_holds_what",
    "zero_stages",
    "checkpoint_segments",
    "gantt",
    "held_activations",
    "idle_gaps",
    "pipeline_sweep",
    "schedule_and_held",
    "attention_heads",
    "gemm_splits",
    "tp_block",
    "vocab_split",
    "zero_step",
    "zero_step_ops",
    "draw_flat_buffer",
]
