"""dmlbook.advanced.composition.plan: plans of styles applied to an unmodified model, against
torch's own parallelize_module; a style given the wrong module type is a TypeError; compose on
``Layout(dp, tp)`` applies TP, then ZeRO-1 data parallelism over the DP group.
(Training equality of the composed char-GPT with one process is test_hybrid.py's.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced import tensor_parallel as tp
from dmlbook.advanced.composition import plan as P
from dmlbook.advanced.composition.compose import COMPOSITION_ORDER, compose
from dmlbook.advanced.composition.layout import Layout, ProcessGroups
from dmlbook.launch import run
from dmlbook.models import CharGPT, char_gpt

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)).double()


PLAN = {"0": P.ColwiseParallel(), "2": P.RowwiseParallel()}


def test_a_plan_entry_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"'blocks\.\*\.atn' matches no module of CharGPT"):
        P.apply_plan(char_gpt(10, seed=0), {"blocks.*.atn": P.AttentionParallel()})
    with pytest.raises(ValueError, match=r"'3' matches no module of Sequential"):
        P.apply_plan(mlp(), {"3": P.ColwiseParallel()})


def test_star_stands_for_exactly_one_name():
    model = P.apply_plan(char_gpt(10, seed=0, n_layer=2), P.CHAR_GPT_PLAN)
    assert all(isinstance(b.attn, tp.ParallelSelfAttention) for b in model.blocks)
    assert all(isinstance(b.mlp, tp.ParallelMLP) for b in model.blocks)
    assert isinstance(model.blocks[0].ln_1, nn.LayerNorm)  # not planned: untouched
    assert isinstance(model.wte, tp.VocabParallelEmbedding)
    assert isinstance(model.lm_head, tp.ColumnParallelLinear)


def _against_torch() -> dict:
    """Our styles and torch's parallelize_module, the same plan on the same MLP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = P.apply_plan(mlp(), PLAN)
    theirs = parallelize_module(
        mlp(), init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_theirs = ours(xo), theirs(xt)
    out_ours.square().sum().backward()
    out_theirs.square().sum().backward()
    errors = {
        "output": (out_ours - out_theirs).abs().max().item(),
        "input grad": (xo.grad - xt.grad).abs().max().item(),
    }
    for name, p in ours.named_parameters():  # our shard against torch's local shard
        q = theirs.get_parameter(name)
        errors[name] = max(
            (p - q.to_local()).abs().max().item(),
            (p.grad - q.grad.to_local()).abs().max().item(),
        )
    out = {"errors": errors}
    if world == 4:  # the composition order on a 2 x 2 grid and its thin variants
        kinds, cache = {}, {}
        for dp, tp_size in ((2, 2), (1, 4), (4, 1)):
            groups = ProcessGroups(Layout(dp=dp, tp=tp_size), cache)
            model = char_gpt(12, seed=0, n_head=4)
            composed = compose(model, groups, P.CHAR_GPT_PLAN, torch.optim.Adam, lr=1e-3)
            attn = type(composed.model.blocks[0].attn).__name__
            shards = [o.world_size for o in composed.optimizers]  # ZeRO-1 over the DP group
            held = sum(p.numel() for p in composed.dense) == sum(
                p.numel() for p in composed.model.parameters()
            )
            kinds[dp, tp_size] = (composed.model is model, attn, shards, held)
        out["kinds"] = kinds
    return out


@functools.cache
def results(world: int) -> list[dict]:
    return run(_against_torch, world, timeout=90)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_styles_equal_torch_parallelize_module(world):
    for r in results(world):
        assert max(r["errors"].values()) <= 1e-12, r["errors"]
        assert len(r["errors"]) == 6  # output, input grad and the four parameters


def test_compose_applies_tensor_then_data_parallelism():
    assert COMPOSITION_ORDER.index("tp") < COMPOSITION_ORDER.index("dp")
    for r in results(4):
        kinds = r["kinds"]  # (model transformed in place, attention, ZeRO-1 group sizes, all held)
        assert kinds[2, 2] == (True, "ParallelSelfAttention", [2], True)  # TP, then DP over 2
        assert kinds[1, 4] == (True, "ParallelSelfAttention", [1], True)  # TP only
        assert kinds[4, 1] == (True, "CausalSelfAttention", [4], True)  # DP only: nothing split


def test_a_style_refuses_a_module_of_the_wrong_type():
    with pytest.raises(TypeError, match="AttentionParallel applies to CausalSelfAttention, not "):
        P.apply_plan(char_gpt(10, seed=0), {"blocks.*.mlp": P.AttentionParallel()})
    with pytest.raises(TypeError, match="ColwiseParallel applies to Linear, not Embedding"):
        P.apply_plan(char_gpt(10, seed=0), {"wte": P.ColwiseParallel()})


def test_the_loss_is_a_module_the_plan_replaces():
    shard = P.tensor_parallel_char_gpt(char_gpt(10, seed=0))
    assert isinstance(shard.criterion, tp.VocabParallelCrossEntropy)


def test_tensor_parallel_char_gpt_leaves_the_original_alone():
    model = char_gpt(10, seed=0)
    before = copy.deepcopy(model.state_dict())
    shard = P.tensor_parallel_char_gpt(model)
    assert type(model.blocks[0].attn).__name__ == "CausalSelfAttention"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(shard, CharGPT) and shard is not model
