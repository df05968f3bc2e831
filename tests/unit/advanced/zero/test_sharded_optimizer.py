"""Tests for dmlbook.advanced.zero.sharded_optimizer: at world sizes 1-4, ShardedOptimizer wrapping
AdamW, SGD with Nesterov momentum and Adafactor (row and column statistics, RMS clipping: not
elementwise) equals, bitwise, the unsharded optimizer fed the same averaged gradients and torch's
ZeroRedundancyOptimizer under DDP, and one process on the global batch to rtol 1e-7; each rank
holds only its partition's state; LR schedulers, state-dict round trips, add_param_group and a
subgroup behave as on the plain optimizer; bad input fails fast and clearly.

The model has a tied pair (the head's weight is the embedding's), a frozen parameter and two
param groups (no weight decay on biases and norms); one parameter has no gradient every third
step. One launch per world size, cached across tests, plus one launch that must fail."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.zero.sharded_optimizer import (
    ShardedOptimizer,
    optimizer_state_bytes,
    partition_parameters,
)
from dmlbook.data_parallel import average_gradients
from dmlbook.launch import RankError, run

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, SAVE_AT, BATCH, VOCAB, DIM = 20, 8, 12, 11, 6
WORLD_SIZES = [1, 2, 3, 4]
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2, weight_decay=0.05)),
}
NAMES = [
    ["embed.weight", "hidden.weight"],
    ["hidden.bias", "norm.weight", "norm.bias", "head.bias"],
]
EXACT = dict(rtol=0, atol=0)  # the same arithmetic on the same numbers: bitwise equal
CLOSE = dict(rtol=1e-7, atol=1e-12)  # another order of summation (the global batch in one go)


class TinyLM(nn.Module):
    """Embedding -> hidden -> LayerNorm (frozen weight) -> head, whose weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight  # tied: one Parameter, reachable twice
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
        self.norm.weight.requires_grad_(False)  # frozen

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, VOCAB)
        return self.head(self.norm(torch.tanh(self.hidden(self.embed(tokens)))))


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def named_groups(model: nn.Module) -> list[dict]:
    """Module by module, so the tied weight is listed twice (as embed.weight and head.weight)."""
    named = [
        (f"{module_name}.{name}", p)
        for module_name, module in model.named_modules()
        for name, p in module.named_parameters(recurse=False)
    ]
    return [
        {"params": [(n, p) for n, p in named if p.ndim >= 2]},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def plain_groups(model: nn.Module) -> list[dict]:
    """The same groups, each parameter once (model.parameters() skips the tied repeat)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH,), generator=g)  # (BATCH,)
    return tokens, torch.randint(0, VOCAB, (BATCH,), generator=g)


def local_batch(step: int, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch (different data on every rank)."""
    x, y = global_batch(step)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    share = BATCH // size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def make_optimizer(name: str, model: nn.Module, kind: str, group=None):
    cls, kwargs = OPTIMIZERS[name]
    if kind == "sharded":
        return ShardedOptimizer(named_groups(model), cls, group=group, **kwargs)
    if kind == "torch zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(plain_groups(model), cls, **kwargs)
    return cls(plain_groups(model), **kwargs)


def warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.8 ** (step // 5)


def train(name, kind, steps=range(STEPS), model=None, optimizer=None, *, group=None,
          schedule=False, ddp=False):  # fmt: skip
    """Data-parallel training: this rank's share of each global batch, gradients averaged over
    ``group`` by chapter 3's average_gradients (or by torch's DDP), then ``kind`` of optimizer
    steps; returns (model, optimizer)."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model() if model is None else model
    optimizer = make_optimizer(name, model, kind, group) if optimizer is None else optimizer
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay) if schedule else None
    )
    forward = DistributedDataParallel(model) if ddp else model
    for step in steps:
        x, y = local_batch(step, group)
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward(x), y).backward()  # DDP: communication
        if not ddp:
            average_gradients(model, group)  # communication
        if step % 3 == 1:
            model.hidden.bias.grad = None  # no gradient this step: the optimizer skips it
        optimizer.step()
        if scheduler:
            scheduler.step()
    return model, optimizer


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def per_param_state_bytes(optimizer, model) -> dict[str, int]:
    return {
        n: sum(
            v.untyped_storage().nbytes() for v in optimizer.state[p].values() if torch.is_tensor(v)
        )
        for n, p in model.named_parameters()
    }


def resumed(name: str, state: dict, into: str):
    """Continue from step SAVE_AT in a fresh model and optimizer that loads ``state``."""
    model = make_model()
    with torch.no_grad():
        for p, q in zip(model.parameters(), state["model"], strict=True):
            p.copy_(q)
    optimizer = make_optimizer(name, model, into)
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    return weights(train(name, into, range(SAVE_AT, STEPS), model, optimizer)[0])


def save_and_resume(name: str) -> dict:
    """Save at SAVE_AT (consolidated on the last rank), resume in fresh optimizers, and the other
    way round: a plain optimizer's state dict loaded into a ShardedOptimizer."""
    model, optimizer = train(name, "sharded", range(SAVE_AT))
    to = dist.get_world_size() - 1
    optimizer.consolidate_state_dict(to=to)
    shared = [None]
    if dist.get_rank() == to:
        shared = [{"model": list(weights(model).values()), "optimizer": optimizer.state_dict()}]
    dist.broadcast_object_list(shared, src=to)  # communication: every rank loads it
    plain_model, plain = train(name, "plain", range(SAVE_AT))
    from_plain = {"model": list(weights(plain_model).values()), "optimizer": plain.state_dict()}
    out = {
        "sharded -> sharded": resumed(name, shared[0], "sharded"),
        "sharded -> plain": resumed(name, shared[0], "plain"),
        "plain -> sharded": resumed(name, from_plain, "sharded"),
        "saved": shared[0]["optimizer"],
        "saved by plain": copy.deepcopy(from_plain["optimizer"]),
    }
    optimizer.step()  # a step makes a consolidated state stale
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        out["stale"] = str(error)
    return out


def bad_input_errors() -> dict[str, str]:
    found = {}
    model = make_model()
    cases = {
        "empty list": lambda: ShardedOptimizer([], torch.optim.AdamW),
        "empty groups": lambda: ShardedOptimizer([{"params": []}], torch.optim.AdamW),
        "not an optimizer": lambda: ShardedOptimizer(model.parameters(), nn.Linear),
        "an instance": lambda: ShardedOptimizer(
            model.parameters(), torch.optim.SGD(model.parameters())
        ),
        "one parameter fewer on rank 0": lambda: ShardedOptimizer(
            list(model.parameters())[dist.get_rank() == 0 :], torch.optim.AdamW
        ),
    }
    for case, make in cases.items():
        try:
            make()
        except (TypeError, ValueError) as error:
            found[case] = f"{type(error).__name__}: {error}"
    return found


def everything() -> dict:
    """Rank function: every check at this world size, in one launch."""
    torch.set_num_threads(1)  # a tiny model: intra-op threads only contend on a busy machine
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {"errors": bad_input_errors()}
    for name in OPTIMIZERS:
        model, sharded = train(name, "sharded")
        plain_model, plain = train(name, "plain")
        out[name] = {
            "sharded": weights(model),
            "plain": weights(plain_model),
            "ddp sharded": weights(train(name, "sharded", ddp=True)[0]),
            "ddp torch zero": weights(train(name, "torch zero", ddp=True)[0]),
            "state bytes": optimizer_state_bytes(sharded),
            "memory per rank": sharded.memory_per_rank(),
            "plain state bytes": optimizer_state_bytes(plain),
            "plain bytes per param": per_param_state_bytes(plain, plain_model),
            "mine": sorted(n for n, p in model.named_parameters() if sharded.owner[p] == rank),
            **save_and_resume(name),
        }
    torch_zero = make_optimizer("adamw", make_model(), "torch zero")
    index = {p: i for i, p in enumerate(p for g in torch_zero.param_groups for p in g["params"])}
    theirs = torch_zero.optim.param_groups  # its wrapped optimizer, over this rank's parameters
    out["torch zero owns"] = sorted(index[p] for g in theirs for p in g["params"])
    index = {p: i for i, p in enumerate(p for g in sharded.param_groups for p in g["params"])}
    out["we own"] = sorted(index[p] for p in sharded.partition[rank])
    model, (cls, kwargs) = make_model(), OPTIMIZERS["adamw"]
    late = ShardedOptimizer(named_groups(model)[:1], cls, **kwargs)
    late.add_param_group(named_groups(model)[1])  # the biases' group added afterwards
    out["add_param_group"] = weights(train("adamw", "sharded", model=model, optimizer=late)[0])
    out["schedule"] = {
        kind: weights(train("adamw", kind, schedule=True)[0]) for kind in ("sharded", "plain")
    }
    # a subgroup whose group ranks are not its global ranks: [1, 2] or [1, 3]
    members = [1, world - 1]
    subgroup = dist.new_group(members) if world >= 3 else None  # every rank calls new_group
    if rank in members and subgroup is not None:
        out["subgroup"] = {
            kind: weights(train("adafactor", kind, group=subgroup)[0])
            for kind in ("sharded", "plain")
        }
    # a model with fewer parameters than ranks: some ranks own nothing, and still step
    torch.manual_seed(1)
    small = nn.Linear(3, 2).double()
    out["small before"] = small.weight.detach().clone()
    few = ShardedOptimizer(small.parameters(), torch.optim.AdamW, lr=0.1)
    small(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    out["closure loss"] = few.step(lambda: 1.5)
    out["small owns"] = [len(part) for part in few.partition]
    out["small after"] = small.weight.detach().clone()
    return out


@functools.cache
def results(world_size: int) -> list[dict]:
    return run(everything, world_size, timeout=180)


def assert_same(got: dict, want: dict, msg: str, tolerance: dict = EXACT) -> None:
    assert got.keys() == want.keys(), msg
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance, msg=f"{msg}: {name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_equals_unsharded_torch_zero_and_single_process(world_size):
    reference = results(1)[0]  # one process on the global batch
    for rank, got in enumerate(results(world_size)):
        for name in OPTIMIZERS:
            r = got[name]
            assert_same(r["sharded"], r["plain"], f"{name}, rank {rank}: vs unsharded")
            assert_same(r["ddp sharded"], r["ddp torch zero"], f"{name}, rank {rank}: vs torch")
            for run_ in ("sharded", "ddp sharded"):
                want = reference[name]["plain"]
                assert_same(r[run_], want, f"{name} {run_}: vs one process", CLOSE)
            start = make_model()
            assert not torch.equal(r["sharded"]["hidden.weight"], start.hidden.weight)
            assert torch.equal(r["sharded"]["norm.weight"], start.norm.weight)  # frozen
        assert_same(got["add_param_group"], got["adamw"]["plain"], "add_param_group")
        assert_same(got["schedule"]["sharded"], got["schedule"]["plain"], "schedule")
        scheduled, constant = got["schedule"]["sharded"], got["adamw"]["sharded"]
        changed = scheduled["hidden.weight"] - constant["hidden.weight"]
        assert changed.abs().max() > 1e-4  # the schedule really changed the run


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_holds_only_its_partition_of_the_state(world_size):
    ranks = results(world_size)
    for name in OPTIMIZERS:
        plain = ranks[0][name]
        per_param = plain["plain bytes per param"]
        total = plain["plain state bytes"]
        assert total == sum(per_param.values()) > 0
        held = [r[name]["state bytes"] for r in ranks]
        assert all(r[name]["memory per rank"] == held for r in ranks)
        assert sum(held) == total  # every parameter's state is on exactly one rank
        for r in ranks:  # exactly the state of the parameters it owns
            assert r[name]["state bytes"] == sum(per_param[n] for n in r[name]["mine"])
        owned = sorted(n for r in ranks for n in r[name]["mine"])
        assert owned == sorted(per_param)  # each parameter owned once, the tied one included
        # whole parameters: at most the average plus one largest parameter's state
        assert max(held) <= total / world_size + max(per_param.values())
        if world_size > 1:
            assert max(held) < total
    # the partition is torch's ZeroRedundancyOptimizer's
    assert [r["we own"] for r in ranks] == [r["torch zero owns"] for r in ranks]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_round_trip(world_size):
    for rank, got in enumerate(results(world_size)):
        for name in OPTIMIZERS:
            r = got[name]
            for how in ("sharded -> sharded", "sharded -> plain", "plain -> sharded"):
                assert_same(r[how], r["sharded"], f"{name}, rank {rank}: {how}")
            # the consolidated state dict is the plain optimizer's, as torch.optim writes it
            ours, theirs = r["saved"], r["saved by plain"]
            assert sorted(ours["state"]) == sorted(theirs["state"])  # the frozen one has none
            for index, state in theirs["state"].items():
                assert ours["state"][index].keys() == state.keys()
                for key, value in state.items():
                    torch.testing.assert_close(ours["state"][index][key], value, **EXACT)
            assert [g["param_names"] for g in ours["param_groups"]] == NAMES  # tied: once
            unnamed = [
                {k: v for k, v in g.items() if k != "param_names"} for g in ours["param_groups"]
            ]
            assert unnamed == theirs["param_groups"]
            assert "call consolidate_state_dict(to=" in r["stale"]


@pytest.mark.parametrize("world_size", [3, 4])
def test_subgroup_and_ranks_that_own_nothing(world_size):
    ranks = results(world_size)
    members = [1, world_size - 1]
    for rank, got in enumerate(ranks):
        assert ("subgroup" in got) == (rank in members)
        if rank in members:
            assert_same(got["subgroup"]["sharded"], got["subgroup"]["plain"], "subgroup")
        assert got["small owns"] == [1, 1] + [0] * (world_size - 2)
        assert got["closure loss"] == 1.5
        torch.testing.assert_close(got["small after"], ranks[0]["small after"], rtol=0, atol=0)
        assert not torch.equal(got["small after"], got["small before"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_input_gives_clear_errors(world_size):
    for got in results(world_size):
        errors = got["errors"]
        assert "empty parameter list" in errors["empty list"]
        assert "empty parameter list" in errors["empty groups"]
        assert errors["not an optimizer"].startswith("TypeError: optimizer_class must be")
        assert "not an instance" in errors["an instance"]
        assert "rank 1 passed 6, rank 0 passed 5" in errors["one parameter fewer on rank 0"]


def _different_shape_on_rank_2():
    model = make_model()
    if dist.get_rank() == 2:
        model.hidden = nn.Linear(DIM, DIM + 1).double()
    ShardedOptimizer(named_groups(model), torch.optim.AdamW)


def test_different_parameters_across_ranks_is_a_rank_error_not_a_hang():
    with pytest.raises(RankError) as caught:
        run(_different_shape_on_rank_2, 3, timeout=30)  # a hang would be RankTimeoutError
    message = str(caught.value)
    assert "on rank 2, parameter 1 ('hidden.weight') is float64 [7, 6] in group 0" in message
    assert "on rank 0 it is float64 [6, 6]" in message


def test_partition_is_sorted_greedy_as_torch():
    """Largest first to the least-loaded rank; the loads carry over from group to group."""
    assert partition_parameters([[66, 36], [6, 6, 6, 11]], 4) == [[0, 1], [3, 3, 2, 2]]
    assert partition_parameters([[66, 36], [6, 6, 6, 11]], 3) == [[0, 1], [2, 2, 2, 2]]
    assert partition_parameters([[5, 5, 5]], 2) == [[0, 1, 0]]
    assert partition_parameters([[4]], 3) == [[0]]
    with pytest.raises(ValueError):
        partition_parameters([[4]], 0)


def test_adafactor_is_not_elementwise():
    """Why whole parameters: Adafactor stepped on two halves of a matrix is not Adafactor on
    the matrix (its row and column statistics and its RMS clipping span the whole tensor)."""
    g = torch.Generator().manual_seed(3)
    start, grad = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    whole = nn.Parameter(start.clone())
    halves = [nn.Parameter(start[:2].clone()), nn.Parameter(start[2:].clone())]
    whole.grad, halves[0].grad, halves[1].grad = grad.clone(), grad[:2].clone(), grad[2:].clone()
    torch.optim.Adafactor([whole], lr=0.1).step()
    torch.optim.Adafactor(halves, lr=0.1).step()
    assert (torch.cat([h.detach() for h in halves]) - whole.detach()).abs().max() > 1e-3
