"""Expert parallelism: a mixture of experts spread over ranks, tokens moved by all-to-all
(chapter 13).

* :mod:`~dmlbook.advanced.expert_parallel.moe`: the one-process mixture-of-experts layer (router,
  capacity, auxiliary loss) and the MoE char-GPT;
* :mod:`~dmlbook.advanced.expert_parallel.layer`: this rank's experts of an MoE layer, the
  dispatch and combine all-to-alls, and the plan style that applies it.

``from dmlbook.advanced import expert_parallel`` gives the names of ``layer``, as the one-file
module did.
"""

from dmlbook.advanced.expert_parallel.layer import (
    ExpertParallelMoE,
    apply_expert_parallel,
)

__all__ = ["ExpertParallelMoE", "apply_expert_parallel"]
