"""FedAvg on real ranks: the server, the clients' local SGD, and the single-process reference
(McMahan et al. 2017; chapter 10, see :mod:`dmlbook.advanced.federated`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from dmlbook.advanced.federated.secure import (
    MODULUS,
    decode,
    dh_keypair,
    encode,
    mask_update,
    shared_seed,
)
from dmlbook.advanced.federated.splits import (
    client_owner,
    dirichlet_split,
    iid_split,
    sample_clients,
)
from dmlbook.comm import collectives
from dmlbook.comm.groups import device
from dmlbook.datasets import load_digits


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """A client's work in a round: ``epochs`` passes of plain SGD over its own (x, y) in
    shuffled mini-batches of ``batch_size`` (None: one full batch per epoch). Returns the steps."""
    steps = 0
    for _ in range(epochs):
        if batch_size is None or batch_size >= len(x):
            batches = [torch.arange(len(x))]
        else:
            batches = torch.randperm(len(x), generator=generator).split(batch_size)
        for idx in batches:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
            steps += 1
    return steps


def _load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters (copies: the model must not alias it)."""
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _local_generator(seed: int, round_index: int, client: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1009 + round_index) * 1009 + client)


class DigitsClients:
    """``load_client(c)`` for the digits train split: client c's (x, y) under an IID split
    (``alpha=None``) or a Dirichlet(alpha) label skew. Each rank calls it only for its own
    clients; ``limit`` keeps the first samples only (small tests)."""

    def __init__(
        self, num_clients: int, alpha: float | None = None, seed: int = 0, limit: int | None = None
    ) -> None:
        self.num_clients, self.alpha, self.seed, self.limit = num_clients, alpha, seed, limit
        self._data = None
        self.splits()  # check the arguments here, in the caller, not on the ranks

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._data is None:
            x, y = load_digits("train")
            self._data = (x[: self.limit], y[: self.limit])
        return self._data

    def splits(self) -> list[torch.Tensor]:
        """Every client's indices into the (limited) digits train split."""
        _, y = self._load()
        if self.alpha is None:
            return iid_split(len(y), self.num_clients, self.seed)
        return dirichlet_split(y, self.num_clients, self.alpha, self.seed)

    def __call__(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._load()
        idx = self.splits()[client]
        return x[idx], y[idx]


class DigitsTest:
    """The server's score: accuracy of the global model on the digits test split."""

    def __init__(self) -> None:
        self._data = None

    def __call__(self, model: nn.Module) -> float:
        if self._data is None:
            self._data = load_digits("test")
        where = next(model.parameters()).device
        x, y = (t.to(where) for t in self._data)
        with torch.no_grad():
            return (model(x).argmax(1) == y).float().mean().item()


@dataclass(frozen=True)
class Message:
    """One message a rank sent: what it was, to whom, how many bytes, in which round."""

    round: int
    kind: str  # "global model", "update", "public keys", "public keys (relayed)"
    dst: int
    nbytes: int


@dataclass
class FedAvgResult:
    """What one rank saw. The server's has the final model, the accuracy after every round and
    (with ``record=True``) every upload it received; a client host's has its true uploads."""

    rank: int
    clients: list[int]  # the clients this rank hosts (empty on the server)
    loaded: list[int] = field(default_factory=list)  # clients whose data this rank loaded
    sampled: list[list[int]] = field(default_factory=list)  # chosen clients per round
    sent: list[Message] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)  # server: after each round
    state: dict[str, torch.Tensor] | None = None  # server: the final global model
    received: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (round, c, t)
    uploads: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # unmasked


@dataclass(frozen=True)
class FedAvgConfig:
    """What a FedAvg run does, the same for :func:`fedavg` and :func:`fedavg_reference`."""

    num_clients: int  # clients in the federation, hosted round robin on ranks 1..
    rounds: int  # communication rounds
    local_epochs: int = 1  # epochs of local SGD a chosen client runs per round (E)
    lr: float = 0.1  # local SGD's learning rate
    batch_size: int | None = None  # local mini-batch (B); None: the client's whole data
    fraction: float = 1.0  # clients sampled per round (C)
    seed: int = 0  # the client sampling and the local shuffles

    def __post_init__(self) -> None:
        n = self.num_clients
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_clients must be an integer >= 1, got {n!r}")
        if self.rounds < 0 or self.local_epochs < 1:
            raise ValueError(
                f"need rounds >= 0 and local_epochs >= 1, got {self.rounds}, {self.local_epochs}"
            )
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(
                f"batch_size must be >= 1 or None (full batch), got {self.batch_size!r}"
            )


