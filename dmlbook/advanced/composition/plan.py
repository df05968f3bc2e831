"""Parallelisms applied to an unmodified model by a plan, in torchtitan's manner (chapter 9).

The model is written once, for one process (:class:`~dmlbook.models.CharGPT`). Parallelising it
is a transformation, not a second model class:

* a **plan** maps module paths to **styles**. ``"blocks.*.attn"`` names the attention of every
  block (``*`` stands for one name or index); the style says what replaces that module on this
  rank, built from it by chapter 9's Megatron layers. :data:`CHAR_GPT_PLAN` is the char-GPT's:
  vocabulary-parallel embedding, attention heads and MLP split column-then-row, a column-parallel
  ``lm_head`` whose logits stay split, and the loss computed on the split logits;
* :func:`apply_tensor_parallel` swaps, in place, each planned module for this rank's shard;
  a plan entry that matches nothing is an error, so a typo cannot train the unsplit model;
* :func:`apply_data_parallel` wraps the model in chapter 3's :class:`BucketedDDP` over a group;
* :func:`parallelize` composes them on a :class:`~dmlbook.advanced.mesh.DeviceMesh`, in the one
  order written down here: tensor parallelism first (it decides which parameters exist on this
  rank), data parallelism last (it averages, over the ranks that hold the same shard, the parameters
  that now exist). Chapter 9's hybrid training uses it;
* :func:`parallelize_composed` (chapter 13) extends the same order to five dimensions on a
  :class:`~dmlbook.advanced.layout.ProcessGroups`: :data:`COMPOSITION_ORDER`, written once, here.

torch's own counterpart is ``torch.distributed.tensor.parallel.parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` and ``loss_parallel``; torchtitan's ``parallelize``
functions state the order of ``apply_tp``, ``apply_fsdp`` / ``apply_ddp`` the same way.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from dmlbook.advanced import tensor_parallel as tp
from dmlbook.data_parallel import BucketedDDP

__all__ = [
    "CHAR_GPT_PLAN",
    "AttentionParallel",
    "ColwiseParallel",
    "FeedForwardParallel",
    "LossParallel",
    "RowwiseParallel",
    "VocabParallel",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "COMPOSITION_ORDER",
    "Composed",
    "composed_plan",
    "parallelize",
    "parallelize_composed",
    "tensor_parallel_char_gpt",
]


# --------------------------------------------------------------------------- styles


@dataclass(frozen=True)
class ColwiseParallel:
    """An ``nn.Linear`` split by output features; ``gather_output`` all-gathers the result."""

    gather_output: bool = False

    def __call__(self, module: nn.Linear, group) -> nn.Module:
        return tp.ColumnParallelLinear.from_linear(module, self.gather_output, group)


@dataclass(frozen=True)
class RowwiseParallel:
    """An ``nn.Linear`` split by input features; its partial outputs are all-reduced."""

    input_is_parallel: bool = True

    def __call__(self, module: nn.Linear, group) -> nn.Module:
        return tp.RowParallelLinear.from_linear(module, self.input_is_parallel, group)


@dataclass(frozen=True)
class VocabParallel:
    """An ``nn.Embedding`` split by vocabulary rows; the looked-up vectors are all-reduced."""

    def __call__(self, module: nn.Embedding, group) -> nn.Module:
        return tp.VocabParallelEmbedding.from_embedding(module, group)


@dataclass(frozen=True)
class AttentionParallel:
    """Causal self-attention, heads split: q|k|v column-parallel, ``c_proj`` row-parallel."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        n_head = module.c_proj.in_features // module.head_size
        return tp.ParallelSelfAttention.from_attention(module, n_head, group)


