"""Plots drawn from real runs, shared by every chapter: the one plotting package.

``from dmlbook import viz`` then ``viz.bars(...)``: every name is re-exported here from a module
per topic, each of which names the chapters that use it:

* ``charts``: ``bars``, ``stacked_bars``, ``curves``, ``spans`` (chapters 1-10 and 12);
* ``collectives``: ``chunk_grid``, ``message_schedule`` (chapter 2), ``all_to_all_dispatch``
  (chapter 13);
* ``pipeline``: ``checkpoint_segments`` (chapter 4), ``gantt`` and ``idle_gaps`` (chapters 6, 7
  and 13);
* ``layouts``: ``gemm_split``, ``who_holds_what`` (chapter 9), ``zero_stages`` (chapter 9b),
  ``rank_grid``, ``expert_load``, ``ring_attention_blocks`` (chapter 13);
* ``sharding``: ``gemm_splits``, ``tp_block``, ``attention_heads``, ``vocab_split`` (chapter 9),
  ``zero_step`` (chapter 9b);
* ``clients``: ``fedavg_round``, ``pairwise_masks`` (chapter 10), ``sample_owners`` (chapter 11);
* ``elastic``: ``agents_and_workers`` and its ``Generation``, ``epoch_by_generation``,
  ``serving_pool`` (chapter 11).

Each function returns the matplotlib ``Axes`` it drew on (``zero_stages``: its ``Figure``).
"""

from dmlbook.viz.charts import bars, curves, spans, stacked_bars
from dmlbook.viz.clients import fedavg_round, pairwise_masks, sample_owners
from dmlbook.viz.collectives import all_to_all_dispatch, chunk_grid, message_schedule
from dmlbook.viz.elastic import (
    Generation,
    agents_and_workers,
    epoch_by_generation,
    serving_pool,
)
from dmlbook.viz.layouts import (
    expert_load,
    gemm_split,
    rank_grid,
    ring_attention_blocks,
    who_holds_what,
    zero_stages,
)
from dmlbook.viz.pipeline import GANTT_COLOURS, checkpoint_segments, gantt, idle_gaps

__all__ = [
    "GANTT_COLOURS",
    "Generation",
    "agents_and_workers",
    "all_to_all_dispatch",
    "bars",
    "checkpoint_segments",
    "chunk_grid",
    "curves",
    "epoch_by_generation",
    "serving_pool",
    "expert_load",
    "fedavg_round",
    "gantt",
    "gemm_split",
    "idle_gaps",
    "message_schedule",
    "pairwise_masks",
    "rank_grid",
    "ring_attention_blocks",
    "sample_owners",
    "spans",
    "stacked_bars",
    "who_holds_what",
    "zero_stages",
]

from dmlbook.viz.sharding import (  # noqa: E402 (chapters 9, 9b)
    attention_heads,
    gemm_splits,
    tp_block,
    vocab_split,
    zero_step,
)

__all__ += ["attention_heads", "gemm_splits", "tp_block", "vocab_split", "zero_step"]