def client_update(
    model: nn.Module,
    global_flat: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    config: FedAvgConfig,
    round_index: int,
    client: int,
) -> torch.Tensor:
    """One chosen client's part of a FedAvg round: start from the global model w, train it for
    E local epochs on the client's own (x, y), and return the upload [n_k (w_k - w), n_k] as
    fixed-point integers modulo 2**48 (:func:`encode`)."""
    _load_flat(model, global_flat)  # w_k <- w
    generator = _local_generator(config.seed, round_index, client)  # the client's own shuffles
    local_sgd(model, x, y, config.local_epochs, config.lr, config.batch_size, generator)
    delta = parameters_to_vector(model.parameters()).detach().double() - global_flat  # w_k - w
    n = torch.tensor([float(len(x))], dtype=torch.float64, device=delta.device)  # n_k
    return encode(torch.cat([n * delta, n]))


def server_update(global_flat: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The server's step, from the sum of the round's uploads (integers modulo 2**48):
    w + sum_k n_k (w_k - w) / sum_k n_k, the average of the client models weighted by n_k."""
    summed = decode(total)  # [sum_k n_k (w_k - w), sum_k n_k]
    step = summed[:-1] / summed[-1]
    return (global_flat.double() + step).to(global_flat.dtype)


def weighted_average(
    states: list[dict[str, torch.Tensor]], counts: list[int]
) -> dict[str, torch.Tensor]:
    """The FedAvg average of client state dicts, client k weighted by counts[k] / sum(counts)
    (in float64): what :func:`fedavg_reference` moves the model to after each round."""
    total = sum(counts)
    return {
        k: sum(n / total * s[k].double() for n, s in zip(counts, states, strict=True))
        for k in states[0]
    }


def server_round(
    global_flat: torch.Tensor, chosen: list[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Rank 0's part of a round, after it broadcast w: receive one upload from each chosen
    client (from the rank that hosts it), add them modulo MODULUS, and take the server's step.
    Returns the new w and the uploads as received."""
    world = dist.get_world_size()
    total = torch.zeros(global_flat.numel() + 1, dtype=torch.int64, device=global_flat.device)
    received = {}
    for c in chosen:
        upload = torch.empty_like(total)
        dist.recv(upload, src=client_owner(c, world), tag=c)  # communication: rank -> server
        received[c] = upload
        total = (total + upload) % MODULUS  # all the server ever does with an upload
    return server_update(global_flat, total), received


def client_round(
    model: nn.Module,
    global_flat: torch.Tensor,
    data: dict[int, tuple[torch.Tensor, torch.Tensor]],
    chosen: list[int],
    config: FedAvgConfig,
    round_index: int,
    mask: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A client rank's part of a round, after it received w: every chosen client it hosts
    (``data``: client -> its (x, y)) trains and sends its upload to rank 0, masked by
    ``mask(upload, client)`` under secure aggregation. Returns client -> (true, sent) upload."""
    sent = {}
    for c in chosen:
        if c not in data:
            continue  # hosted by another rank
        x, y = data[c]
        upload = client_update(model, global_flat, x, y, config, round_index, c)
        masked = upload if mask is None else mask(upload, c)
        dist.send(masked, dst=0, tag=c)  # communication: client's rank -> server
        sent[c] = (upload, masked)
    return sent


def fedavg(
    model_fn: Callable[[], nn.Module],
    load_client: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    config: FedAvgConfig,
    *,
    secure: bool = False,
    evaluate: Callable[[nn.Module], float] | None = None,
    record: bool = False,
) -> FedAvgResult:
    """FedAvg on every rank of the world (call it on all of them, e.g. via ``launch.run``).

    Rank 0 is the server, ranks 1.. host the clients. ``model_fn()`` builds the same initial
    model everywhere; ``load_client(c)`` is called only on client c's rank; ``evaluate(model)``
    runs on the server after every round. ``secure`` masks every upload so that the server only
    learns the sum. ``record`` keeps every upload received (server) and sent unmasked (clients).
    """
    num_clients, fraction, seed = config.num_clients, config.fraction, config.seed
    if secure and max(1, round(fraction * num_clients)) < 2:
        raise ValueError("secure aggregation needs at least 2 clients per round to mask anything")
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise ValueError("fedavg needs world_size >= 2: rank 0 is the server, ranks 1.. clients")
    rank, world = dist.get_rank(), dist.get_world_size()
    here = device()  # the CPU under gloo, this rank's GPU under NCCL
    model = model_fn().to(here)
    mine = [c for c in range(num_clients) if rank and client_owner(c, world) == rank]
    result = FedAvgResult(rank=rank, clients=mine)
    data = {}
    for c in mine:  # the only place any training data is touched
        data[c] = tuple(t.to(here) for t in load_client(c))
        result.loaded.append(c)
    seeds = _exchange_keys(mine, result) if secure else {}
    global_flat = parameters_to_vector(model.parameters()).detach().clone()
    for r in range(config.rounds):
        chosen = sample_clients(num_clients, fraction, r, seed)
        result.sampled.append(chosen)
        with collectives.recording_sends() as sends:
            collectives.broadcast(global_flat, src=0, check=False)
        result.sent += [Message(r, "global model", s.dst, s.nbytes) for s in sends]
        if rank == 0:
            global_flat, received = server_round(global_flat, chosen)
            if record:
                result.received += [(r, c, t.to("cpu", copy=True)) for c, t in received.items()]
            if evaluate is not None:
                _load_flat(model, global_flat)
                result.accuracy.append(evaluate(model))
            continue
        mask = None
        if secure:  # + or - a pairwise mask towards every other chosen client (section 10.6)
            mask = lambda upload, c, chosen=chosen, r=r: mask_update(  # noqa: E731
                upload, c, chosen, seeds[c], r
            )
        sent = client_round(model, global_flat, data, chosen, config, r, mask)
        for c, (true, upload) in sent.items():
            if record:
                result.uploads.append((r, c, true.to("cpu", copy=True)))
            result.sent.append(Message(r, "update", 0, upload.numel() * upload.element_size()))
    if rank == 0:
        _load_flat(model, global_flat)
        result.state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return result


def _exchange_keys(mine: list[int], result: FedAvgResult) -> dict[int, dict[int, int]]:
    """Every client makes a Diffie-Hellman key pair and publishes its public key through the
    server; returns, per client of this rank, the seed it shares with every other client."""
    keys = {c: dh_keypair() for c in mine}
    public = {c: pub for c, (_, pub) in keys.items()}
    gathered: list[dict[int, int] | None] = [None] * dist.get_world_size()
    dist.gather_object(public, gathered if dist.get_rank() == 0 else None, dst=0)
    relay = [{c: p for part in gathered if part for c, p in part.items()}]
    dist.broadcast_object_list(relay, src=0)  # the server relays every public key
    if mine:  # a public key is a number below DH_PRIME = 2**127 - 1: 16 bytes
        result.sent.append(Message(-1, "public keys", 0, 16 * len(mine)))
    if dist.get_rank() == 0:
        for dst in range(1, dist.get_world_size()):
            result.sent.append(Message(-1, "public keys (relayed)", dst, 16 * len(relay[0])))
    return {
        c: {peer: shared_seed(keys[c][0], pub) for peer, pub in relay[0].items() if peer != c}
        for c in mine
    }


def fedavg_reference(
    model_fn: Callable[[], nn.Module],
    load_client: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    config: FedAvgConfig,
    *,
    evaluate: Callable[[nn.Module], float] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same FedAvg in one process, averaging client states in float64 with weights
    n_k / sum n_k: (final state dict, accuracy after each round)."""
    model = model_fn()
    data = [load_client(c) for c in range(config.num_clients)]
    accuracies = []
    for r in range(config.rounds):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        states, counts = [], []
        for c in sample_clients(config.num_clients, config.fraction, r, config.seed):
            model.load_state_dict(start)
            x, y = data[c]
            generator = _local_generator(config.seed, r, c)
            local_sgd(model, x, y, config.local_epochs, config.lr, config.batch_size, generator)
            states.append({k: v.detach().double() for k, v in model.state_dict().items()})
            counts.append(len(x))
        averaged = weighted_average(states, counts)
        model.load_state_dict({k: v.to(start[k].dtype) for k, v in averaged.items()})
        if evaluate is not None:
            accuracies.append(evaluate(model))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, accuracies
