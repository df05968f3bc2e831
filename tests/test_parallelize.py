"""dmlbook.advanced.parallelize: plans of styles applied to an unmodified model, against torch's own
parallelize_module, and the one order in which parallelize composes TP and DP on a mesh.
(Training equality of the composed char-GPT with one process is tests/test_mesh.py's.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced import mesh as mesh_lib
from dmlbook.advanced import parallelize as P
from dmlbook.advanced import tensor_parallel as tp
from dmlbook.data_parallel import BucketedDDP
from dmlbook.launch import run
from dmlbook.models import CharGPT, char_gpt

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)).double()


PLAN = {"0": P.ColwiseParallel(), "2": P.RowwiseParallel()}


def test_a_plan_entry_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"'blocks\.\*\.atn' matches no module of CharGPT"):
        P.apply_tensor_parallel(char_gpt(10, seed=0), {"blocks.*.atn": P.AttentionParallel()})
    with pytest.raises(ValueError, match=r"'3' matches no module of Sequential"):
        P.apply_tensor_parallel(mlp(), {"3": P.ColwiseParallel()})


def test_star_stands_for_exactly_one_name():
    model = P.apply_tensor_parallel(char_gpt(10, seed=0, n_layer=2), P.CHAR_GPT_PLAN)
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
    ours = P.apply_tensor_parallel(mlp(), PLAN)
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
    if world == 4:  # the composition order on a 2 x 2 mesh and its thin variants
        kinds = {}
        for shape in ((2, 2), (1, 4), (4, 1)):
            mesh = mesh_lib.DeviceMesh(shape)
            model = P.parallelize(char_gpt(12, seed=0, n_head=4), mesh, P.CHAR_GPT_PLAN)
            inner = model.module if isinstance(model, BucketedDDP) else model
            kinds[shape] = (type(model).__name__, type(inner.blocks[0].attn).__name__)
            del model  # a DDP wrapper goes before its group does
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


def test_parallelize_applies_tensor_then_data_parallelism():
    kinds = results(4)[0]["kinds"]
    assert kinds[2, 2] == ("BucketedDDP", "ParallelSelfAttention")  # DDP around the TP model
    assert kinds[1, 4] == ("CharGPT", "ParallelSelfAttention")  # TP only
    assert kinds[4, 1] == ("BucketedDDP", "CausalSelfAttention")  # DP only: nothing split


def test_tensor_parallel_char_gpt_leaves_the_original_alone():
    model = char_gpt(10, seed=0)
    before = copy.deepcopy(model.state_dict())
    shard = P.tensor_parallel_char_gpt(model)
    assert type(model.blocks[0].attn).__name__ == "CausalSelfAttention"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(shard, CharGPT) and shard is not model
