"""Chapter 10's exercise checkers: right answers pass; planted bugs (plain mean, no division by
the total, dividing by the number of clients, integer division, the first client's state, a
detour through the ranks' fixed-point upload, averaging in place; one sign for every pair, no
modulo, masking against every client, a zero mask, the same mask every round, masks not built
from the pair seeds; a split that ignores alpha, inverts it, drops or repeats samples, ignores the
seed or accepts alpha <= 0) are caught with a message that says so."""

import numpy as np
import pytest
import torch

from dmlbook.advanced import federated as fl
from dmlbook.exercises import ExerciseFailed, ch10


def unanswered(*args):
    raise NotImplementedError


# ---- 1. weighted FedAvg ----------------------------------------------------------------------


def weighted_average(states, counts):
    total = sum(counts)
    return {
        k: sum(n / total * s[k] for n, s in zip(counts, states, strict=True)) for k in states[0]
    }


def weighted_average_stacked(states, counts):
    w = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    return {
        k: torch.einsum("c,c...->...", w, torch.stack([s[k].double() for s in states])).float()
        for k in states[0]
    }


def plain_mean(states, counts):
    return {k: sum(s[k] for s in states) / len(states) for k in states[0]}


def not_normalised(states, counts):
    return {k: sum(n * s[k] for n, s in zip(counts, states, strict=True)) for k in states[0]}


def divided_by_clients(states, counts):
    return {
        k: sum(n * s[k] for n, s in zip(counts, states, strict=True)) / len(counts)
        for k in states[0]
    }


def in_place(states, counts):
    total = sum(counts)
    out = states[0]
    for k in out:
        out[k].mul_(counts[0] / total)
        for n, s in zip(counts[1:], states[1:], strict=True):
            out[k].add_(n / total * s[k])
    return out


def integer_division(states, counts):
    total = sum(counts)
    return {
        k: sum(n // total * s[k] for n, s in zip(counts, states, strict=True)) for k in states[0]
    }


def first_client(states, counts):
    return {k: v.clone() for k, v in states[0].items()}


def through_fixed_point(states, counts):
    """The back door the ranks' code offers: encode n_k * state_k, sum, let server_update divide."""
    keys = list(states[0])
    flat = [torch.cat([s[k].double().reshape(-1) for k in keys]) for s in states]
    total = (
        sum(
            fl.encode(torch.cat([n * f, torch.tensor([float(n)], dtype=torch.float64)]))
            for n, f in zip(counts, flat, strict=True)
        )
        % fl.MODULUS
    )
    average = fl.server_update(torch.zeros_like(flat[0]), total)
    out, offset = {}, 0
    for k in keys:
        numel = states[0][k].numel()
        out[k] = average[offset : offset + numel].view_as(states[0][k]).float()
        offset += numel
    return out


def test_weighted_average_passes_right_answers():
    assert ch10.check_weighted_average(weighted_average).status == "passed"
    assert ch10.check_weighted_average(weighted_average_stacked).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (plain_mean, "plain mean"),
        (not_normalised, "without dividing by the total"),
        (divided_by_clients, r"n_k / C"),
        (in_place, "in place"),
        (integer_division, "integer division"),
        (first_client, "first client's state alone"),
        (through_fixed_point, "in floats"),
    ],
)
def test_weighted_average_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch10.check_weighted_average(answer)


# ---- 2. pairwise masks -----------------------------------------------------------------------


def client_mask(client, participants, seed_of, round_index, numel):
    mask = torch.zeros(numel, dtype=torch.int64)
    for peer in participants:
        if peer != client:
            m = fl.pair_mask(seed_of(client, peer), round_index, numel)
            mask = (mask + m if client < peer else mask - m) % fl.MODULUS
    return mask


def client_mask_reversed_convention(client, participants, seed_of, round_index, numel):
    return (-client_mask(client, participants, seed_of, round_index, numel)) % fl.MODULUS


def client_mask_via_package(client, participants, seed_of, round_index, numel):
    seeds = {p: seed_of(client, p) for p in participants}
    zero = torch.zeros(numel, dtype=torch.int64)
    return fl.mask_update(zero, client, participants, seeds, round_index)


def one_sign(client, participants, seed_of, round_index, numel):
    mask = torch.zeros(numel, dtype=torch.int64)
    for peer in participants:
        if peer != client:
            mask = (mask + fl.pair_mask(seed_of(client, peer), round_index, numel)) % fl.MODULUS
    return mask


def no_modulo(client, participants, seed_of, round_index, numel):
    mask = torch.zeros(numel, dtype=torch.int64)
    for peer in participants:
        if peer != client:
            m = fl.pair_mask(seed_of(client, peer), round_index, numel)
            mask = mask + m if client < peer else mask - m
    return mask


def every_client(client, participants, seed_of, round_index, numel):
    return client_mask(client, range(max(participants) + 1), seed_of, round_index, numel)


def zero_mask(client, participants, seed_of, round_index, numel):
    return torch.zeros(numel, dtype=torch.int64)


