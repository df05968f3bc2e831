"""Every flat module dmlbook.advanced had before its folders (chapters 9, 9b and 13) still
imports and gives the same public names, the same objects as their new homes, without a file
standing in for it; names renamed or replaced are listed here with their replacement."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dmlbook.advanced as advanced

# __all__ of each flat module on main before the move (git show main:dmlbook/advanced/<m>.py).
OLD_NAMES = {
    "tensor_parallel": [
        "ColumnParallelLinear",
        "CommRecord",
        "ParallelMLP",
        "ParallelSelfAttention",
        "RowParallelLinear",
        "VocabParallelEmbedding",
        "communication_per_step",
        "copy_to_tensor_parallel",
        "counting",
        "gather_from_tensor_parallel",
        "padded_vocab_size",
        "reduce_from_tensor_parallel",
        "scatter_to_tensor_parallel",
        "vocab_parallel_cross_entropy",
    ],
    "tensor_parallel_comm": [
        "CommRecord",
        "copy_to_tensor_parallel",
        "counting",
        "gather_from_tensor_parallel",
        "reduce_from_tensor_parallel",
        "scatter_to_tensor_parallel",
    ],
    "vocab_parallel": [
        "VocabParallelEmbedding",
        "padded_vocab_size",
        "vocab_parallel_cross_entropy",
    ],
    "sequence_parallel": [
        "AttentionSequenceParallel",
        "ColumnSequenceParallelLinear",
        "ColwiseSequenceParallel",
        "FeedForwardSequenceParallel",
        "RowSequenceParallelLinear",
        "RowwiseSequenceParallel",
        "SEQUENCE_PARALLEL_PLAN",
        "ScatterSequence",
        "SequenceParallel",
        "SequenceParallelMLP",
        "SequenceParallelSelfAttention",
        "activation_bytes_per_rank",
        "gather_from_sequence_parallel",
        "measure_block_activations",
        "reduce_scatter_to_sequence_parallel",
        "scatter_to_sequence_parallel",
        "sequence_parallel_char_gpt",
    ],
    "context_parallel": [
        "AttentionBlock",
        "Layout",
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
    ],
    "context_parallel_styles": [
        "CONTEXT_PARALLEL_PLAN",
        "ContextParallel",
        "ContextParallelAttention",
        "ContextParallelPositions",
        "cp_layout",
        "local_positions",
    ],
    "expert_parallel": ["ExpertParallel", "ExpertParallelMoE", "apply_expert_parallel"],
    "moe": [
        "MoEFeedForward",
        "Router",
        "Routing",
        "expert_capacity",
        "moe_aux_loss",
        "moe_char_gpt",
    ],
    "sharded_optimizer": ["ShardedOptimizer", "optimizer_state_bytes", "partition_parameters"],
    "layout": ["GROUP_NAMES", "Layout", "MESH_DIMS", "ProcessGroups"],
    "composed": [
        "ComposedResult",
        "StepMeasurement",
        "compare_with_reference",
        "rank_batch",
        "time_layouts",
        "train_composed",
        "train_reference",
    ],
    "planner": [
        "DIMENSIONS",
        "Network",
        "Traffic",
        "Workload",
        "holdings",
        "layouts_of",
        "netlab_batches",
        "netlab_model",
        "parse_layout",
        "predict_memory",
        "predict_traffic",
        "rank_layouts",
        "stage_layers",
        "step_flops",
        "step_time",
    ],
    "parallelize": [
        "AttentionParallel",
        "CHAR_GPT_PLAN",
        "COMPOSITION_ORDER",
        "ColwiseParallel",
        "Composed",
        "FeedForwardParallel",
        "LossParallel",
        "RowwiseParallel",
        "VocabParallel",
        "apply_data_parallel",
        "apply_tensor_parallel",
        "composed_plan",
        "parallelize",
        "parallelize_composed",
        "tensor_parallel_char_gpt",
    ],
    "mesh": [
        "DeviceMesh",
        "TrainResult",
        "mesh_groups",
        "shard_of",
        "train_hybrid",
        "train_reference",
    ],
}

# Old name -> where its object lives now, under which name (one name per idea).
RENAMED = {
    ("context_parallel", "Layout"): ("context_parallel.ring", "RankChunks"),
    ("parallelize", "apply_tensor_parallel"): ("composition.plan", "apply_plan"),
    ("mesh", "train_reference"): ("dmlbook.data_parallel.loop", "train_reference"),
    ("composed", "train_reference"): ("dmlbook.data_parallel.loop", "train_reference"),
}
# Old names with no single replacement: compose() does what they did, in one order.
REPLACED = {
    ("parallelize", "parallelize"): "compose(model, ProcessGroups(Layout(dp=..., tp=...)), plan)",
    ("parallelize", "apply_data_parallel"): "compose's data-parallel step (apply_dp)",
    ("parallelize", "parallelize_composed"): "compose(model, groups); zigzag is Layout.zigzag",
}


def _where(old: str, name: str):
    """The module that defines ``name`` now, by its own ``__module__`` or the alias table."""
    if (old, name) in RENAMED:
        module, new = RENAMED[old, name]
        full = module if module.startswith("dmlbook.") else f"dmlbook.advanced.{module}"
        return getattr(importlib.import_module(full), new)
    return None


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_every_old_module_imports_with_its_names(old):
    module = importlib.import_module(f"dmlbook.advanced.{old}")
    for name in OLD_NAMES[old]:
        if (old, name) in REPLACED:
            assert not hasattr(module, name), (old, name)  # listed as replaced, so really gone
            continue
        obj = getattr(module, name)  # AttributeError names what is missing
        renamed = _where(old, name)
        assert renamed is None or obj is renamed, (old, name)


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_no_flat_file_stands_in_for_an_old_module(old):
    folder = Path(advanced.__file__).parent
    assert not (folder / f"{old}.py").exists()
    module = importlib.import_module(f"dmlbook.advanced.{old}")
    renamed = any(o == old for o, _ in RENAMED)
    if old in advanced.OLD_MODULES and len(advanced.OLD_MODULES[old]) == 1 and not renamed:
        new = importlib.import_module(f"dmlbook.advanced.{advanced.OLD_MODULES[old][0]}")
        assert module is new and module.__name__ == new.__spec__.name  # the module itself


def test_old_paths_import_in_a_fresh_interpreter():
    code = (
        "from dmlbook.advanced.layout import Layout\n"
        "from dmlbook.advanced import parallelize, mesh, composed\n"
        "from dmlbook.advanced.composition.layout import Layout as New\n"
        "assert Layout is New and parallelize.compose.__module__.endswith('compose')\n"
        "assert composed.train_composed.__module__ == 'dmlbook.advanced.composition.training'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_package_lists_every_subpackage():
    folder = Path(advanced.__file__).parent
    packages = {p.parent.name for p in folder.glob("*/__init__.py")}
    assert packages == set(advanced.__all__) - {"OLD_MODULES"}
    assert [p.name for p in folder.glob("*.py")] == ["__init__.py"]  # folders only
