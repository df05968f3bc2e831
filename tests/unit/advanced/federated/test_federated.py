"""Tests for dmlbook.advanced.federated: FedAvg on real ranks (world sizes 2, 3 and 4; 3 is the
non-power of two) equals centralised full-batch SGD and the single-process weighted reference; each
client's data is loaded only on its rank and only model updates leave it; client sampling is the
same on every rank; secure aggregation shows the server only masked uploads, unrelated to the
true ones, while the aggregate stays exact; Dirichlet splits use every sample once, grow more
skewed as alpha falls and are reproducible; bad input raises ValueError."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dmlbook.advanced import federated as fl
from dmlbook.launch import run
from dmlbook.models import mlp

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDS, LR, LIMIT = 3, 0.5, 240


def model_fn() -> torch.nn.Module:
    return mlp(seed=3, in_features=64, hidden=(16,), out_features=10)


def n_params() -> int:
    return sum(p.numel() for p in model_fn().parameters())


class UnequalClients:
    """Client c holds 20 * (c + 1) digits: unequal sizes make the weighting matter."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def __call__(self, client: int):
        x, y = fl.DigitsClients(1, limit=LIMIT)(0)
        start = 10 * client * (client + 1)  # sum of the earlier clients' sizes
        return x[start : start + 20 * (client + 1)], y[start : start + 20 * (client + 1)]


class Spy:
    """Wraps load_client and notes which rank asked for which client's data."""

    def __init__(self, load_client) -> None:
        self.load_client, self.calls = load_client, []

    def __call__(self, client: int):
        self.calls.append((dist.get_rank(), client))
        return self.load_client(client)


