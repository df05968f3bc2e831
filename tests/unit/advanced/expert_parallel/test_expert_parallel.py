"""dmlbook.advanced.expert_parallel (moe, layer): the router's top-k, capacity, dropped tokens and
auxiliary loss; expert parallelism over all-to-all equals the single-process MoE with the same
weights and routing at world sizes 1-4 with uneven token counts per rank (outputs, input, expert
and router gradients, three SGD steps; float64 to 1e-12), and so does the MoE char-GPT; experts
that do not divide and token widths that differ across ranks raise ValueError naming them, on
every rank, with no hang; tokens per expert plot."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_checks import by_world, caught

from dmlbook import viz
from dmlbook.advanced import expert_parallel as ep
from dmlbook.advanced.expert_parallel import moe as moe_lib
from dmlbook.comm.groups import group_rank_size
from dmlbook.launch import RankError, run
from dmlbook.models import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

C, EXPERTS, TOP_K, AUX = 8, 12, 2, 0.1  # 12 experts divide by 1, 2, 3 and 4 ranks
TOL = 1e-12


def make_moe(capacity_factor=1.0) -> moe_lib.MoEFeedForward:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1, n_embd=C, n_head=1)
    return moe_lib.MoEFeedForward(config, EXPERTS, TOP_K, capacity_factor).double()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's tokens (2, 5 + rank, C): a different number on every rank, and output weights."""
    g = torch.Generator().manual_seed(10 + rank)
    shape = (2, 5 + rank, C)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(
        shape, generator=g, dtype=torch.float64
    )


def _err(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _checks() -> dict:
    rank, world = group_rank_size()
    out: dict = {"errors": {}}
    errors = out["errors"]
    reference, layer = make_moe(), ep.ExpertParallelMoE.from_moe(make_moe())
    start, stop = layer.expert_range
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(3):
        # The single process: every rank's tokens, each rank's group routed on its own.
        ref_opt.zero_grad()
        xs = [batch(r)[0].requires_grad_() for r in range(world)]
        ref_out = []
        for r in range(world):
            ref_out.append(reference(xs[r]))
            loss = (ref_out[-1] * batch(r)[1]).sum() + AUX * reference.last_routing.aux_loss
            loss.backward()
            if r == rank:
                ref_routing = reference.last_routing
        # Expert parallel: this rank's tokens only.
        opt.zero_grad()
        x, w = batch(rank)
        x.requires_grad_()
        y = layer(x)
        ((y * w).sum() + AUX * layer.last_routing.aux_loss).backward()
        for p in layer.router.parameters():  # replicated: sum over the ranks' tokens
            if world > 1:
                dist.all_reduce(p.grad)
        errors[f"output {step}"] = _err(y, ref_out[rank])
        errors[f"input grad {step}"] = _err(x.grad, xs[rank].grad)
        mine = list(layer.parameters())
        theirs = list(reference.router.parameters())
        for e in range(start, stop):
            theirs += list(reference.experts[e].parameters())
        errors[f"grads {step}"] = max(
            _err(a.grad, b.grad) for a, b in zip(mine, theirs, strict=True)
        )
        errors[f"weights {step}"] = max(_err(a, b) for a, b in zip(mine, theirs, strict=True))
        out.setdefault("dropped", []).append((layer.last_routing.dropped, ref_routing.dropped))
        ref_opt.step()
        opt.step()
    out["routed"] = layer.last_routing.routed_per_expert.tolist()
    out["capacity"] = layer.last_routing.capacity
    out["char_gpt"] = _char_gpt(rank, world)
    if world > 1:
        bad = make_moe()
        bad.experts = bad.experts[: world + 1]  # never divisible by world >= 2
        out["bad_experts"] = caught(lambda: ep.ExpertParallelMoE.from_moe(bad))
        x = torch.zeros(2, 3, C + (rank == world - 1), dtype=torch.float64)
        out["bad_width"] = caught(lambda: layer(x))
        check = torch.ones(1)
        dist.all_reduce(check)
        out["after_errors"] = check.item()
    return out


def _char_gpt(rank: int, world: int) -> float:
    """The MoE char-GPT, expert-parallel, against the same model in one process: losses and
    every gradient (replicated ones summed over the ranks)."""

    def model():
        return moe_lib.moe_char_gpt(
            16, seed=0, n_experts=EXPERTS, n_layer=2, n_embd=C, n_head=2, block_size=8
        ).double()

    reference, parallel = model(), ep.apply_expert_parallel(model())
    idx = [
        torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(r))
        for r in range(world)
    ]
    ref_losses = []
    for r in range(world):
        _, loss = reference(idx[r], idx[r].roll(-1, 1))
        loss = loss + 0.01 * moe_lib.moe_aux_loss(reference)
        loss.backward()
        ref_losses.append(loss.detach())
    _, loss = parallel(idx[rank], idx[rank].roll(-1, 1))
    loss = loss + 0.01 * moe_lib.moe_aux_loss(parallel)
    loss.backward()
    worst = _err(loss.detach(), ref_losses[rank])
    ref_params = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        if ".experts." in name:  # local expert i is global expert start + i
            block, local, rest = (
                name.split(".experts.")[0],
                *name.split(".experts.")[1].split(".", 1),
            )
            start = parallel.get_submodule(block).expert_range[0]
            ref = ref_params[f"{block}.experts.{start + int(local)}.{rest}"]
        else:
            ref = ref_params[name]
            if world > 1:
                dist.all_reduce(p.grad)
        worst = max(worst, _err(p.grad, ref.grad))
    return worst


