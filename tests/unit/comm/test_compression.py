"""Chapter 4's gradient compression: each hook against its closed form and against torch's hooks,
error feedback loses nothing, and the measured wire bytes and digits accuracy of every scheme."""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dmlbook.comm import compression as c
from dmlbook.data_parallel import compression_experiment as experiment
from dmlbook.datasets import load_digits
from dmlbook.launch import run
from dmlbook.models import mlp

N = 1003  # bucket size: not a multiple of 8, so the last byte of packed signs is padded
STEPS = 3  # hook calls on the same bucket, so error feedback carries residuals between them


def loopback_sent() -> int | None:
    """Bytes sent so far on the loopback of this process's network namespace (the ranks have one
    of their own): ``/proc/net/dev`` is the reader's namespace's, where ``/sys/class/net`` is
    the one sysfs was mounted in. None where there is no such file."""
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return None
    for line in lines:
        name, counters = line.split(":", 1)
        if name.strip() == "lo":
            return int(counters.split()[8])  # receive: 8 counters, then transmit bytes
    return None


class FakeBucket:
    """The two methods of ``dist.GradBucket`` that the hooks use."""

    def __init__(self, buffer: torch.Tensor, index: int = 0) -> None:
        self._buffer, self._index = buffer, index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index


def _grad(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s gradient at ``step``, in closed form so that every rank can compute all of
    them: magnitudes spread over 4 decades, and some exact zeros."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    values = torch.randn(N, generator=g) * 10 ** torch.empty(N).uniform_(-3, 1, generator=g)
    values[::97] = 0.0
    return values


def _call(hook, state, grad: torch.Tensor) -> torch.Tensor:
    return hook(state, FakeBucket(grad.clone())).wait()


def _sign_sent(x: torch.Tensor) -> torch.Tensor:
    """What 1-bit sends for ``x``, written independently of the hook: +-mean|x|, + for zero."""
    return torch.where(x >= 0, 1.0, -1.0) * x.abs().mean()


def _hook_checks() -> dict:
    """Every hook on the same closed-form gradients; returns what the test asserts on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for step in range(STEPS):
        grads = [_grad(r, step) for r in range(world)]  # every rank's, computed locally
        exact = torch.stack(grads).mean(dim=0)
        mine = grads[rank]
        # fp16 / bf16: bit for bit what torch's own hooks return
        for dtype, ours, theirs in [
            ("fp16", c.fp16_hook, default_hooks.fp16_compress_hook),
            ("bf16", c.bf16_hook, default_hooks.bf16_compress_hook),
        ]:
            got = _call(ours, c.CompressionState(), mine)
            out[f"{dtype} equal torch"] = out.get(f"{dtype} equal torch", True) and torch.equal(
                got, _call(theirs, None, mine)
            )
        # int8: within half a quantisation step (absmax / 127) of each rank, on average
        state = c.CompressionState()
        got = _call(c.int8_hook, state, mine)
        half_steps = torch.stack([g.abs().max() / 127 / 2 for g in grads]).mean()
        worst = ((got - exact).abs().max() / half_steps).item()
        out["int8 worst error / half step"] = max(out.get("int8 worst error / half step", 0), worst)
        out["int8 bytes"] = state.bytes_sent
    # 1-bit and top-k with error feedback, STEPS calls on one bucket
    for name, hook, state in [
        ("1-bit", c.sign_hook, c.SignState()),
        ("top-k", c.topk_hook, c.TopKState(fraction=0.05)),
    ]:
        residuals = [torch.zeros(N) for _ in range(world)]  # every rank's e, simulated here
        total_out, total_grad, worst_invariant, worst_expected = 0, 0, 0.0, 0.0
        for step in range(STEPS):
            grads = [_grad(r, step) for r in range(world)]
            old = state.residual(0, grads[rank]).clone()
            got = _call(hook, state, grads[rank])
            new = state.residuals[0]
            corrected = [g + e for g, e in zip(grads, residuals, strict=True)]
            if name == "1-bit":
                sent = [_sign_sent(x) for x in corrected]
            else:
                k = math.ceil(0.05 * N)
                keep = [x.abs().topk(k).indices for x in corrected]
                sent = [
                    torch.zeros(N).index_copy_(0, i, x[i])
                    for x, i in zip(corrected, keep, strict=True)
                ]
            residuals = [x - s for x, s in zip(corrected, sent, strict=True)]
            # the invariant: what was sent + the new residual == gradient + the old residual
            worst_invariant = max(
                worst_invariant, (sent[rank] + new - grads[rank] - old).abs().max().item()
            )
            expected = torch.stack(sent).mean(dim=0)
            worst_expected = max(worst_expected, (got - expected).abs().max().item())
            total_out, total_grad = total_out + got, total_grad + torch.stack(grads).mean(dim=0)
        # nothing is lost, only delayed: sum of averages + mean final residual == sum of gradients
        finals = [torch.empty(N) for _ in range(world)]
        dist.all_gather(finals, state.residuals[0])
        lost = (total_out + torch.stack(finals).mean(dim=0) - total_grad).abs().max().item()
        out[name] = dict(
            invariant=worst_invariant,
            vs_expected=worst_expected,
            lost=lost,
            residual_norm=state.residuals[0].norm().item(),
            bytes=state.bytes_sent,
        )
    return out


def _ddp_params(hook, state, steps: int = 4) -> torch.Tensor:
    """Parameters after a few DDP steps on the digits with ``hook`` registered."""
    rank = dist.get_rank()
    x, y = load_digits("train")
    model = mlp(seed=0, in_features=64, hidden=(32,), out_features=10)
    ddp = DDP(model)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        idx = slice(64 * step + 32 * rank, 64 * step + 32 * (rank + 1))  # 32 samples each
        opt.zero_grad()
        F.cross_entropy(ddp(x[idx]), y[idx]).backward()
        opt.step()
    del ddp, opt  # free DDP before the process group goes away (pytorch#56297)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def torch_bf16(state, bucket):  # DDP refuses torch's bf16 hook *by name* without NCCL
    return default_hooks.bf16_compress_hook(state, bucket)


def _with_ddp_and_loopback() -> dict:
    out = _hook_checks()
    out["ddp"] = {
        "fp32": _ddp_params(c.allreduce_hook, c.CompressionState()),
        "no hook": _ddp_params(default_hooks.allreduce_hook, None),
        "fp16": _ddp_params(c.fp16_hook, c.CompressionState()),
        "torch fp16": _ddp_params(default_hooks.fp16_compress_hook, None),
        "bf16": _ddp_params(c.bf16_hook, c.CompressionState()),
        "torch bf16": _ddp_params(torch_bf16, None),
    }
    # The per-socket counters against the loopback interface's: other programs can only add to lo.
    big = torch.ones(1_000_000)
    before = loopback_sent()
    dist.barrier()  # no rank sends a byte of the all-reduce before rank 0 has read lo
    with c.WireMeter() as wire:
        dist.all_reduce(big)
        dist.barrier()
    out["lo"] = None if before is None else loopback_sent() - before
    out["tcp"], out["retransmitted"] = wire.bytes, wire.retransmitted
    return out


def test_pack_bits_round_trip():
    gen = torch.Generator().manual_seed(0)
    for n in [1, 7, 8, 9, 64, N]:
        bits = torch.rand(n, generator=gen) < 0.5
        packed = c.pack_bits(bits)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
        assert torch.equal(c.unpack_bits(packed, n), bits)
    first_and_last = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert c.pack_bits(first_and_last).tolist() == [129, 128]  # the first bit is the high bit


def test_residual_starts_at_zero_and_follows_the_bucket_shape():
    state = c.CompressionState()
    e = state.residual(3, torch.ones(5))
    assert torch.equal(e, torch.zeros(5)) and state.residual(3, torch.ones(5)) is e
    assert state.residual(3, torch.ones(7)).shape == (7,)  # DDP rebuilt its buckets: start over


def test_train_schemes_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown schemes"):
        experiment.train_schemes(["fp32", "int4"])  # before it touches a process group


def _assert_hook_checks(r: dict, world: int) -> None:
    assert r["fp16 equal torch"] and r["bf16 equal torch"]
    assert 0 < r["int8 worst error / half step"] <= 1 + 1e-4  # rounding: at most half a step
    assert r["int8 bytes"] == (world - 1) * (N + 4)  # int8 values and one fp32 scale, gathered
    for name, payload in [("1-bit", math.ceil(N / 8) + 4), ("top-k", 8 * math.ceil(0.05 * N))]:
        ef = r[name]
        assert ef["invariant"] <= 1e-5, name  # sent + e_new == g + e_old, to fp32 rounding
        assert ef["vs_expected"] <= 1e-5, name  # the average of what the ranks sent
        assert ef["lost"] <= 1e-4, name  # error feedback delays but loses nothing
        assert ef["residual_norm"] > 0, name  # ... and something really was delayed
        assert ef["bytes"] == STEPS * (world - 1) * payload, name


@pytest.mark.timeout(60)
def test_hooks_at_world_size_2_and_torch_ddp():
    results = run(_with_ddp_and_loopback, 2, timeout=50)
    for r in results:
        _assert_hook_checks(r, 2)
        ddp = r["ddp"]
        assert torch.equal(ddp["fp32"], ddp["no hook"])
        assert torch.equal(ddp["fp16"], ddp["torch fp16"])
        assert torch.equal(ddp["bf16"], ddp["torch bf16"])
        assert not torch.equal(ddp["fp16"], ddp["fp32"])  # the hooks really ran
        assert torch.equal(ddp["fp16"], results[0]["ddp"]["fp16"])  # ranks agree
    # 2 ranks each sent 4 MB (ring all-reduce at W=2 sends n floats per rank), plus gloo's
    # headers. Retransmissions are counted apart: under the suite's own load one run counted
    # 8.43 MB with them in, against this bound (tcpi_bytes_sent includes them).
    tcp = sum(r["tcp"] for r in results)
    print(f"payload {tcp / 1e6:.3f} MB, sent again {sum(r['retransmitted'] for r in results)} B")
    assert 8e6 <= tcp < 8.1e6
    if results[0]["lo"] is not None:
        assert results[0]["lo"] >= 0.99 * tcp  # lo also counts IP/TCP headers and others' traffic


@pytest.mark.timeout(60)
def test_hooks_at_world_size_3():
    for r in run(_hook_checks, 3, timeout=50):
        _assert_hook_checks(r, 3)


def _on_gpu() -> dict:
    """Each hook on a CUDA bucket at world size 1, where the average is the bucket itself."""
    grad = _grad(0, 0).cuda()
    out = {}
    for name, (hook, make_state) in c.SCHEMES.items():
        state = make_state()
        got = _call(hook, state, grad)
        sent_plus_residual = got + state.residuals[0] if state.residuals else got
        out[name] = (got.device.type, (sent_plus_residual - grad).abs().max().item())
    out["int8 half step"] = grad.abs().max().item() / 127 / 2
    return out


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_hooks_on_gpu():
    (r,) = run(_on_gpu, 1, backend="nccl", timeout=50)
    assert all(r[name][0] == "cuda" for name in c.SCHEMES)
    assert r["fp32"][1] == 0
    assert r["fp16"][1] < 1e-2 and r["bf16"][1] < 1e-1  # |g| < 40: 10- and 7-bit mantissas
    assert r["int8"][1] <= r["int8 half step"] * (1 + 1e-4)
    assert r["1-bit+EF"][1] < 1e-5 and r["top-k+EF"][1] < 1e-5  # sent + residual == g


@pytest.fixture(scope="module")
def table():
    return experiment.compare_schemes(run(experiment.train_schemes, 2, backend="gloo", timeout=120))


@pytest.mark.timeout(90)
def test_accuracy_of_each_scheme_on_digits(table):
    fp32 = table["fp32"]["accuracy"]
    assert fp32 > 0.9
    lost = {name: fp32 - row["accuracy"] for name, row in table.items()}
    assert lost["fp16"] <= 0.01 and lost["bf16"] <= 0.01
    assert lost["int8"] <= 0.01
    assert lost["1-bit+EF"] <= 0.02
    assert lost["top-k+EF"] <= 0.02  # 2% of the entries a step, with error feedback
    config = experiment.DigitsRun()
    steps = config.epochs * (len(load_digits("train")[1]) // config.global_batch)
    for name, row in table.items():
        assert row["ranks_agree"], name  # every rank decodes the same bytes: models stay equal
        assert len(row["loss"]) == steps, name
        assert sum(row["loss"][-20:]) < 0.5 * sum(row["loss"][:20]), name  # it trained


@pytest.mark.timeout(90)
def test_measured_wire_bytes_of_each_scheme(table):
    ratio = {name: row["wire_vs_fp32"] for name, row in table.items()}
    assert 0.45 < ratio["fp16"] < 0.6 and 0.45 < ratio["bf16"] < 0.6
    assert 0.2 < ratio["int8"] < 0.35  # W / 8 at W = 2: all-gather vs ring all-reduce
    assert ratio["1-bit+EF"] < 0.1  # 1/32 plus a scale and per-message overheads
    assert ratio["top-k+EF"] < 0.1  # 2% of values and indices: 2 * 8 / 4 * 2% = 0.04
    for name, row in table.items():
        # the kernel sent what the hooks counted, plus gloo's framing and a barrier: a few
        # hundred bytes per collective per rank, never less than the count
        overhead = row["wire_bytes"] - row["hook_bytes"]
        assert 0 <= overhead <= 2 * 1024 * row["collectives"], name


def _same_hook_on_both_wrappers() -> dict:
    """Every scheme on torch's DDP and on chapter 3's BucketedDDP, from the same start."""
    from dmlbook.data_parallel import BucketedDDP

    rank = dist.get_rank()
    x, y = load_digits("train")
    out = {}
    for name, (hook, make_state) in c.SCHEMES.items():
        for wrapper in ("torch", "ours"):
            model = mlp(seed=0, in_features=64, hidden=(32,), out_features=10)
            ddp = DDP(model) if wrapper == "torch" else BucketedDDP(model)
            state = make_state()
            ddp.register_comm_hook(state, hook)
            # torch's first backward uses a bucket in definition order, then re-buckets in the
            # order gradients arrived (ours from the start): one backward first, then a clean
            # slate for the error-feedback residuals.
            F.cross_entropy(ddp(x[:32]), y[:32]).backward()
            model.zero_grad(set_to_none=True)
            state.residuals.clear()
            opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
            for step in range(4):
                idx = slice(64 * step + 32 * rank, 64 * step + 32 * (rank + 1))
                opt.zero_grad()
                F.cross_entropy(ddp(x[idx]), y[idx]).backward()
                opt.step()
            out[name, wrapper] = torch.cat([p.detach().flatten() for p in model.parameters()])
            del ddp, opt  # free DDP before the process group goes away (pytorch#56297)
    return out


@pytest.mark.timeout(90)
def test_every_scheme_gives_the_same_training_on_our_bucketed_ddp():
    for r in run(_same_hook_on_both_wrappers, 2, timeout=80):
        for name in c.SCHEMES:
            assert torch.equal(r[name, "ours"], r[name, "torch"]), name
        assert not torch.equal(r["int8", "ours"], r["fp32", "ours"])  # the hooks really ran
