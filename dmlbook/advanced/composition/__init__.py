"""Composing parallelisms on one model: the layout, the plan, the one compose function, training
and the planner (chapters 9 and 13).

* :mod:`~dmlbook.advanced.composition.layout`: :class:`Layout`, the validated degrees (dp, tp,
  pp, cp, ep) and how CP cuts the sequence, the rank grid and :class:`ProcessGroups`;
* :mod:`~dmlbook.advanced.composition.plan`: plans of styles and :func:`apply_plan` (chapter 9);
* :mod:`~dmlbook.advanced.composition.compose`: :func:`compose`, every parallelism applied to an
  unmodified model in :data:`COMPOSITION_ORDER`;
* :mod:`~dmlbook.advanced.composition.mesh`: chapter 9's device mesh and DP x TP training;
* :mod:`~dmlbook.advanced.composition.training`: chapter 13's training loop over five
  dimensions, measured;
* :mod:`~dmlbook.advanced.composition.planner`: each layout's memory, traffic and step time,
  predicted, and layouts ranked.

Import the modules by name; this package imports none of them, so that a strategy folder can
import the plan without pulling in the composition that imports that folder.
"""

__all__ = ["compose", "layout", "mesh", "plan", "planner", "training"]
