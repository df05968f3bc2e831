"""Tests for dmlbook.model_parallel.stage_balancing: the linear-partition DP equals brute force
over every contiguous split and an independent bisection method (torch.distributed.pipelining has no
balancer to compare with); the pipeline-time formula equals a simulated flow shop; layer costs
are measured for every layer, with bytes in closed form."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from torch import nn

from dmlbook.model_parallel import stage_balancing as sb
from dmlbook.models import char_gpt, mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_force_bottleneck(costs, stages) -> float:
    """The smallest largest-stage cost over every way to cut the layers into contiguous stages."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        counts = [b - a for a, b in itertools.pairwise(bounds)]
        best = min(best, max(sb.stage_costs(costs, counts)))
    return best


def random_costs(rng: random.Random, n: int) -> list[float]:
    kind = rng.choice(["float", "small ints", "zeros and spikes"])
    if kind == "float":
        return [rng.uniform(0, 10) for _ in range(n)]
    if kind == "small ints":  # many ties
        return [float(rng.randint(0, 3)) for _ in range(n)]
    return [rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 100)]) for _ in range(n)]


def check_partition(costs, stages, counts) -> None:
    assert len(counts) == stages and sum(counts) == len(costs) and min(counts) >= 1, counts


def test_dp_and_bisection_equal_brute_force_on_many_random_cost_vectors():
    rng = random.Random(7)
    cases = 0
    for n in range(1, 10):
        for _ in range(25):
            costs = random_costs(rng, n)
            for stages in sorted({1, n, rng.randint(1, n)}):
                want = brute_force_bottleneck(costs, stages)
                for method in (sb.linear_partition, sb.partition_by_bisection):
                    counts = method(costs, stages)
                    check_partition(costs, stages, counts)
                    assert max(sb.stage_costs(costs, counts)) == want, (method, costs, stages)
                cases += 1
    assert cases > 400


def test_the_best_two_stage_split_is_the_dp_with_two_stages():
    rng = random.Random(3)
    for n in range(2, 10):
        for _ in range(20):
            costs = random_costs(rng, n)
            counts = sb.best_two_stage_split(costs)
            check_partition(costs, 2, counts)
            assert max(sb.stage_costs(costs, counts)) == brute_force_bottleneck(costs, 2)
    assert sb.best_two_stage_split([100, 1, 1, 1, 1]) == [1, 4]
    with pytest.raises(ValueError, match="cannot split 1 layers into 2 stages"):
        sb.best_two_stage_split([1.0])


def test_known_partitions():
    assert sb.linear_partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17
    assert sb.linear_partition([100, 1, 1, 1, 1], 2) == [1, 4]
    assert sb.linear_partition([1, 1, 1, 1, 100], 2) == [4, 1]
    assert sb.linear_partition([5.0], 1) == [1]
    assert sb.linear_partition([0, 0, 0], 3) == [1, 1, 1]  # stages == n: one layer each
    assert sb.linear_partition([3, 1, 2], 1) == [3]
    assert sb.stage_costs([1, 2, 3, 4], [1, 3]) == [1, 9]


@pytest.mark.parametrize("method", [sb.linear_partition, sb.partition_by_bisection])
def test_bad_input_raises_valueerror(method):
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        method([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="stages must be an integer >= 1"):
        method([1.0, 2.0], 0)
    with pytest.raises(ValueError, match="costs is empty"):
        method([], 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        method([1.0, -2.0], 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        method([1.0, float("nan")], 1)
    with pytest.raises(ValueError, match="sum to the 3 layers"):
        sb.stage_costs([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match="positive"):
        sb.stage_costs([1, 2, 3], [3, 0])


def simulated_flow_shop(per_stage, microbatches) -> float:
    """Micro-batch k starts on stage s when it left stage s-1 and stage s finished k-1."""
    done = [0.0] * len(per_stage)  # when each stage finished its latest micro-batch
    for _ in range(microbatches):
        left = 0.0
        for s, cost in enumerate(per_stage):
            done[s] = max(done[s], left) + cost
            left = done[s]
    return done[-1]


def test_pipeline_time_equals_a_simulated_flow_shop():
    rng = random.Random(3)
    for _ in range(200):
        per_stage = [rng.uniform(0.1, 5) for _ in range(rng.randint(1, 6))]
        microbatches = rng.randint(1, 12)
        assert sb.pipeline_time(per_stage, microbatches) == pytest.approx(
            simulated_flow_shop(per_stage, microbatches)
        )
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        sb.pipeline_time([1.0], 0)


def test_measured_costs_cover_every_layer_and_leave_grads_alone():
    net = mlp(seed=0, in_features=16, hidden=(64, 8), out_features=4)
    layers = list(net.layers)
    x = torch.randn(32, 16)
    seconds = sb.measure_layer_costs(layers, x, repeats=3, warmup=1)
    assert len(seconds) == len(layers) and all(s > 0 for s in seconds)
    assert all(p.grad is None for p in net.parameters())
    gpt = char_gpt(11, seed=0, n_layer=2, n_embd=16, n_head=2, block_size=8)
    embed = _Lambda(gpt.embed, gpt.wte, gpt.wpe)  # takes token ids: no gradient for the input
    head = _Lambda(gpt.head, gpt.ln_f, gpt.lm_head)
    ids = torch.randint(0, 11, (4, 8))
    assert len(sb.measure_layer_costs([embed, *gpt.blocks, head], ids, repeats=2)) == 4
    with pytest.raises(ValueError, match="repeats >= 1"):
        sb.measure_layer_costs(layers, x, repeats=0)


def test_measured_costs_run_each_layer_as_its_stage_would():
    """The first layer's input is the data: no gradient for it, as on the first stage; every
    later layer's input is an activation whose gradient a stage must send back."""
    seen = []

    class Record(nn.Module):
        def forward(self, x):
            if torch.is_grad_enabled():  # not the no-grad pass that makes each layer's input
                seen.append(x.requires_grad)
            return 2 * x

    sb.measure_layer_costs([Record(), Record(), Record()], torch.randn(4, 3), repeats=1, warmup=0)
    assert seen == [False, True, True]


class _Lambda(nn.Module):
    def __init__(self, fn, *children):
        super().__init__()
        self.fn, self.children_ = fn, nn.ModuleList(children)

    def forward(self, x):
        return self.fn(x)


def test_measured_bytes_are_parameters_plus_saved_activations():
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)]
    x = torch.randn(32, 16)
    got = sb.measure_layer_bytes(layers, x)
    # Linear saves its input (for the weight gradient), ReLU its output; the second Linear's
    # input IS that output, one storage, counted once, for ReLU, which saved it first.
    assert got[0] == 2 * 4 * (16 * 64 + 64) + 4 * 32 * 16
    assert got[1] == 4 * 32 * 64
    assert got[2] == 2 * 4 * (64 * 4 + 4)
    four_copies = sb.measure_layer_bytes(layers, x, copies_of_parameters=4)[0]
    assert four_copies == 4 * 4 * (16 * 64 + 64) + 4 * 32 * 16


def test_measured_costs_on_the_cpu_clock():
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    costs = sb.measure_layer_costs(layers, torch.randn(8, 16), repeats=3, clock=time.thread_time)
    assert len(costs) == 3 and all(c >= 0 for c in costs)