results = by_world(_checks, timeout=90)


WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_expert_parallel_equals_the_single_process_moe(world):
    for rank, r in enumerate(results(world)):
        bad = {k: e for k, e in r["errors"].items() if not e <= TOL}
        assert not bad, f"rank {rank} of {world}: {bad}"
        assert len(r["errors"]) == 12  # output, input grad, grads, weights at 3 steps
        assert all(mine == theirs for mine, theirs in r["dropped"])
        assert sum(mine for mine, _ in r["dropped"]) > 0  # capacity factor 1.0 drops some


@pytest.mark.parametrize("world", WORLDS)
def test_moe_char_gpt_expert_parallel_equals_one_process(world):
    for r in results(world):
        assert r["char_gpt"] <= TOL


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bad_sizes_raise_on_every_rank(world):
    for r in results(world):
        assert f"experts={world + 1} is not divisible by the {world} ranks" in r["bad_experts"]
        assert f"rank {world - 1}: {C + 1}" in r["bad_width"] and "n_embd" in r["bad_width"]
        assert r["after_errors"] == world


def _mismatched_width() -> None:
    x = torch.zeros(2, 3, C + dist.get_rank(), dtype=torch.float64)
    ep.ExpertParallelMoE.from_moe(make_moe())(x)


def test_mismatched_width_is_a_rank_error_not_a_hang():
    with pytest.raises(RankError, match=r"n_embd rank 0: 8, rank 1: 9"):
        run(_mismatched_width, 2, timeout=30)


def test_router_top_k_capacity_and_dropped_tokens():
    moe = make_moe(capacity_factor=1.0)
    x = batch(0)[0]  # 10 tokens, 2 choices each, 12 experts: capacity ceil(20 / 12) = 2
    moe(x)
    routing = moe.last_routing
    assert routing.capacity == 2 == moe_lib.expert_capacity(10, 12, 2, 1.0)
    assert routing.routed_per_expert.sum() == 20
    kept = routing.kept_per_expert
    assert routing.dropped == 20 - kept.sum() == (routing.routed_per_expert - 2).clamp(min=0).sum()
    assert routing.expert.shape == routing.weight.shape == routing.kept.shape == (10, 2)
    assert torch.allclose(routing.weight.sum(-1), torch.ones(10, dtype=torch.float64))
    # No capacity limit: nothing dropped, and the output is the gate-weighted sum of k experts.
    moe.router.capacity_factor = None
    y = moe(x)
    assert moe.last_routing.dropped == 0
    tokens = x.reshape(-1, C)
    r = moe.last_routing
    expected = torch.stack([
        sum(r.weight[t, c] * moe.experts[int(r.expert[t, c])](tokens[t]) for c in range(TOP_K))
        for t in range(len(tokens))
    ])  # fmt: skip
    assert _err(y.reshape(-1, C), expected) <= TOL


def test_aux_loss_is_one_when_balanced_and_larger_when_not():
    router = moe_lib.Router(4, 4, top_k=1, capacity_factor=None).double()
    with torch.no_grad():
        router.gate.weight.zero_()  # uniform probabilities: P_e = 1/4
    tokens = torch.eye(4, dtype=torch.float64)
    # Uniform P makes E * sum_e f_e P_e = sum_e f_e = 1 whatever the (tied) choices f are ...
    assert abs(router(tokens).aux_loss.item() - 1.0) < TOL
    # ... and a gate that sends every token to expert 0 with high probability raises it.
    with torch.no_grad():
        router.gate.weight[0] = 5.0
    assert router(tokens).aux_loss.item() > 1.5


def test_bad_router_arguments():
    with pytest.raises(ValueError, match="top_k must be between 1 and experts=4"):
        moe_lib.Router(8, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        moe_lib.Router(8, 4, capacity_factor=0)
    with pytest.raises(ValueError, match="tokens have n_embd=3, the experts take 8"):
        make_moe()(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="no MoE layer has run"):
        moe_lib.moe_aux_loss(make_moe())


def test_tokens_per_expert_plot(artifacts):
    r = results(2)[0]
    ax = viz.expert_load(r["routed"], r["capacity"], title="tokens per expert, rank 0")
    heights = [p.get_height() for p in ax.patches]
    kept, dropped = heights[:EXPERTS], heights[EXPERTS:]
    assert kept == [min(n, r["capacity"]) for n in r["routed"]]
    assert dropped == [max(0, n - r["capacity"]) for n in r["routed"]]
    ax.figure.savefig(artifacts("expert_load.png"))