def centralised_sgd(
    load_client, num_clients: int, steps: int, weighted: bool = True
) -> dict[str, torch.Tensor]:
    """One process, ``steps`` full-batch SGD steps (torch.optim.SGD) on the pooled data's mean
    loss; ``weighted=False`` averages the clients' mean losses instead (each client counts 1/C)."""
    parts = [load_client(c) for c in range(num_clients)]
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    total = sum(len(y) for _, y in parts)
    for _ in range(steps):
        opt.zero_grad()
        for x, y in parts:
            share = len(y) / total if weighted else 1 / num_clients
            (share * torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.step()
    return model.state_dict()


def _scenarios(num_clients: int) -> dict:
    """Everything one world size checks, in one launch."""
    iid = Spy(fl.DigitsClients(num_clients, limit=LIMIT))
    unequal = Spy(UnequalClients(num_clients))
    common = dict(lr=LR, seed=5)
    out = {
        "sampling": [fl.sample_clients(7, 0.4, r, seed=11) for r in range(6)],
        "iid": fl.fedavg(model_fn, iid, fl.FedAvgConfig(num_clients, ROUNDS, **common)),
        "iid_calls": list(iid.calls),
        "weighted": fl.fedavg(model_fn, unequal, fl.FedAvgConfig(num_clients, ROUNDS, **common)),
        "weighted_calls": list(unequal.calls),
    }
    for secure in (False, True):  # mini-batches, two local epochs, 60% of the clients per round
        config = fl.FedAvgConfig(
            num_clients, ROUNDS, local_epochs=2, batch_size=16, fraction=0.6, **common
        )
        out["secure" if secure else "plain"] = fl.fedavg(
            model_fn, unequal, config, secure=secure, record=True
        )
    return out


@functools.cache
def launched(world_size: int, num_clients: int) -> list[dict]:
    return run(_scenarios, world_size, num_clients, timeout=90)


CASES = [(2, 3), (3, 4), (4, 5)]  # (world size, clients): 1, 2 and 3 client ranks


def _server_state(results, key):
    return results[0][key].state


@pytest.mark.parametrize("world_size, num_clients", CASES)
def test_fedavg_equals_centralised_sgd(world_size, num_clients):
    """E = 1, full participation, one full-batch step per round: each client's update is
    -lr * its mean gradient, and their count-weighted mean is -lr * the pooled gradient."""
    results = launched(world_size, num_clients)
    for key, load_client in (
        ("iid", fl.DigitsClients(num_clients, limit=LIMIT)),
        ("weighted", UnequalClients(num_clients)),
    ):
        want = centralised_sgd(load_client, num_clients, ROUNDS)
        got = _server_state(results, key)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
        assert not torch.equal(got["layers.0.weight"], model_fn().state_dict()["layers.0.weight"])
    # With unequal clients, averaging without the n_k weights would have ended elsewhere.
    unweighted = centralised_sgd(UnequalClients(num_clients), num_clients, ROUNDS, weighted=False)
    got = _server_state(results, "weighted")
    assert max((got[k] - unweighted[k]).abs().max() for k in got) > 1e-3


@pytest.mark.parametrize("world_size, num_clients", CASES)
def test_fedavg_equals_weighted_reference(world_size, num_clients):
    """Mini-batches, E = 2, a sampled 60% of the clients: the same as one process averaging
    client states with weights n_k / sum n_k."""
    results = launched(world_size, num_clients)
    config = fl.FedAvgConfig(
        num_clients, ROUNDS, local_epochs=2, batch_size=16, fraction=0.6, lr=LR, seed=5
    )
    ref, _ = fl.fedavg_reference(model_fn, UnequalClients(num_clients), config)
    got = _server_state(results, "plain")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("world_size, num_clients", CASES)
def test_data_never_leaves_its_rank(world_size, num_clients):
    results = launched(world_size, num_clients)
    update_bytes = (n_params() + 1) * 8
    model_bytes = n_params() * 4
    for rank, out in enumerate(results):
        for key in ("iid", "weighted"):
            owned = [
                c for c in range(num_clients) if rank and fl.client_owner(c, world_size) == rank
            ]
            assert sorted(c for r, c in out[f"{key}_calls"]) == owned
            assert all(r == rank for r, _ in out[f"{key}_calls"])
            assert out[key].clients == owned
        if rank == 0:
            assert out["iid_calls"] == [] and out["iid"].loaded == []
        for key in ("iid", "weighted", "plain", "secure"):
            for message in out[key].sent:
                assert message.kind in (
                    "global model",
                    "update",
                    "public keys",
                    "public keys (relayed)",
                ), message
                if message.kind == "update":
                    assert rank > 0 and message.dst == 0 and message.nbytes == update_bytes
                elif message.kind == "global model":
                    assert message.nbytes == model_bytes
        # every chosen client of this rank uploaded exactly once per round, nothing else
        updates = [m for m in out["plain"].sent if m.kind == "update"]
        chosen = [c for s in out["plain"].sampled for c in s if c in out["plain"].clients]
        assert len(updates) == len(chosen)


@pytest.mark.parametrize("world_size, num_clients", CASES)
def test_client_sampling_is_the_same_on_every_rank(world_size, num_clients):
    results = launched(world_size, num_clients)
    assert all(out["sampling"] == results[0]["sampling"] for out in results)
    assert all(out["plain"].sampled == results[0]["plain"].sampled for out in results)
    want = max(1, round(0.6 * num_clients))
    assert all(len(s) == want for s in results[0]["plain"].sampled)
    assert len({tuple(s) for s in results[0]["sampling"]}) > 1  # rounds differ
    assert results[0]["sampling"] == [fl.sample_clients(7, 0.4, r, seed=11) for r in range(6)]


@pytest.mark.parametrize("world_size, num_clients", CASES)
def test_secure_aggregation_hides_updates_and_is_exact(world_size, num_clients):
    results = launched(world_size, num_clients)
    server = results[0]["secure"]
    true = {(r, c): t for out in results[1:] for r, c, t in out["secure"].uploads}
    plain_seen = {(r, c): t for r, c, t in results[0]["plain"].received}
    assert len(server.received) == len(true) == sum(len(s) for s in server.sampled)
    for r, c, seen in server.received:
        assert not torch.equal(seen, true[r, c])
        assert (seen == true[r, c]).float().mean() < 0.01  # no element leaks through
        for (r2, _), other in true.items():  # nor is it any other client's update
            assert r2 != r or not torch.equal(seen, other)
        # statistically unrelated: uncorrelated with the true update, uniform over the ring
        corr = torch.corrcoef(torch.stack([fl.decode(seen), fl.decode(true[r, c])]))[0, 1]
        assert corr.abs() < 0.25
        assert 0.4 < (seen.double() / fl.MODULUS).mean() < 0.6
        # without masking, the server would have seen exactly the true update
        assert torch.equal(plain_seen[r, c], true[r, c])
    for r in range(ROUNDS):  # the masks cancel: the masked sum is the true sum, in integers
        masked = sum(t for r2, _, t in server.received if r2 == r) % fl.MODULUS
        plain = sum(t for (r2, _), t in true.items() if r2 == r) % fl.MODULUS
        assert torch.equal(masked, plain)
    for name, tensor in server.state.items():  # bit for bit the plain run's model
        assert torch.equal(tensor, results[0]["plain"].state[name])


# ---- splits, no ranks ------------------------------------------------------------------------


def test_dirichlet_split_properties():
    _, y = fl.DigitsClients(1)._load()
    skews = []
    for alpha in (100.0, 1.0, 0.1):
        splits = fl.dirichlet_split(y, 6, alpha, seed=2)
        every = torch.cat(splits).sort().values
        assert torch.equal(every, torch.arange(len(y)))  # every sample exactly once
        assert all(len(s) >= 1 for s in splits)
        hist = fl.label_histograms(y, splits, classes=10)
        assert hist.sum() == len(y) and torch.equal(hist.sum(0), torch.bincount(y))
        skews.append(fl.label_skew(y, splits))
        again = fl.dirichlet_split(y, 6, alpha, seed=2)
        assert all(torch.equal(a, b) for a, b in zip(splits, again, strict=True))
        other = fl.dirichlet_split(y, 6, alpha, seed=3)
        assert not all(torch.equal(a, b) for a, b in zip(splits, other, strict=True))
    assert skews[0] < 0.1 < skews[1] < skews[2], skews  # skew grows as alpha falls
    iid = fl.iid_split(len(y), 6, seed=2)
    assert torch.equal(torch.cat(iid).sort().values, torch.arange(len(y)))
    assert max(map(len, iid)) - min(map(len, iid)) <= 1
    assert fl.label_skew(y, iid) < 0.1


def test_ring_encoding_and_masks():
    values = torch.tensor([-3.25, 0.0, 1e-7, 2.5, -1e5], dtype=torch.float64)
    back = fl.decode(fl.encode(values))
    assert (back - values).abs().max() <= 2.0 ** -(fl.FRAC_BITS + 1)
    a, b = fl.dh_keypair(seed=1), fl.dh_keypair(seed=2)
    assert fl.shared_seed(a[0], b[1]) == fl.shared_seed(b[0], a[1])
    seeds = {(i, j): 1000 + 10 * min(i, j) + max(i, j) for i in range(4) for j in range(4)}
    encoded = [fl.encode(torch.randn(50, dtype=torch.float64)) for _ in range(4)]
    masked = [
        fl.mask_update(encoded[c], c, [0, 1, 3], {p: seeds[c, p] for p in range(4)}, 7)
        for c in (0, 1, 3)
    ]
    assert torch.equal(sum(masked) % fl.MODULUS, sum(encoded[c] for c in (0, 1, 3)) % fl.MODULUS)
    with pytest.raises(ValueError, match="overflow"):
        fl.encode(torch.tensor([1e9]))


def test_bad_input_raises_value_error():
    y = torch.arange(10) % 3
    for alpha in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            fl.dirichlet_split(y, 2, alpha)
    with pytest.raises(ValueError, match="larger than the data"):
        fl.dirichlet_split(y, 11, 1.0)
    with pytest.raises(ValueError, match="larger than the data"):
        fl.iid_split(10, 11)
    with pytest.raises(ValueError, match="larger than the data"):
        fl.DigitsClients(5000)
    for fraction in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            fl.sample_clients(4, fraction, 0)
        with pytest.raises(ValueError, match="fraction"):
            fl.FedAvgConfig(4, 1, fraction=fraction)
    with pytest.raises(ValueError, match="at least 2 clients"):
        fl.fedavg(model_fn, fl.DigitsClients(4), fl.FedAvgConfig(4, 1, fraction=0.25), secure=True)
    with pytest.raises(ValueError, match="world_size >= 2"):
        fl.fedavg(model_fn, fl.DigitsClients(4), fl.FedAvgConfig(4, 1))  # no process group
    with pytest.raises(ValueError, match="lr"):
        fl.FedAvgConfig(4, 1, lr=0)
    with pytest.raises(ValueError, match="batch_size"):
        fl.FedAvgConfig(4, 1, batch_size=0)
    with pytest.raises(ValueError, match="num_clients"):
        fl.FedAvgConfig(True, 1)


def test_one_round_of_client_update_and_server_update_is_the_weighted_average():
    """The two halves of a round that chapter 10 shows, in one process: the server's step from
    the summed uploads moves w to the clients' models averaged with weights n_k / sum n_k."""
    from torch.nn.utils import parameters_to_vector

    clients = UnequalClients(3)
    config = fl.FedAvgConfig(3, rounds=1, lr=LR, batch_size=8, seed=1)
    model = model_fn()
    w = parameters_to_vector(model.parameters()).detach().clone()
    w0 = w.clone()
    total, flats, counts = torch.zeros(w.numel() + 1, dtype=torch.int64), [], []
    for c in range(3):
        x, y = clients(c)
        total = (total + fl.client_update(model, w, x, y, config, 0, c)) % fl.MODULUS
        flats.append({"w": parameters_to_vector(model.parameters()).detach().clone()})
        counts.append(len(x))
    stepped = fl.server_update(w, total)
    expected = fl.weighted_average(flats, counts)["w"]
    assert torch.allclose(stepped.double(), expected, atol=1e-6)
    assert torch.equal(w, w0)  # the clients trained copies: the global model is untouched


def test_quadratic_fedavg_drifts_only_with_several_local_steps_on_different_clients():
    hessians = [torch.tensor([[4.0, 0.0], [0.0, 0.5]]), torch.tensor([[0.5, 0.0], [0.0, 4.0]])]
    optima = [torch.tensor([-1.0, 1.0]), torch.tensor([1.0, -1.0])]
    best = fl.global_optimum(hessians, optima)
    # the optimum of the mean loss: the mean gradient vanishes there
    gradient = sum(a.double() @ (best - c.double()) for a, c in zip(hessians, optima, strict=True))
    assert torch.allclose(gradient, torch.zeros(2, dtype=torch.float64), atol=1e-12)
    far = torch.tensor([-2.0, -2.5])
    one_step = fl.quadratic_fedavg(hessians, optima, far, local_steps=1, lr=0.2, rounds=60)
    assert (one_step.global_path[-1] - best).norm() < 1e-6  # E = 1: gradient descent
    many = fl.quadratic_fedavg(hessians, optima, best, local_steps=10, lr=0.2, rounds=30)
    assert (many.global_path[1] - best).norm() > 0.3  # leaves the optimum in one round
    assert (many.global_path[-1] - best).norm() > 0.3  # and settles elsewhere
    assert many.global_path.shape == (31, 2)
    assert [walk.shape for walk in many.first_round] == [(11, 2), (11, 2)]
    same = fl.quadratic_fedavg([hessians[0]] * 2, [optima[0]] * 2, far, 10, 0.2, rounds=30)
    assert (same.global_path[-1] - optima[0]).norm() < 1e-6  # identical clients: no drift