def same_every_round(client, participants, seed_of, round_index, numel):
    return client_mask(client, participants, seed_of, 0, numel)


def not_from_pair_seeds(client, participants, seed_of, round_index, numel):
    made_up = lambda i, j: 7 * min(i, j) + max(i, j)  # noqa: E731
    return client_mask(client, participants, made_up, round_index, numel)


def test_client_mask_passes_right_answers():
    assert ch10.check_client_mask(client_mask).status == "passed"
    assert ch10.check_client_mask(client_mask_reversed_convention).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (one_sign, "every client ADDS every pair's mask"),
        (no_modulo, r"% MODULUS"),
        (every_client, "over the participants only"),
        (zero_mask, "does not look random"),
        (same_every_round, "Pass round_index"),
        (not_from_pair_seeds, "pair seeds"),
    ],
)
def test_client_mask_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch10.check_client_mask(answer)


# ---- 3. Dirichlet split ----------------------------------------------------------------------


def dirichlet_split(labels, num_clients, alpha, seed):
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    rng = np.random.default_rng(seed)
    y = np.asarray(labels)
    parts = [[] for _ in range(num_clients)]
    for cls in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == cls))
        shares = rng.dirichlet([alpha] * num_clients)
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for client, chunk in enumerate(np.split(members, cuts)):
            parts[client].extend(chunk.tolist())
    return parts


def unshuffled(labels, num_clients, alpha, seed):
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    rng = np.random.default_rng(seed)
    y = np.asarray(labels)
    parts = [[] for _ in range(num_clients)]
    for cls in np.unique(y):
        members = np.flatnonzero(y == cls)  # in index order: no shuffle
        cuts = np.cumsum(rng.dirichlet([alpha] * num_clients))[:-1] * len(members)
        for client, chunk in enumerate(np.split(members, cuts.astype(int))):
            parts[client].extend(chunk.tolist())
    return parts


def iid_ignoring_alpha(labels, num_clients, alpha, seed):
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    return fl.iid_split(len(labels), num_clients, seed)


def alpha_inverted(labels, num_clients, alpha, seed):
    return dirichlet_split(labels, num_clients, 1 / alpha if alpha > 0 else alpha, seed)


def drops_remainders(labels, num_clients, alpha, seed):
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    rng = np.random.default_rng(seed)
    y = np.asarray(labels)
    parts = [[] for _ in range(num_clients)]
    for cls in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == cls))
        start = 0
        for client, share in enumerate(rng.dirichlet([alpha] * num_clients)):
            take = int(share * len(members))  # floors: the last few of each class are lost
            parts[client].extend(members[start : start + take].tolist())
            start += take
    return parts


def with_replacement(labels, num_clients, alpha, seed):
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    rng = np.random.default_rng(seed)
    y = np.asarray(labels)
    parts = [[] for _ in range(num_clients)]
    for cls in np.unique(y):
        members = np.flatnonzero(y == cls)
        counts = rng.multinomial(len(members), rng.dirichlet([alpha] * num_clients))
        for client, count in enumerate(counts):
            parts[client].extend(rng.choice(members, count).tolist())
    return parts


def unseeded(labels, num_clients, alpha, seed):
    return dirichlet_split(labels, num_clients, alpha, None)


def no_value_error(labels, num_clients, alpha, seed):
    return dirichlet_split(labels, num_clients, max(alpha, 1e-3), seed)


def test_dirichlet_split_passes_right_answers():
    assert ch10.check_dirichlet_split(dirichlet_split).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (iid_ignoring_alpha, "expected below 0.15"),
        (alpha_inverted, "alpha inverted"),
        (drops_remainders, "Rounding each client's count down"),
        (with_replacement, "went to two clients"),
        (unseeded, "same seed"),
        (unshuffled, "shuffle each class"),
        (no_value_error, "raise ValueError"),
    ],
)
def test_dirichlet_split_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch10.check_dirichlet_split(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch10.check_weighted_average(unanswered).status == "not attempted"
    assert ch10.check_client_mask(unanswered).status == "not attempted"
    assert ch10.check_dirichlet_split(unanswered).status == "not attempted"


# ---- answers that only call the library: test_back_doors.py rejects each -------

DELEGATING_ANSWERS = {
    "weighted_average": lambda states, counts: fl.weighted_average(states, counts),
    "client_mask": client_mask_via_package,
    "dirichlet_split": lambda labels, num_clients, alpha, seed: fl.dirichlet_split(
        labels, num_clients, alpha, seed
    ),
}


def test_the_delegating_answers_are_right_with_the_library_on():
    """Each would pass if the library were not switched off: the rejection is for delegating."""
    states = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    assert torch.allclose(
        fl.weighted_average(states, [1, 3])["w"].float(), torch.tensor([2.5, 5.0])
    )
    seed_of = lambda i, j: 100 * min(i, j) + max(i, j)  # noqa: E731
    assert torch.equal(
        client_mask_via_package(0, [0, 1, 2], seed_of, 4, 16),
        client_mask(0, [0, 1, 2], seed_of, 4, 16),
    )
