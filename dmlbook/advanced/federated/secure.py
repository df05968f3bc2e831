"""Secure aggregation: fixed-point uploads modulo 2**48, Diffie-Hellman seeds, pairwise masks that
cancel in the server's sum (Bonawitz et al. 2017; chapter 10, see
:mod:`dmlbook.advanced.federated`).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

MODULUS = 2**48  # uploads live in the integers modulo 2**48; int64 holds any sum of two of them


FRAC_BITS = 24  # fixed point: x is sent as round(x * 2**24), a resolution of 6e-8


# Toy Diffie-Hellman group: the Mersenne prime 2**127 - 1 and generator 3. It shows the idea;
# a deployment uses a standard 2048-bit group or X25519.
DH_PRIME = 2**127 - 1


DH_GENERATOR = 3


def encode(values: torch.Tensor) -> torch.Tensor:
    """Floats to fixed-point integers modulo MODULUS: round(x * 2**FRAC_BITS) % MODULUS, as
    int64 in [0, MODULUS); a negative -y becomes MODULUS - y."""
    q = torch.round(values.detach().double() * 2**FRAC_BITS)
    if q.abs().max() >= MODULUS // 2:
        raise ValueError(f"a value of {values.abs().max().item():.3g} overflows the fixed point")
    return q.long() % MODULUS


def decode(encoded: torch.Tensor) -> torch.Tensor:
    """Integers modulo MODULUS back to float64: those from MODULUS / 2 up stand for negative
    numbers (v - MODULUS), the way encode stored them."""
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
    uniform in [0, MODULUS). Both clients of the pair get the same vector, a new one per round."""
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
