"""The one data-parallel loop (chapter 1): its callbacks fire in order, a fault reaches
``on_fault`` and the caller, and a weighted plan of unequal local batches equals one process."""

from pathlib import Path

import pytest
import torch

from dmlbook import data_parallel as dp
from dmlbook.data_parallel import checkpoint as ck
from dmlbook.datasets import make_classification
from dmlbook.launch import RankError, run
from dmlbook.models import mlp

SAMPLES, GLOBAL_BATCH, EPOCHS = 48, 12, 2  # 4 steps an epoch; 12 divides by 1, 2, 3 and 4


def _setup():
    x, y = make_classification(SAMPLES, dim=6, classes=3, seed=2)
    model = mlp(seed=0, in_features=6, hidden=(8,), out_features=3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), x, y


class Recorder(dp.Callback):
    """Writes down every event, with the step it saw."""

    def __init__(self):
        self.events = []

    def on_train_start(self, state):
        self.events.append(("start", state.step))

    def on_step_start(self, state):
        self.events.append(("step_start", state.step))

    def after_backward(self, state):
        assert all(p.grad is not None for p in state.model.parameters())
        self.events.append(("backward", state.step))

    def on_step(self, state):
        self.events.append(("step", state.step))

    def on_epoch(self, state):
        self.events.append(("epoch", state.batch.epoch))

    def on_checkpoint(self, state, path):
        self.events.append(("checkpoint", Path(path).name))

    def on_fault(self, state, error):
        self.events.append(("fault", str(error)))

    def on_train_end(self, state):
        self.events.append(("end", state.step))


def _recorded(directory, crash_at=None):
    model, opt, x, y = _setup()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    plan = dp.strided_batches(SAMPLES, GLOBAL_BATCH, rank=rank, world_size=world, epochs=EPOCHS)
    recorder = Recorder()
    saver = ck.Checkpointing(directory, every=3, epochs=EPOCHS)
    crash = [ck.SimulateCrash(crash_at, rank=world - 1)] if crash_at else []
    try:
        dp.train_loop(model, opt, x, y, plan, callbacks=[saver, recorder, *crash])
    except ck.SimulatedCrash:
        return recorder.events, "raised"
    return recorder.events, "done"


