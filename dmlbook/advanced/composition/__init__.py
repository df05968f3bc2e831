"""Composing parallelisms on one model: the rank grid, the plan, the one compose function,
training, the planner and checkpoints that move between layouts (chapters 9 and 13).

* :mod:`~dmlbook.advanced.composition.layout`: the rank grid, :class:`Layout` (the validated
  degrees dp, tp, pp, cp, ep and how CP cuts the sequence) with its axes named once in
  :class:`Axis`, its group tables, and :class:`ProcessGroups`;
* :mod:`~dmlbook.advanced.composition.plan`: plans of styles and :func:`apply_plan` (chapter 9);
* :mod:`~dmlbook.advanced.composition.hybrid`: chapter 9's DP x TP training on a 2-D grid;
* :mod:`~dmlbook.advanced.composition.compose`: :func:`compose`, every parallelism applied to an
  unmodified model in :data:`COMPOSITION_ORDER`;
* :mod:`~dmlbook.advanced.composition.training`: chapter 13's step over five dimensions,
  :func:`composed_step`, on the one training loop, measured;
* :mod:`~dmlbook.advanced.composition.planner`: each layout's memory, traffic and step time,
  predicted, and layouts ranked;
* :mod:`~dmlbook.advanced.composition.checkpoint`: the composed model and its ZeRO-1 state
  saved through ``torch.distributed.checkpoint`` at one layout and loaded at another, over
  :mod:`~dmlbook.advanced.composition.placements` (each rank's piece of each tensor, as DCP's
  placements).

Import the modules by name; this package imports none of them, so that a strategy folder can
import the plan without pulling in the composition that imports that folder.
"""

__all__ = [
    "checkpoint",
    "compose",
    "hybrid",
    "layout",
    "placements",
    "plan",
    "planner",
    "training",
]
