"""dmlbook.advanced.tensor_parallel.sequence_parallel: at TP = 1-4 the char-GPT with tensor +
sequence parallelism (SEQUENCE_PARALLEL_PLAN on the unmodified model) equals plain tensor
parallelism: loss, every gradient and three Adam steps (float64 to 1e-10); each block's
all-reduce becomes a reduce-scatter and an all-gather; the styles equal torch's DTensor
SequenceParallel / ColwiseParallel(input_layouts=Shard(1)) /
RowwiseParallel(output_layouts=Shard(1)); the bytes a block saves for backward, measured, equal
the formula (TP: replicated + split / t; SP: all / t); a sequence length that does not divide
raises ValueError naming it, on every rank, no hang; a sequence split differently on two ranks,
a dtype that differs, a batch that differs where only backward communicates (world 2 and 3), and
the issue's held-out step with a batch of 2 on rank 0 and 3 on rank 1 are each the same ValueError
on every rank, naming the operator, the pass and every rank's shape, instead of a gloo abort; run()
raises the last in the caller, naming the rank, within its timeout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_checks import by_world, caught
from torch import nn

from dmlbook.advanced import tensor_parallel as tp
from dmlbook.advanced.composition.plan import apply_plan, tensor_parallel_char_gpt
from dmlbook.advanced.tensor_parallel import sequence_parallel as sp
from dmlbook.comm.groups import group_rank_size
from dmlbook.launch import RankError, run
from dmlbook.model_parallel.memory.spec import spec_of
from dmlbook.models import char_gpt
from tests.unit.advanced.tensor_parallel.test_tensor_parallel import (
    one_message_on_every_rank,
    rank_shapes,
)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, C, HEADS, SEQ, BATCH, LAYERS = 24, 24, 12, 12, 3, 2  # all divide by 1, 2, 3 and 4
TOL = 1e-10


def reference_gpt(dtype=torch.float64):
    return char_gpt(VOCAB, seed=0, n_layer=LAYERS, n_head=HEADS, n_embd=C, block_size=SEQ).to(dtype)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _checks() -> dict:
    rank, world = group_rank_size()
    out: dict = {}
    model = reference_gpt()
    tp_model, sp_model = tensor_parallel_char_gpt(model), sp.sequence_parallel_char_gpt(model)
    out["same_parameters"] = list(dict(tp_model.named_parameters())) == list(
        dict(sp_model.named_parameters())
    )
    # Loss and every gradient, and what each communicates.
    idx, targets = _data(0)
    with tp.counting() as tp_comms:
        _, loss_tp = tp_model(idx, targets)
        loss_tp.backward()
    with tp.counting() as sp_comms:
        _, loss_sp = sp_model(idx, targets)
        loss_sp.backward()
    grads = [
        _err(p.grad, q.grad)
        for p, q in zip(tp_model.parameters(), sp_model.parameters(), strict=True)
    ]
    out["forward_error"], out["grad_error"] = _err(loss_tp, loss_sp), max(grads)
    out["comms"] = {
        name: [(c.op, c.direction, c.nbytes) for c in comms if c.nbytes > 4 * 2 * C]
        for name, comms in (("tp", tp_comms), ("sp", sp_comms))
    }  # the activations' collectives, not the LayerNorm weights' gradients
    # Three Adam steps from the same start.
    tp_model, sp_model = tensor_parallel_char_gpt(model), sp.sequence_parallel_char_gpt(model)
    losses = []
    for m in (tp_model, sp_model):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        curve = []
        for step in range(3):
            opt.zero_grad()
            _, loss = m(*_data(step))
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    out["train_loss_error"] = max(abs(a - b) for a, b in zip(*losses, strict=True))
    out["train_weight_error"] = max(
        _err(p, q) for p, q in zip(tp_model.parameters(), sp_model.parameters(), strict=True)
    )
    # Activation memory of one block, measured, against the formula (float32).
    model32 = reference_gpt(torch.float32)
    x = torch.randn(BATCH, SEQ, C, generator=torch.Generator().manual_seed(3))
    tp_block = tensor_parallel_char_gpt(model32).blocks[0]
    sp_block = sp.sequence_parallel_char_gpt(model32).blocks[0]
    mine = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    out["memory"] = {
        "tp": sp.measure_block_activations(tp_block, x.clone().requires_grad_()),
        "sp": sp.measure_block_activations(sp_block, x[:, mine].clone().requires_grad_()),
        "single": sp.measure_block_activations(model32.blocks[0], x.clone().requires_grad_()),
    }
    if world == 2:  # DTensor's import costs seconds per rank: checked at one size
        out["dtensor_error"] = _against_dtensor()
    # A sequence length that does not divide: the same error on every rank, then still in step.
    try:
        sp_model(idx[:, : SEQ - 1], targets[:, : SEQ - 1])
        out["bad_length"] = "no error"
    except ValueError as error:
        out["bad_length"] = str(error)
    if world > 1:  # a sequence split differently on rank 1: every SP collective refuses it
        block = torch.ones(BATCH, 2 + (rank == 1), C, dtype=torch.float64)
        whole = torch.ones(BATCH, world * 2 + (rank == 1), C, dtype=torch.float64)
        # a batch of 3 on rank 1, whose gradient only backward sends (scattering is local)
        batch = torch.ones(BATCH + (rank == 1), SEQ, C, dtype=torch.float64, requires_grad=True)
        out["mismatch"] = {
            "gather": caught(lambda: sp.gather_from_sequence_parallel(block)),
            "reduce_scatter": caught(lambda: sp.reduce_scatter_to_sequence_parallel(whole)),
            "linear": caught(lambda: sp_model.blocks[0].mlp.c_fc(block)),
            "dtype": caught(
                lambda: sp.gather_from_sequence_parallel(block[:, :2].to(DTYPES[rank]))
            ),
            "backward": caught(lambda: sp.scatter_to_sequence_parallel(batch).sum().backward()),
        }
        out["held_out"] = caught(lambda: _held_out(sp_model))
    check = torch.ones(1)
    if world > 1:
        dist.all_reduce(check)
    out["after_errors"] = check.item()
    return out


DTYPES = {0: torch.float64, 1: torch.float32, 2: torch.float64, 3: torch.float64}


def _held_out(sp_model: nn.Module) -> None:
    """The issue's case: a batch of 2 on rank 0 and 3 on rank 1 (2 on any other), a training
    step of the TP + SP char-GPT (it aborted the process inside gloo before the check)."""
    rank, _ = group_rank_size()
    idx, targets = _data(rank)
    rows = 3 if rank == 1 else 2
    _, loss = sp_model(idx[:rows], targets[:rows])
    loss.backward()


def _held_out_uncaught() -> None:
    """The same, with nothing to catch the error: run() must raise it in the caller."""
    _held_out(sp.sequence_parallel_char_gpt(reference_gpt()))


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))
    with torch.no_grad():  # LayerNorm's weights away from 1 and 0, so that their grads matter
        block[0].weight.normal_()
        block[0].bias.normal_()
    return block.double()


def _against_dtensor() -> float:
    """Our styles and torch's on the same LayerNorm + MLP, the input a sequence block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    rank, world = group_rank_size()
    ours = apply_plan(
        _block(),
        {
            "0": sp.SequenceParallel(),
            "1": sp.ColwiseSequenceParallel(),
            "3": sp.RowwiseSequenceParallel(),
        },
    )
    theirs = parallelize_module(
        _block(),
        init_device_mesh("cpu", (world,)),
        {
            "0": SequenceParallel(),
            "1": ColwiseParallel(input_layouts=Shard(1)),
            "3": RowwiseParallel(output_layouts=Shard(1)),
        },
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, C, generator=g, dtype=torch.float64)
    block = x[:, rank * SEQ // world : (rank + 1) * SEQ // world]
    xo, xt = block.clone().requires_grad_(), block.clone().requires_grad_()
    yo, yt = ours(xo), theirs(xt)
    w = torch.randn(yo.shape, generator=g, dtype=torch.float64)
    (yo * w).sum().backward()
    (yt * w).sum().backward()
    errors = [_err(yo, yt), _err(xo.grad, xt.grad)]
    out_partial = []
    for name, p in ours.named_parameters():
        q = theirs.get_parameter(name)
        # torch leaves the replicated LayerNorm weights' gradients Partial (each rank's share,
        # summed when read whole); ours are summed in backward.
        partial = q.grad.placements[0].is_partial()
        errors += [
            _err(p, q.to_local()),
            _err(p.grad, (q.grad.full_tensor() if partial else q.grad.to_local())),
        ]
        out_partial.append(partial)
    assert len(errors) == 2 + 2 * 6
    assert out_partial == [True, True, False, False, False, False]  # LayerNorm, then linears
    return max(errors)


results = by_world(_checks, timeout=120)


WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_sequence_parallel_equals_tensor_parallel(world):
    for r in results(world):
        assert r["same_parameters"]
        assert r["forward_error"] <= TOL and r["grad_error"] <= TOL, r
        assert r["train_loss_error"] <= TOL and r["train_weight_error"] <= TOL, r


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather(world):
    comms = results(world)[0]["comms"]
    block = BATCH * SEQ * C * 8  # one (B, T, C) float64 activation
    tp_forward = [c for c in comms["tp"] if c[1] == "forward" and c[2] == block]
    sp_forward = [c for c in comms["sp"] if c[1] == "forward" and c[2] in (block, block // world)]
    # plain TP: the embedding's and each block's two all-reduces of the whole activation
    assert [c[0] for c in tp_forward] == ["all_reduce"] * (1 + 2 * LAYERS)
    # SP: the embedding's all-reduce, then per block half two all-gathers of a sequence block in
    # and a reduce-scatter out, then lm_head's all-gather
    per_half = [("all_gather", block // world), ("reduce_scatter", block)]
    assert [(c[0], c[2]) for c in sp_forward] == [("all_reduce", block)] + per_half * (
        2 * LAYERS
    ) + [("all_gather", block // world)]


def test_styles_equal_dtensor_sequence_parallel():
    for r in results(2):
        assert r["dtensor_error"] <= TOL


@pytest.mark.parametrize("world", WORLDS)
def test_activation_memory_per_rank_equals_the_formula(world):
    spec = spec_of(reference_gpt(torch.float32))
    for r in results(world):
        memory = r["memory"]
        assert memory["single"] == sp.activation_bytes_per_rank(spec, BATCH, SEQ, 1, False)
        assert memory["tp"] == sp.activation_bytes_per_rank(spec, BATCH, SEQ, world, False)
        assert memory["sp"] == sp.activation_bytes_per_rank(spec, BATCH, SEQ, world, True)
        assert memory["sp"] * world == memory["single"]  # everything divided by t
        if world > 1:
            assert memory["sp"] < memory["tp"] < memory["single"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sequence_length_that_does_not_divide_is_refused_on_every_rank(world):
    for r in results(world):
        message = r["bad_length"]
        assert f"sequence length={SEQ - 1} is not divisible by the {world} ranks" in message
        assert r["after_errors"] == world


@pytest.mark.parametrize("world", [2, 3])
def test_a_sequence_split_differently_on_two_ranks_is_a_value_error_on_every_rank(world):
    mismatch = {
        key: [r["mismatch"][key] for r in results(world)] for key in results(world)[0]["mismatch"]
    }
    blocks = rank_shapes(world, lambda r: (BATCH, 3 if r == 1 else 2, C))
    wholes = rank_shapes(world, lambda r: (BATCH, 2 * world + (r == 1), C), dtype_of=None)
    gather = "sequence-parallel all-gather (forward): "
    one_message_on_every_rank(mismatch["gather"], gather, blocks)
    one_message_on_every_rank(mismatch["linear"], gather, blocks)
    one_message_on_every_rank(
        mismatch["reduce_scatter"], "sequence-parallel reduce-scatter (forward): ", wholes
    )
    dtypes = rank_shapes(world, lambda r: (BATCH, 2, C), lambda r: DTYPES[r])
    one_message_on_every_rank(mismatch["dtype"], gather, dtypes)
    batches = rank_shapes(world, lambda r: (BATCH + (r == 1), SEQ // world, C))
    one_message_on_every_rank(
        mismatch["backward"], "sequence-parallel all-gather (backward): ", batches
    )
    assert all(r["after_errors"] == world for r in results(world))  # the ranks are still in step


@pytest.mark.parametrize("world", [2, 3])
def test_the_issue_s_batch_of_2_and_3_is_a_value_error_on_every_rank(world):
    """Held out in issue 38: batches of 2 and 3 aborted a rank inside gloo. Now the embedding's
    all-reduce, the step's first collective, refuses them on every rank; uncaught, run() raises
    that error in the caller, naming the rank, well within its timeout (no hang, no abort)."""
    shapes = rank_shapes(world, lambda r: (3 if r == 1 else 2, SEQ, C))
    prefix = "tensor-parallel all-reduce (forward): "
    message = one_message_on_every_rank([r["held_out"] for r in results(world)], prefix, shapes)
    with pytest.raises(RankError) as caught_in_caller:
        run(_held_out_uncaught, world, timeout=30)
    error = caught_in_caller.value
    assert error.rank in range(world), error
    assert str(error).splitlines()[0] == f"rank {error.rank} failed first: ValueError: {message}"


def test_dropout_is_refused_and_formula_checks_sizes():
    with pytest.raises(ValueError, match="dropout=0.0"):
        sp.sequence_parallel_char_gpt(char_gpt(VOCAB, seed=0, dropout=0.1))
    spec = spec_of(reference_gpt())
    with pytest.raises(ValueError, match="sequence length=7 is not divisible by tp_size=2"):
        sp.activation_bytes_per_rank(spec, 2, 7, 2, True)
