"""Chapter 3's six-stage step computes what the one training loop computes, and times every
stage."""

import torch
import torch.distributed as dist

from dmlbook import data_parallel as dp
from dmlbook.data_parallel import stages
from dmlbook.datasets import load_digits
from dmlbook.launch import run
from dmlbook.notebook import digits_mlp


def six_stages_and_the_loop():
    x, y = load_digits("train")
    x, y = x[:320], y[:320]
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = digits_mlp()
    clock = stages.StageClock()
    stages.train_in_six_stages(ours, torch.optim.SGD(ours.parameters(), lr=0.1), x, y,
                               global_batch=64, epochs=2, clock=clock)  # fmt: skip
    loop = digits_mlp()
    plan = dp.strided_batches(len(x), 64, rank=rank, world_size=world, epochs=2)
    sync = type("PerParameter", (), {})()
    sync.after_backward = lambda model, step, group=None: dp.average_gradients_per_parameter(
        model, group
    )
    sync.after_step = sync.finish = lambda *args: None
    dp.train_loop(loop, torch.optim.SGD(loop.parameters(), lr=0.1), (x - x.mean()) / x.std(), y,
                  plan, sync=sync)  # fmt: skip
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), loop.parameters(), strict=True))
    return same, clock.seconds


def test_six_stages_equal_the_loop_and_time_every_stage():
    for same, seconds in run(six_stages_and_the_loop, 2):
        assert same
        assert set(seconds) == set(stages.STEP_STAGES) and all(s > 0 for s in seconds.values())
