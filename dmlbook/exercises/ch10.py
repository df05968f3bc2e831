"""Checkers for chapter 10's exercises ("Federated learning and edge devices").

1. ``check_weighted_average``: write ``weighted_average(states, counts) -> state``, the server's
   FedAvg step: the average of the clients' state dicts, client k weighted by its sample count
   ``counts[k]`` over the total, without changing the inputs.
2. ``check_client_mask``: write ``client_mask(client, participants, seed_of, round_index, numel)``,
   the pairwise mask one client adds to its upload in secure aggregation: for every other
   participant, ``pair_mask(seed_of(client, peer), round_index, numel)`` (from
   :mod:`dmlbook.advanced.federated`) added or subtracted so that the masks of all participants
   cancel in the sum, everything modulo ``MODULUS``.
3. ``check_dirichlet_split``: write ``dirichlet_split(labels, num_clients, alpha, seed)``, each
   client's sample indices when every class is shared out among the clients in proportions
   drawn from Dirichlet(alpha): every sample used exactly once, reproducible for a seed, close
   to IID for large alpha and skewed for small alpha, each class shuffled before it is cut;
   alpha <= 0 raises ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dmlbook.advanced import federated as fl
from dmlbook.datasets import load_digits
from dmlbook.exercises import ExerciseFailed, checker, expect_value_error, learner_code

__all__ = ["check_client_mask", "check_dirichlet_split", "check_weighted_average"]


# --------------------------------------------------------------------------- 1. weighted FedAvg


def _states(counts: Sequence[int], seed: int, scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "layer.weight": scale * torch.randn(3, 4, generator=g),
            "layer.bias": scale * torch.randn(3, generator=g),
        }
        for _ in counts
    ]


def _weighted(states, counts) -> dict[str, torch.Tensor]:
    total = sum(counts)
    return {
        k: sum(n / total * s[k].double() for n, s in zip(counts, states, strict=True)).float()
        for k in states[0]
    }


def _average_mistakes(states, counts) -> dict[str, dict[str, torch.Tensor]]:
    """What common slips give, keyed by the hint that explains them."""
    c = len(counts)
    return {
        "the plain mean of the states; FedAvg weights client k by n_k / sum(n), so a client "
        "with more data counts more": _weighted(states, [1] * c),
        "sum(n_k * state_k) without dividing by the total count sum(n)": {
            k: v * sum(counts) for k, v in _weighted(states, counts).items()
        },
        "weighted by n_k / C (the number of clients); divide by the total count sum(n) instead": {
            k: v * sum(counts) / c for k, v in _weighted(states, counts).items()
        },
        "all zeros, what integer division gives: n_k // sum(n) is 0 for every client; divide "
        "with / (n_k / sum(n))": {k: torch.zeros_like(v) for k, v in states[0].items()},
        "the first client's state alone; the average runs over every client k": states[0],
        "the last client's state alone; the average runs over every client k": states[-1],
    }


# (counts, seed, scale): the last is a federation of big clients with large weights, where a
# fixed-point detour (fl.encode's integers hold |n_k * w| below 2**23) overflows.
_CASES = [
    ([30, 10, 60], 0, 1.0),
    ([100, 1], 1, 1.0),
    ([7], 2, 1.0),
    ([5, 5, 5, 5], 3, 1.0),
    ([1, 2, 3, 4, 50], 4, 1.0),
    ([250_000, 40_000, 90_000], 5, 60.0),
]


@checker("weighted_average", writes=("dmlbook.advanced.federated.fedavg.weighted_average",))
def check_weighted_average(fn: Callable[[list[dict], list[int]], dict]) -> str:
    """Check ``fn(states, counts)`` returns sum_k counts[k] / sum(counts) * states[k] for every
    key, leaving ``states`` unchanged."""
    for counts, seed, scale in _CASES:
        states = _states(counts, seed, scale)
        before = [{k: v.clone() for k, v in s.items()} for s in states]
        call = f"your weighted_average(<{len(counts)} client states>, counts={counts})"
        try:
            with learner_code(call):
                got = fn(states, list(counts))
        except ExerciseFailed as failure:
            if "fixed point" not in str(failure):
                raise
            raise ExerciseFailed(
                f"{failure}. The fixed-point integers of fl.encode (what the ranks send) hold "
                "only |n_k * w| < 2**23, and the server's step is what you are asked to write: "
                "compute the weighted average of the state dicts in floats"
            ) from failure
        for s, b in zip(states, before, strict=True):
            if any(not torch.equal(s[k], b[k]) for k in b):
                raise ExerciseFailed(
                    f"{call} changed the clients' states in place; build a new dict (the "
                    "server must not overwrite the uploads it averages)"
                )
        want = _weighted(states, counts)
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ExerciseFailed(
                f"{call} returned {keys}; expected a dict with keys {sorted(want)}"
            )
        close = lambda a, b: all(  # noqa: E731
            torch.allclose(torch.as_tensor(a[k]).double(), b[k].double(), rtol=1e-5, atol=1e-6)
            for k in b
        )
        if close(got, want):
            continue
        mistakes = _average_mistakes(states, counts)
        hint = next((f": that is {why}" for why, v in mistakes.items() if close(got, v)), "")
        key = "layer.bias"
        raise ExerciseFailed(
            f"{call} gave {key} = {torch.as_tensor(got[key]).tolist()}, expected "
            f"{[round(x, 5) for x in want[key].tolist()]}{hint}"
        )
    return (
        f"right on {len(_CASES)} sets of clients (one client, equal and very unequal counts, "
        "clients of 250,000 samples)"
    )


# --------------------------------------------------------------------------- 2. pairwise masks


def _seed_of(i: int, j: int) -> int:
    """A stand-in for the Diffie-Hellman seed: the same for (i, j) and (j, i)."""
    return 7919 * min(i, j) + max(i, j) + 12345


MASK_CASES = [([0, 1], 0), ([0, 2, 5], 3), ([1, 2, 3, 4, 6], 1), ([3, 4, 7, 8], 9)]
NUMEL = 2000


@checker("client_mask", writes=("dmlbook.advanced.federated.secure.mask_update",))
def check_client_mask(fn: Callable[[int, list[int], Callable, int, int], torch.Tensor]) -> str:
    """Check ``fn(client, participants, seed_of, round_index, numel)``: int64 masks in
    [0, MODULUS) that look uniformly random, change from round to round, are built from the pair
    seeds, and sum to 0 modulo MODULUS over the participants."""
    for participants, round_index in MASK_CASES:
        masks = {}
        for client in participants:
            call = f"your client_mask({client}, {participants}, seed_of, {round_index}, {NUMEL})"
            with learner_code(call):
                mask = fn(client, list(participants), _seed_of, round_index, NUMEL)
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.int64:
                raise ExerciseFailed(f"{call} returned {type(mask).__name__}; return int64")
            if mask.shape != (NUMEL,):
                raise ExerciseFailed(f"{call} has shape {tuple(mask.shape)}, expected ({NUMEL},)")
            if mask.min() < 0 or mask.max() >= fl.MODULUS:
                raise ExerciseFailed(
                    f"{call} has values outside [0, MODULUS), e.g. {mask.min().item()}: take "
                    "the result % MODULUS (subtracting a mask goes below zero)"
                )
            mean = (mask.double() / fl.MODULUS).mean().item()
            if not 0.4 < mean < 0.6:
                raise ExerciseFailed(
                    f"{call} does not look random (mean {mean:.3f} of MODULUS, 0.5 expected): "
                    "a mask hides an update only if it is uniform over the ring; add "
                    "pair_mask(seed_of(client, peer), round_index, numel) for every peer"
                )
            masks[client] = mask
        total = sum(masks.values()) % fl.MODULUS
        if total.any():
            bad = (total != 0).float().mean().item()
            added = {
                c: sum(
                    (
                        fl.pair_mask(_seed_of(c, p), round_index, NUMEL)
                        for p in participants
                        if p != c
                    ),
                    torch.zeros(NUMEL, dtype=torch.int64),
                )
                % fl.MODULUS
                for c in participants
            }
            if all(torch.equal(masks[c], added[c]) for c in participants):
                raise ExerciseFailed(
                    f"the masks of participants {participants} do not cancel: every client ADDS "
                    "every pair's mask, so the server's sum holds each pair's mask twice instead "
                    "of zero times. One client of each pair must subtract it (e.g. + towards "
                    "higher-numbered peers, - towards lower)"
                )
            raise ExerciseFailed(
                f"the masks of participants {participants} in round {round_index} do not cancel: "
                f"their sum is non-zero modulo MODULUS in {bad:.0%} of the elements. For each "
                "pair, one client must add the pair's mask and the other subtract it (e.g. + "
                "towards higher-numbered peers, - towards lower), over the participants only, "
                "never the client itself"
            )
        client = participants[0]
        with learner_code("your client_mask"):
            later = fn(client, list(participants), _seed_of, round_index + 1, NUMEL)
            shifted = lambda i, j: _seed_of(i, j) + 1  # noqa: E731
            other_seeds = fn(client, list(participants), shifted, round_index, NUMEL)
        if torch.equal(later, masks[client]):
            raise ExerciseFailed(
                f"client {client}'s mask is the same in rounds {round_index} and "
                f"{round_index + 1}: the server could subtract two uploads and cancel it. Pass "
                "round_index to pair_mask"
            )
        if torch.equal(other_seeds, masks[client]):
            raise ExerciseFailed(
                "the mask did not change when the pair seeds did: build it from "
                "pair_mask(seed_of(client, peer), ...), the seeds only the pair knows"
            )
    return f"masks cancel exactly for {len(MASK_CASES)} sets of participants (2 to 5 clients)"


# --------------------------------------------------------------------------- 3. Dirichlet split


def _as_index_list(parts, call: str, num_clients: int) -> list[torch.Tensor]:
    try:
        parts = [torch.as_tensor(p).long().reshape(-1) for p in parts]
    except (TypeError, ValueError, RuntimeError) as error:
        raise ExerciseFailed(f"{call} did not return a list of index arrays: {error}") from error
    if len(parts) != num_clients:
        raise ExerciseFailed(f"{call} returned {len(parts)} parts; one per client, {num_clients}")
    return parts


def _in_index_order(labels: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """True when, for every class, each client's samples of it are one consecutive run of the
    class's indices in sorted order (an unshuffled cut). Pairs that hold 0-2 samples or the
    whole class say nothing and are skipped; at least 5 others must be seen."""
    seen = 0
    for cls in labels.unique():
        members = torch.nonzero(labels == cls).flatten()  # sorted
        position = {int(i): p for p, i in enumerate(members.tolist())}
        for part in parts:
            held = sorted(position[int(i)] for i in part.tolist() if int(i) in position)
            if 3 <= len(held) < len(members):
                seen += 1
                if held[-1] - held[0] + 1 != len(held):
                    return False
    return seen >= 5


@checker("dirichlet_split", writes=("dmlbook.advanced.federated.splits.dirichlet_split",))
def check_dirichlet_split(fn: Callable[[torch.Tensor, int, float, int], Sequence]) -> str:
    """Check ``fn(labels, num_clients, alpha, seed)`` on the digits labels: one index array per
    client, every sample exactly once, the same for the same seed, label skew small at
    alpha = 100 and large at alpha = 0.1, and ValueError for alpha <= 0."""
    _, labels = load_digits("train")
    clients, skews = 5, {}
    for alpha in (100.0, 1.0, 0.1):
        found = []
        for seed in range(4):
            call = f"your dirichlet_split(labels, {clients}, alpha={alpha:g}, seed={seed})"
            with learner_code(call):
                parts = _as_index_list(fn(labels.clone(), clients, alpha, seed), call, clients)
                again = _as_index_list(fn(labels.clone(), clients, alpha, seed), call, clients)
            every = torch.cat(parts).sort().values
            if len(every) != len(labels) or not torch.equal(every, torch.arange(len(labels))):
                missing = len(labels) - len(torch.unique(every))
                repeated = len(every) - len(torch.unique(every))
                why = (
                    "Some samples went to two clients, as drawing at random (with replacement) or "
                    "overlapping cut points do: shuffle each class once and cut it into "
                    "consecutive parts that do not overlap"
                    if repeated
                    else "Rounding each client's count down (int(share * n)) drops the remainder: "
                    "cut each class's shuffled indices at the cumulative shares (np.cumsum, then "
                    "np.split), so that the parts always add up to the class"
                )
                raise ExerciseFailed(
                    f"{call} must use each of the {len(labels)} samples exactly once; "
                    f"{missing} are missing and {repeated} repeated. {why}"
                )
            if any(not torch.equal(a, b) for a, b in zip(parts, again, strict=True)):
                raise ExerciseFailed(f"{call} gave different splits for the same seed")
            found.append(fl.label_skew(labels, parts))
            if alpha == 1.0 and seed == 0 and _in_index_order(labels, parts):
                raise ExerciseFailed(
                    f"{call} gave every client a consecutive run of each class's samples in "
                    "index order (client 0 the first ones, then client 1, ...): shuffle each "
                    "class's indices (rng.permutation) before cutting them, or the split depends "
                    "on the order the data was stored in (client 0 gets the earliest-collected "
                    "samples of every class)"
                )
        skews[alpha] = sum(found) / len(found)
    if not skews[100.0] < 0.15 < 0.4 < skews[0.1]:
        hint = (
            " (it falls as alpha falls: is alpha inverted?)"
            if skews[0.1] < skews[100.0]
            else " Draw each class's shares with rng.dirichlet([alpha] * num_clients)"
        )
        raise ExerciseFailed(
            f"mean label skew {skews[100.0]:.2f} at alpha = 100 and {skews[0.1]:.2f} at alpha = "
            f"0.1; expected below 0.15 (almost IID) and above 0.4 (a few labels per client).{hint}"
        )
    for alpha in (0.0, -1.0):
        expect_value_error(
            f"your split with alpha={alpha}",
            lambda alpha=alpha: fn(labels.clone(), clients, alpha, 0),
            "Dirichlet needs alpha > 0",
        )
    return (
        f"every sample once, reproducible; mean skew {skews[100.0]:.2f} / {skews[1.0]:.2f} / "
        f"{skews[0.1]:.2f} at alpha = 100 / 1 / 0.1"
    )
