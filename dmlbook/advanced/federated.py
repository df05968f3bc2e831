"""Federated learning: FedAvg on real ranks, non-IID client splits and secure aggregation.

Chapter 10 ("Federated learning and edge devices") trains one model on data that never moves.
Rank 0 is the *server*: it holds the global model (and a test set to score it) but no training
data. Ranks 1, 2, ... host the *clients*; client ``c`` lives on rank ``1 + c % (world - 1)`` and
is the only rank that ever loads its data (``load_client(c)``). One round of :func:`fedavg`:

1. the server picks a fraction of the clients (:func:`sample_clients`, seeded by round, so every
   rank computes the same choice without a message) and broadcasts the global model;
2. each chosen client trains a copy for ``local_epochs`` epochs of SGD on its own data and uploads
   its *update* ``n_k * (w_k - w)`` together with its sample count ``n_k``;
3. the server adds the uploads and moves the global model by ``sum n_k (w_k - w) / sum n_k``:
   the average of the client models weighted by their sample counts (McMahan et al. 2017).

Uploads are fixed-point integers in the ring of integers modulo 2**48 (:func:`encode`), so that
**secure aggregation** (Bonawitz et al. 2017) is exact: every pair of chosen clients agrees on a
seed through a Diffie-Hellman exchange relayed by the server (:func:`dh_keypair`,
:func:`shared_seed`), both expand it into the same pseudo-random vector, and the lower-numbered
client adds it while the other subtracts it (:func:`pair_mask`, :func:`mask_update`). Each upload
the server receives looks uniformly random, but in the sum every mask meets its negative and the
server gets exactly the sum of the true updates. The integer sums are the same with and without
masks, so a secure run ends bit-identical to a plain one. The ring holds sums up to 2**23 in
size, far beyond any sum of weighted updates here. (Not covered: clients that drop out
mid-round, which the full protocol handles with secret-shared seeds.)

Tensors live on ``launch.device()``: the CPU under gloo, each rank's GPU under NCCL.

The splits: :func:`iid_split` deals a shuffled dataset out evenly; :func:`dirichlet_split` draws
each class's share per client from Dirichlet(alpha): large alpha is close to IID, small alpha
gives each client a few labels (:func:`label_skew` measures it). :func:`fedavg_reference` is the
same algorithm in one process, in float64, for the tests.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from dmlbook.comm import collectives
from dmlbook.datasets import load_digits
from dmlbook.launch import device

__all__ = [
    "FRAC_BITS",
    "MODULUS",
    "DigitsClients",
    "DigitsTest",
    "FedAvgResult",
    "Message",
    "client_owner",
    "decode",
    "dh_keypair",
    "dirichlet_split",
    "encode",
    "FedAvgConfig",
    "fedavg",
    "fedavg_reference",
    "iid_split",
    "label_histograms",
    "label_skew",
    "local_sgd",
    "mask_update",
    "pair_mask",
    "sample_clients",
    "shared_seed",
]

MODULUS = 2**48  # uploads live in the integers modulo 2**48; int64 holds any sum of two of them
FRAC_BITS = 24  # fixed point: x is sent as round(x * 2**24), a resolution of 6e-8
# Toy Diffie-Hellman group: the Mersenne prime 2**127 - 1 and generator 3. It shows the idea;
# a deployment uses a standard 2048-bit group or X25519.
DH_PRIME = 2**127 - 1
DH_GENERATOR = 3


# --------------------------------------------------------------------------- client splits


def _check_clients(num_clients: int, num_samples: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if num_clients > num_samples:
        raise ValueError(
            f"num_clients={num_clients} is larger than the data ({num_samples} samples): "
            "some client would get nothing"
        )


def iid_split(num_samples: int, num_clients: int, seed: int = 0) -> list[torch.Tensor]:
    """Each client's sample indices: one seeded shuffle dealt out in near-equal contiguous parts
    (sizes differ by at most one). Every index is used exactly once."""
    _check_clients(num_clients, num_samples)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    return [part.sort().values for part in torch.tensor_split(order, num_clients)]


def dirichlet_split(
    labels: torch.Tensor, num_clients: int, alpha: float, seed: int = 0, min_size: int = 1
) -> list[torch.Tensor]:
    """Each client's sample indices under label skew: for every class, the shares of its samples
    that go to the clients are drawn from Dirichlet(alpha, ..., alpha). alpha -> infinity is
    IID; alpha = 0.1 gives most clients one or two classes. Draws again (up to 100 times) until
    every client has at least ``min_size`` samples. Every index is used exactly once."""
    labels = torch.as_tensor(labels)
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D, got shape {tuple(labels.shape)}")
    _check_clients(num_clients, len(labels))
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if min_size < 0 or min_size * num_clients > len(labels):
        raise ValueError(f"min_size={min_size} is impossible for {num_clients} clients")
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for cls in np.unique(y):
            members = rng.permutation(np.flatnonzero(y == cls))
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        splits = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in splits) >= min_size:
            return [torch.from_numpy(s).long() for s in splits]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw in 100 gave every one of {num_clients} clients "
        f"{min_size} samples: use fewer clients or a larger alpha"
    )


def label_histograms(
    labels: torch.Tensor, splits: Sequence[torch.Tensor], classes: int | None = None
) -> torch.Tensor:
    """(clients, classes) counts: how many samples of each label every client holds."""
    labels = torch.as_tensor(labels)
    classes = int(labels.max()) + 1 if classes is None else classes
    return torch.stack([torch.bincount(labels[s], minlength=classes) for s in splits])


def label_skew(labels: torch.Tensor, splits: Sequence[torch.Tensor]) -> float:
    """Mean over clients of the total-variation distance between the client's label
    distribution and the whole dataset's: 0 for identical mixes, near 1 when clients hold
    labels the others lack."""
    hist = label_histograms(labels, splits).double()
    overall = hist.sum(0) / hist.sum()
    per_client = hist / hist.sum(1, keepdim=True).clamp_min(1)
    return (0.5 * (per_client - overall).abs().sum(1)).mean().item()


def sample_clients(num_clients: int, fraction: float, round_index: int, seed: int = 0) -> list[int]:
    """The clients that take part in round ``round_index``: max(1, round(fraction * C)) of them,
    drawn from a generator seeded by (seed, round), so every rank computes the same list."""
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    chosen = max(1, round(fraction * num_clients))
    g = torch.Generator().manual_seed(seed * 1_000_003 + round_index)
    return sorted(torch.randperm(num_clients, generator=g)[:chosen].tolist())


def client_owner(client: int, world_size: int) -> int:
    """The rank that hosts ``client``: rank 0 is the server, clients go round ranks 1.."""
    return 1 + client % (world_size - 1)


# --------------------------------------------------------------------------- fixed point, masks


def encode(values: torch.Tensor) -> torch.Tensor:
    """Floats to the ring: round(x * 2**FRAC_BITS) modulo MODULUS, as int64 in [0, MODULUS)."""
    q = torch.round(values.detach().double() * 2**FRAC_BITS)
    if q.abs().max() >= MODULUS // 2:
        raise ValueError(f"a value of {values.abs().max().item():.3g} overflows the fixed point")
    return q.long() % MODULUS


def decode(encoded: torch.Tensor) -> torch.Tensor:
    """The ring back to float64: values above MODULUS / 2 are negative (two's complement)."""
    signed = torch.where(encoded >= MODULUS // 2, encoded - MODULUS, encoded)
    return signed.double() / 2**FRAC_BITS


def dh_keypair(seed: int | None = None) -> tuple[int, int]:
    """(secret, public = g**secret mod p): the secret stays on the client, the public key is
    published. ``seed`` makes it reproducible; by default it comes from the OS's randomness."""
    if seed is None:
        secret = 2 + secrets.randbelow(DH_PRIME - 3)
    else:
        secret = 2 + int.from_bytes(hashlib.sha256(f"dh:{seed}".encode()).digest(), "big") % (
            DH_PRIME - 3
        )
    return secret, pow(DH_GENERATOR, secret, DH_PRIME)


def shared_seed(my_secret: int, their_public: int) -> int:
    """Diffie-Hellman: (g**b)**a = (g**a)**b mod p, the same number on both clients of a pair,
    which nobody who saw only the public keys can compute."""
    return pow(their_public, my_secret, DH_PRIME)


def pair_mask(seed: int, round_index: int, numel: int) -> torch.Tensor:
    """The pseudo-random vector a pair of clients expands its seed into for one round: int64,
    uniform in [0, MODULUS). Both clients of the pair get the same vector."""
    digest = hashlib.sha256(f"{seed}:{round_index}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))
    return torch.randint(0, MODULUS, (numel,), generator=g, dtype=torch.int64)


def mask_update(
    encoded: torch.Tensor,
    client: int,
    participants: Sequence[int],
    seeds: dict[int, int],
    round_index: int,
) -> torch.Tensor:
    """``encoded`` plus client's pairwise masks modulo MODULUS: + the pair's mask towards every
    participant numbered above it, - towards every one below. ``seeds[peer]`` is the seed this
    client shares with ``peer``. Summed over all participants, the masks cancel exactly."""
    masked = encoded.clone()
    for peer in participants:
        if peer == client:
            continue
        mask = pair_mask(seeds[peer], round_index, encoded.numel()).to(encoded.device)
        masked = (masked + mask if client < peer else masked - mask) % MODULUS
    return masked


# --------------------------------------------------------------------------- local training


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


# --------------------------------------------------------------------------- data providers


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


# --------------------------------------------------------------------------- FedAvg on ranks


@dataclass(frozen=True)
class Message:
    """One message a rank sent: what it was, to whom, how many bytes, in which round."""

    round: int
    kind: str  # "global model", "update", "public keys"
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
    size = global_flat.numel() + 1  # n_k * update, then n_k
    for r in range(config.rounds):
        chosen = sample_clients(num_clients, fraction, r, seed)
        result.sampled.append(chosen)
        with collectives.recording() as sends:
            collectives.broadcast(global_flat, src=0, check=False)
        result.sent += [Message(r, "global model", s.dst, s.nbytes) for s in sends]
        if rank == 0:
            total = torch.zeros(size, dtype=torch.int64, device=here)
            upload = torch.empty(size, dtype=torch.int64, device=here)
            for c in chosen:
                dist.recv(upload, src=client_owner(c, world), tag=c)
                if record:
                    result.received.append((r, c, upload.to("cpu", copy=True)))
                total = (total + upload) % MODULUS  # all the server ever does with an upload
            summed = decode(total)
            step = summed[:-1] / summed[-1]  # sum n_k (w_k - w) / sum n_k
            global_flat = (global_flat.double() + step).to(global_flat.dtype)
            if evaluate is not None:
                _load_flat(model, global_flat)
                result.accuracy.append(evaluate(model))
            continue
        for c in (c for c in chosen if c in data):
            x, y = data[c]
            _load_flat(model, global_flat)
            _local_round(model, x, y, config, r, c)
            delta = parameters_to_vector(model.parameters()).detach().double() - global_flat
            n = torch.tensor([float(len(x))], dtype=torch.float64, device=here)
            upload = encode(torch.cat([n * delta, n]))
            if record:
                result.uploads.append((r, c, upload.to("cpu", copy=True)))
            if secure:
                upload = mask_update(upload, c, chosen, seeds[c], r)
            dist.send(upload, dst=0, tag=c)
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
    if mine:
        result.sent.append(Message(-1, "public keys", 0, 16 * len(mine)))
    return {
        c: {peer: shared_seed(keys[c][0], pub) for peer, pub in relay[0].items() if peer != c}
        for c in mine
    }


# --------------------------------------------------------------------------- the reference


def _local_round(model: nn.Module, x, y, config: FedAvgConfig, round_: int, client: int) -> None:
    """Client ``client``'s local SGD in round ``round_``, with its own shuffling stream."""
    generator = _local_generator(config.seed, round_, client)
    local_sgd(model, x, y, config.local_epochs, config.lr, config.batch_size, generator)


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
            _local_round(model, x, y, config, r, c)
            states.append({k: v.detach().double() for k, v in model.state_dict().items()})
            counts.append(len(x))
        total = sum(counts)
        averaged = {
            k: sum(n / total * s[k] for n, s in zip(counts, states, strict=True)) for k in start
        }
        model.load_state_dict({k: v.to(start[k].dtype) for k, v in averaged.items()})
        if evaluate is not None:
            accuracies.append(evaluate(model))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, accuracies
