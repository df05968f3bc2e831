"""Context parallelism: attention over a sequence split across the ranks of a group (chapter 13).

* :mod:`~dmlbook.advanced.context_parallel.ring`: ring attention and all-gather attention, the
  online-softmax merge, the contiguous and zigzag chunks (:data:`RankChunks`: each rank's
  ``[start, stop)`` chunks of the sequence), the work each rank computes;
* :mod:`~dmlbook.advanced.context_parallel.styles`: the plan styles that make an unmodified
  char-GPT's position embedding and attention context-parallel.

``from dmlbook.advanced import context_parallel`` gives the names of ``ring``.
"""

from dmlbook.advanced.context_parallel.ring import (
    AttentionBlock,
    RankChunks,
    all_gather_attention,
    attention_work,
    block_attention,
    contiguous_chunks,
    counting_work,
    merge,
    ring_attention,
    split,
    unsplit,
    zigzag_chunks,
    zigzag_split,
    zigzag_unsplit,
)

__all__ = [
    "AttentionBlock",
    "RankChunks",
    "all_gather_attention",
    "attention_work",
    "block_attention",
    "contiguous_chunks",
    "counting_work",
    "merge",
    "ring_attention",
    "split",
    "unsplit",
    "zigzag_chunks",
    "zigzag_split",
    "zigzag_unsplit",
]
