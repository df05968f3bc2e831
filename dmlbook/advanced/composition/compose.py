"""One compose function: tensor (+ sequence), context, expert, pipeline and ZeRO-1 data
parallelism applied to an unmodified model, in one order stated once (chapters 9 and 13).

Each parallelism is one ``apply_*`` step in torchtitan's manner (its ``parallelize`` functions
call ``apply_tp``, ``apply_cp``, ``apply_fsdp`` / ``apply_ddp`` one after another). Each step
changes the model the next one sees, so the order is not a matter of taste; it is written once,
in :data:`COMPOSITION_ORDER`, and :func:`compose` walks it:

1. ``tp`` (:func:`apply_tp`): tensor (+ sequence) parallelism decides which slice of each weight
   exists on this rank (the plan of :mod:`dmlbook.advanced.composition.plan`);
2. ``cp`` (:func:`apply_cp`): the position embedding and the attention see this rank's chunks of
   the sequence (:mod:`dmlbook.advanced.context_parallel.styles`; chunks by ``layout.zigzag``);
3. ``ep`` (:func:`apply_ep`): which experts exist here (:mod:`dmlbook.advanced.expert_parallel`);
4. ``pp`` (:func:`apply_pp`): which layers run here, a pipeline stage of the shards above
   (chapter 6's :func:`~dmlbook.model_parallel.pipeline.split_model`);
5. ``dp`` (:func:`apply_dp`): which ranks hold the same parameters now, to average their
   gradients (dense ones over ``dp_cp``, experts over ``edp``), and ZeRO-1: the optimizer state
   sharded over those same ranks (:class:`~dmlbook.advanced.zero.sharded_optimizer.
   ShardedOptimizer`).

A step whose degree is 1 changes nothing. Each step reads only what every earlier step leaves
meaningful (before ``pp`` the stage is the whole model), so no step depends on a variable that
another step may not have set. Chapter 9's DP x TP training is ``Layout(dp=2, tp=2)`` through
the same function with chapter 9's plan; chapter 13's five dimensions use :func:`composed_plan`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.optim import Optimizer

from dmlbook.advanced.composition.layout import Axis, ProcessGroups
from dmlbook.advanced.composition.plan import Style, apply_plan
from dmlbook.advanced.context_parallel.styles import ContextParallel
from dmlbook.advanced.expert_parallel import ExpertParallelMoE, apply_expert_parallel
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward
from dmlbook.advanced.tensor_parallel.sequence_parallel import (
    SEQUENCE_PARALLEL_PLAN,
    SequenceParallel,
)
from dmlbook.advanced.zero.sharded_optimizer import ShardedOptimizer
from dmlbook.model_parallel.pipeline import even_partition, layers_of, split_model

__all__ = [
    "COMPOSITION_ORDER",
    "Composed",
    "apply_cp",
    "apply_dp",
    "apply_ep",
    "apply_pp",
    "apply_tp",
    "compose",
]

# The order in which the parallelisms are applied, stated once; compose() walks it.
COMPOSITION_ORDER = (
    Axis.tp,  # 1. tensor (+ sequence) parallelism: decides which slice of each weight exists here
    Axis.cp,  # 2. context parallelism: attention over the sequence spread across the CP group
    Axis.ep,  # 3. expert parallelism: which experts exist here (the rest are dropped)
    Axis.pp,  # 4. pipeline parallelism: which layers exist here (a stage of the shards above)
    Axis.dp,  # 5. data parallelism + ZeRO-1: which ranks hold the same parameters now, to average
)


def composed_plan(moe: bool = False) -> dict[str, Style]:
    """The char-GPT's TP + SP plan; an MoE layer is not split by TP but runs on the sequence
    block (its weights' gradients summed over the TP group), and expert parallelism splits it."""
    plan = dict(SEQUENCE_PARALLEL_PLAN)
    if moe:
        plan["blocks.*.mlp"] = SequenceParallel()
    return plan


@dataclass
class Composed:
    """The model being composed on this rank, and what :func:`compose` leaves."""

    model: nn.Module  # the whole transformed model object (layers of other stages unused)
    groups: ProcessGroups
    plan: Mapping[str, Style] | None = None  # the TP plan; None: composed_plan(moe)
    optimizer_class: type[Optimizer] | None = None  # wrapped by ZeRO-1; None: no optimizer
    optimizer_options: dict = field(default_factory=dict)
    stage: nn.Module | None = None  # this rank's pipeline stage: the only layers it runs
    dense: list[nn.Parameter] = field(default_factory=list)  # averaged over dp_cp
    experts: list[nn.Parameter] = field(default_factory=list)  # averaged over edp
    optimizers: list[ShardedOptimizer] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stage is None:
            self.stage = self.model  # before pipeline parallelism, the stage is the model


def apply_tp(composed: Composed) -> None:
    """1. Tensor (+ sequence) parallelism over ``groups.tp``, by the plan."""
    if composed.groups.layout.tp > 1:
        moe = any(isinstance(m, MoEFeedForward) for m in composed.model.modules())
        plan = composed_plan(moe) if composed.plan is None else composed.plan
        composed.model = apply_plan(composed.model, plan, composed.groups.tp)


def apply_cp(composed: Composed) -> None:
    """2. Context parallelism over ``groups.cp``: positions and attention see this rank's chunks."""
    layout = composed.groups.layout
    if layout.cp > 1:
        cp = ContextParallel(layout.zigzag)
        composed.model = apply_plan(
            composed.model, {"wpe": cp, "blocks.*.attn": cp}, composed.groups.cp
        )


def apply_ep(composed: Composed) -> None:
    """3. Expert parallelism over ``groups.ep``: this rank keeps its experts of every MoE layer."""
    if composed.groups.layout.ep > 1:
        composed.model = apply_expert_parallel(composed.model, composed.groups.ep)


def apply_pp(composed: Composed) -> None:
    """4. Pipeline parallelism: this rank's stage of the model's layers (even with one stage:
    the stage is what the pipeline executor runs)."""
    layers = layers_of(composed.model)
    stages = split_model(layers, even_partition(len(layers), composed.groups.layout.pp))
    composed.stage = stages[composed.groups.coords["pp"]]


def apply_dp(composed: Composed) -> None:
    """5. Data parallelism + ZeRO-1: the stage's parameters split into dense ones (averaged over
    ``dp_cp``) and this rank's experts (over ``edp``), each set's optimizer state sharded over
    the same group."""
    experts = {
        id(p)
        for m in composed.model.modules()
        if isinstance(m, ExpertParallelMoE)  # its experts are this rank's own
        for p in m.experts.parameters()
    }
    params = list(composed.stage.parameters())
    composed.dense = [p for p in params if id(p) not in experts]
    composed.experts = [p for p in params if id(p) in experts]
    if composed.optimizer_class is None:
        return
    groups = composed.groups
    composed.optimizers = [
        ShardedOptimizer(ps, composed.optimizer_class, group=group, **composed.optimizer_options)
        for ps, group in ((composed.dense, groups.dp_cp), (composed.experts, groups.edp))
        if ps
    ]


STEPS: dict[Axis, Callable[[Composed], None]] = {
    Axis.tp: apply_tp,
    Axis.cp: apply_cp,
    Axis.ep: apply_ep,
    Axis.pp: apply_pp,
    Axis.dp: apply_dp,
}


def compose(
    model: nn.Module,
    groups: ProcessGroups,
    plan: Mapping[str, Style] | None = None,
    optimizer_class: type[Optimizer] | None = None,
    **optimizer_options,
) -> Composed:
    """``model`` (an unmodified char-GPT, dense or MoE) parallelised in place on ``groups`` (a
    :class:`~dmlbook.advanced.composition.layout.ProcessGroups`), one step per entry of
    :data:`COMPOSITION_ORDER`. ``plan``: the TP plan (default :func:`composed_plan`, TP + SP);
    ``optimizer_class`` (e.g. ``torch.optim.AdamW``) and its options: the ZeRO-1 optimizers
    (none when omitted, e.g. to cut a reference model the same way)."""
    composed = Composed(model, groups, plan, optimizer_class, optimizer_options)
    for dim in COMPOSITION_ORDER:
        STEPS[dim](composed)
    return composed