@dataclass(frozen=True)
class FeedForwardParallel:
    """The transformer MLP: ``c_fc`` column-parallel, ``c_proj`` row-parallel."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        return tp.ParallelMLP.from_feedforward(module, group)


@dataclass(frozen=True)
class LossParallel:
    """The model's ``loss`` computed on vocabulary-split logits (:func:`vocab_parallel_cross_
    entropy`), so the logits are never gathered. Planned at the root path ``""``."""

    def __call__(self, module: nn.Module, group) -> nn.Module:
        if not hasattr(module, "loss"):
            raise ValueError(f"LossParallel needs a model with a loss method, not {type(module)}")
        module.loss = lambda logits, targets: tp.vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), group
        )
        return module


Style = Callable[[nn.Module, object], nn.Module]

CHAR_GPT_PLAN: dict[str, Style] = {
    "wte": VocabParallel(),
    "blocks.*.attn": AttentionParallel(),
    "blocks.*.mlp": FeedForwardParallel(),
    "lm_head": ColwiseParallel(gather_output=False),  # (B, T, V / p): the loss takes it split
    "": LossParallel(),
}


# --------------------------------------------------------------------------- applying


def apply_tensor_parallel(model: nn.Module, plan: Mapping[str, Style], group=None) -> nn.Module:
    """Replace, in place, every module that ``plan`` names by its shard on this rank of
    ``group``; returns ``model`` (or its replacement, for a root entry ``""``)."""
    names = [name for name, _ in model.named_modules()]
    for pattern, style in plan.items():
        matches = [n for n in names if _matches(n, pattern)]
        if not matches:
            raise ValueError(f"the plan's {pattern!r} matches no module of {type(model).__name__}")
        for name in matches:
            if name == "":
                model = style(model, group)
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, style(getattr(parent, child), group))
    return model


def _matches(name: str, pattern: str) -> bool:
    """``*`` stands for exactly one name or index: ``blocks.*.attn`` is ``blocks.3.attn``."""
    depth = name.count(".") if name else -1
    return fnmatch.fnmatchcase(name, pattern) and depth == (pattern.count(".") if pattern else -1)


def apply_data_parallel(model: nn.Module, group=None, **ddp_options) -> BucketedDDP:
    """Chapter 3's :class:`BucketedDDP` over ``group``: gradients averaged in buckets during
    backward, over the ranks that hold the same parameters."""
    return BucketedDDP(model, group=group, **ddp_options)


def parallelize(model: nn.Module, mesh, plan: Mapping[str, Style]) -> nn.Module:
    """``model`` parallelised on ``mesh`` (dimensions ``"dp"`` and ``"tp"``), in the one order:
    1. tensor parallelism over ``mesh.group("tp")``: each rank keeps its shard of each planned
       module; it changes which parameters exist, so it comes first;
    2. data parallelism over ``mesh.group("dp")``: the ranks with the same TP coordinate average
       the gradients of the parameters that now exist.
    A dimension of size 1 is skipped."""
    if mesh.size("tp") > 1:
        model = apply_tensor_parallel(model, plan, mesh.group("tp"))
    if mesh.size("dp") > 1:
        model = apply_data_parallel(model, mesh.group("dp"))
    return model


def tensor_parallel_char_gpt(model: nn.Module, group=None) -> nn.Module:
    """This rank's shard of a char-GPT over ``group``: a copy with :data:`CHAR_GPT_PLAN` applied.

    The vocabulary, ``n_head`` and ``4 * n_embd`` must divide by the TP size (pad the vocabulary
    with :func:`~dmlbook.advanced.tensor_parallel.padded_vocab_size`). Dropout is refused: each
    rank would drop different activations of what must be one computation.
    """
    if model.config.dropout:
        raise ValueError(f"tensor parallelism here needs dropout=0.0, got {model.config.dropout}")
    return apply_tensor_parallel(copy.deepcopy(model), CHAR_GPT_PLAN, group)


# --------------------------------------------------------------------------- five dimensions

# The order in which chapter 13 applies the parallelisms; each step changes the model the next
# one sees, so the order is not a matter of taste:
COMPOSITION_ORDER = (
    "tp",  # 1. tensor (+ sequence) parallelism: decides which slice of each weight exists here
    "cp",  # 2. context parallelism: attention over the sequence spread across the CP group
    "ep",  # 3. expert parallelism: which experts exist here (the rest are dropped)
    "pp",  # 4. pipeline parallelism: which layers exist here (a stage of the shards above)
    "dp",  # 5. data parallelism + ZeRO-1: which ranks hold the same parameters now, to average
)


def composed_plan(moe: bool = False) -> dict[str, Style]:
    """The char-GPT's TP + SP plan; an MoE layer is not split by TP but runs on the sequence
    block (its weights' gradients summed over the TP group), and expert parallelism splits it."""
    from dmlbook.advanced.sequence_parallel import SEQUENCE_PARALLEL_PLAN, SequenceParallel

    plan = dict(SEQUENCE_PARALLEL_PLAN)
    if moe:
        plan["blocks.*.mlp"] = SequenceParallel()
    return plan


@dataclass
class Composed:
    """What :func:`parallelize_composed` leaves on this rank."""

    model: nn.Module  # the whole transformed model object (layers of other stages unused)
    stage: nn.Module  # this rank's pipeline stage: the only layers it runs
    dense: list = field(default_factory=list)  # parameters replicated over the dp x cp group
    experts: list = field(default_factory=list)  # expert parameters (over the edp group)


def parallelize_composed(model: nn.Module, groups, zigzag: bool = True) -> Composed:
    """``model`` (an unmodified char-GPT, dense or MoE) parallelised on ``groups`` (a
    :class:`~dmlbook.advanced.layout.ProcessGroups`) in :data:`COMPOSITION_ORDER`, in place.
    A dimension of size 1 is skipped. Returns this rank's stage and its parameters, split into
    those averaged over ``dp_cp`` and the experts averaged over ``edp``."""
    from dmlbook.advanced.context_parallel_styles import ContextParallel
    from dmlbook.advanced.expert_parallel import apply_expert_parallel
    from dmlbook.advanced.moe import MoEFeedForward
    from dmlbook.model_parallel.pipeline import even_partition, layers_of, split_model

    layout = groups.layout
    moe = any(isinstance(m, MoEFeedForward) for m in model.modules())
    for dim in COMPOSITION_ORDER:
        if dim == "tp" and layout.tp > 1:
            model = apply_tensor_parallel(model, composed_plan(moe), groups.tp)
        elif dim == "cp" and layout.cp > 1:
            cp = ContextParallel(zigzag)
            model = apply_tensor_parallel(model, {"wpe": cp, "blocks.*.attn": cp}, groups.cp)
        elif dim == "ep" and layout.ep > 1:
            model = apply_expert_parallel(model, groups.ep)
        elif dim == "pp":  # even with one stage: the stage is what the executor runs
            layers = layers_of(model)
            stage = split_model(layers, even_partition(len(layers), layout.pp))[groups.coords["pp"]]
        elif dim == "dp":
            expert_ids = set()
            if layout.ep > 1:
                for m in model.modules():
                    if hasattr(m, "expert_range"):  # ExpertParallelMoE: its experts are its own
                        expert_ids |= {id(p) for p in m.experts.parameters()}
            params = list(stage.parameters())
            dense = [p for p in params if id(p) not in expert_ids]
            experts = [p for p in params if id(p) in expert_ids]
    return Composed(model, stage, dense, experts)