@pytest.mark.parametrize("world", [1, 3])
def test_callbacks_fire_in_order_with_the_checkpoints_and_the_epochs(world, tmp_path):
    for events, outcome in run(_recorded, world, str(tmp_path)):
        assert outcome == "done"
        steps = SAMPLES // GLOBAL_BATCH * EPOCHS
        want = [("start", 0)]
        for s in range(steps):
            want += [("step_start", s), ("backward", s)]
            # the saver's on_step runs first: every 3 steps, and after the last epoch
            if (s + 1) % 3 == 0 or s + 1 == steps:
                want.append(("checkpoint", f"step-{s + 1:08d}.pt"))
            want.append(("step", s + 1))
            if (s + 1) % (SAMPLES // GLOBAL_BATCH) == 0:
                want.append(("epoch", s // (SAMPLES // GLOBAL_BATCH)))
        assert events == [*want, ("end", steps)]


def test_a_fault_reaches_on_fault_then_the_caller(tmp_path):
    events, outcome = run(_recorded, 1, str(tmp_path), 5)[0]
    assert outcome == "raised"
    assert events[-1] == ("fault", "rank 0 crashed after step 5, as asked")
    assert ("step", 5) in events and ("step_start", 5) not in events


def _failing_rank():
    model, opt, x, y = _setup()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    plan = dp.strided_batches(SAMPLES, GLOBAL_BATCH, rank=rank, world_size=world, epochs=EPOCHS)
    dp.train_loop(model, opt, x, y, plan, callbacks=[ck.SimulateCrash(2, rank=2)])


def test_a_fault_on_one_rank_is_a_rank_error_naming_it():
    with pytest.raises(RankError, match="rank 2") as error:
        run(_failing_rank, 3, timeout=60)
    assert "rank 2 failed first: SimulatedCrash: rank 2 crashed after step 2" in str(error.value)


def _weighted(split):
    """Unequal local batches, each loss the rank's share of the global mean, gradients summed."""
    model, opt, x, y = _setup()
    rank = torch.distributed.get_rank()
    offset = sum(split[:rank])
    plan = [
        dp.LocalBatch(
            0, t, list(range(t * 12 + offset, t * 12 + offset + split[rank])), global_size=12
        )
        for t in range(4)
    ]
    dp.train_loop(model, opt, x, y, plan, sync=dp.GradientAveraging(divide_by=1))
    return [p.detach().clone() for p in model.parameters()]


def test_unequal_weighted_batches_equal_one_process_on_the_union():
    model, opt, x, y = _setup()
    plan = [dp.LocalBatch(0, t, list(range(t * 12, t * 12 + 12))) for t in range(4)]
    dp.train_loop(model, opt, x, y, plan)  # outside any group: one process
    want = [p.detach() for p in model.parameters()]
    for got in run(_weighted, 3, [2, 7, 3]):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_bad_plan_is_refused_before_training():
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        dp.strided_batches(SAMPLES, 10, rank=0, world_size=3, epochs=1)
    with pytest.raises(ValueError, match="larger than the 48 samples"):
        dp.strided_batches(SAMPLES, 60, rank=0, world_size=1, epochs=1)


# ---- the step hook, the reference trainer and tensor plans -------------------------------------


def _hand_loop(model, opt, batches):
    """The plain single-process loop the package's loop must equal, written out by hand."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_reference_trainer_is_the_plain_loop_on_tensor_batches():
    _, _, x, y = _setup()
    batches = [(x[t * 12 : (t + 1) * 12], y[t * 12 : (t + 1) * 12]) for t in range(4)]
    model = mlp(seed=0, in_features=6, hidden=(8,), out_features=3)
    want = _hand_loop(model, torch.optim.Adam(model.parameters(), lr=0.01), batches)
    make = lambda: mlp(seed=0, in_features=6, hidden=(8,), out_features=3)  # noqa: E731
    done = dp.train_reference(make, batches, lr=0.01, loss_fn=torch.nn.functional.cross_entropy)
    assert done.losses == want and done.step == 4  # the same arithmetic, bit for bit
    for got, ref in zip(done.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, ref)
    with pytest.raises(TypeError, match="pass a loss_fn"):  # an MLP brings no loss of its own
        dp.train_reference(make, batches, lr=0.01)


class _Doubled(dp.ForwardBackward):
    """A step hook: twice the loss, so twice the gradients (what a custom step may change)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, state, batch):
        self.calls.append((state.step, len(batch.inputs)))
        loss = 2 * self.loss(state, batch)
        loss.backward()
        return loss


def test_a_step_hook_replaces_the_forward_and_backward_and_keeps_the_callbacks():
    model, opt, x, y = _setup()
    hook, recorder = _Doubled(), Recorder()
    plan = [dp.LocalBatch(0, t, list(range(t * 12, t * 12 + 12))) for t in range(4)]
    done = dp.train_loop(model, opt, x, y, plan, callbacks=[recorder], forward_backward=hook)
    assert hook.calls == [(t, 12) for t in range(4)]  # once a step, on the step's rows
    assert [e for e in recorder.events if e[0] == "backward"] == [("backward", t) for t in range(4)]
    twice, _, _, _ = _setup()  # the plain loop at twice the learning rate: the same SGD steps
    _hand_loop(twice, torch.optim.SGD(twice.parameters(), lr=0.2),
               [(x[b.samples], y[b.samples]) for b in plan])  # fmt: skip
    for got, want in zip(done.model.parameters(), twice.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_hook_may_hold_no_loss_and_a_plan_of_indices_needs_the_data():
    model, opt, x, y = _setup()

    def no_loss(state, batch):  # e.g. a pipeline's first stage: gradients, but no loss
        torch.nn.functional.cross_entropy(state.model(batch.inputs), batch.targets).backward()

    done = dp.train_loop(model, opt, None, None, [(x[:12], y[:12])], forward_backward=no_loss)
    assert done.step == 1 and len(done.losses) == 1 and done.losses[0] != done.losses[0]  # nan
    with pytest.raises(ValueError, match="needs the data x and y"):
        dp.train_loop(model, opt, None, None, [dp.LocalBatch(0, 0, [0, 1])])
