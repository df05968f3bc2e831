"""Context parallelism: attention over a sequence split across the ranks of a group (chapter 13).

* :mod:`~dmlbook.advanced.context_parallel.ring`: ring attention and all-gather attention, the
  online-softmax merge, the contiguous and zigzag chunks (:data:`RankChunks`: each rank's
  ``[start, stop)`` chunks of the sequence), the work each rank computes;
* :mod:`~dmlbook.advanced.context_parallel.styles`: the plan styles that make an unmodified
  char-GPT's position embedding and attention context-parallel.

``from dmlbook.advanced import context_parallel`` gives the names of ``ring``, as the one-file
module did (its chunk-list alias ``Layout`` is now :data:`RankChunks`: ``Layout`` is chapter 13's
degrees class, :class:`dmlbook.advanced.composition.layout.Layout`).
"""

from dmlbook.advanced.context_parallel.ring import (
    AttentionBlock,
    RankChunks,
    all_gather_attention,
    attention_work,
    block_attention,
    contiguous_layout,
    counting_work,
    merge,
    ring_attention,
    split,
    unsplit,
    zigzag_layout,
    zigzag_split,
    zigzag_unsplit,
)

__all__ = [
    "AttentionBlock",
    "RankChunks",
    "all_gather_attention",
    "attention_work",
    "block_attention",
    "contiguous_layout",
    "counting_work",
    "merge",
    "ring_attention",
    "split",
    "unsplit",
    "zigzag_layout",
    "zigzag_split",
    "zigzag_unsplit",
]


def __getattr__(name: str):
    """The one-file module's ``Layout`` (a chunk list) is :data:`RankChunks` now."""
    if name == "Layout":
        return RankChunks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
