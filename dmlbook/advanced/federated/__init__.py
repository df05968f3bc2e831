"""Federated learning: FedAvg on real ranks, non-IID client splits and secure aggregation.

Chapter 10 ("Federated learning and edge devices") trains one model on data that never moves.
Rank 0 is the *server*: it holds the global model (and a test set to score it) but no training
data. Ranks 1, 2, ... host the *clients*; client ``c`` lives on rank ``1 + c % (world - 1)`` and
is the only rank that ever loads its data (``load_client(c)``). One round of :func:`fedavg`:

1. the server picks a fraction of the clients (:func:`sample_clients`, seeded by round, so every
   rank computes the same choice without a message) and broadcasts the global model;
2. each chosen client trains a copy for ``local_epochs`` epochs of SGD on its own data and uploads
   its *update* ``n_k * (w_k - w)`` together with its sample count ``n_k`` (:func:`client_update`);
3. the server adds the uploads and moves the global model by ``sum n_k (w_k - w) / sum n_k``
   (:func:`server_update`): the average of the client models weighted by their sample counts
   (McMahan et al. 2017; :func:`weighted_average` is the same on state dicts).

On the ranks, :func:`server_round` is rank 0's receive-add-step and :func:`client_round` a client
rank's train-and-send; :func:`fedavg` runs them round after round and keeps the record.

Uploads are fixed-point integers modulo 2**48 (:func:`encode`), so that
**secure aggregation** (Bonawitz et al. 2017) is exact: every pair of chosen clients agrees on a
seed through a Diffie-Hellman exchange whose public keys the server relays (:func:`dh_keypair`,
:func:`shared_seed`), both expand it into the same pseudo-random vector, and the lower-numbered
client adds it while the other subtracts it (:func:`pair_mask`, :func:`mask_update`). Each upload
the server receives looks uniformly random, but in the sum every mask meets its negative and the
server gets exactly the sum of the true updates. The integer sums are the same with and without
masks, so a secure run ends bit-identical to a plain one. The integers hold sums up to 2**23 in
size, far beyond any sum of weighted updates here. (Not covered: clients that drop out
mid-round, which the full protocol handles with secret-shared seeds.)

Tensors live on ``dmlbook.comm.groups.device()``: the CPU under gloo, each rank's GPU under NCCL.

The splits: :func:`iid_split` deals a shuffled dataset out evenly; :func:`dirichlet_split` draws
each class's share per client from Dirichlet(alpha): large alpha is close to IID, small alpha
gives each client a few labels (:func:`label_skew` measures it). Why skew hurts, at picture size:
:func:`quadratic_fedavg` runs FedAvg on two clients whose losses are 2-D quadratics, where many
local steps land the average off the global optimum (client drift). :func:`fedavg_reference` is the
same algorithm in one process, in float64, for the tests.
"""

from __future__ import annotations

from dmlbook.advanced.federated.drift import DriftRun, global_optimum, quadratic_fedavg
from dmlbook.advanced.federated.fedavg import (
    DigitsClients,
    DigitsTest,
    FedAvgConfig,
    Message,
    client_round,
    client_update,
    fedavg,
    fedavg_reference,
    local_sgd,
    server_round,
    server_update,
    weighted_average,
)
from dmlbook.advanced.federated.secure import (
    FRAC_BITS,
    MODULUS,
    decode,
    dh_keypair,
    encode,
    mask_update,
    pair_mask,
    shared_seed,
)
from dmlbook.advanced.federated.splits import (
    client_owner,
    dirichlet_split,
    iid_split,
    label_histograms,
    label_skew,
    sample_clients,
)

__all__ = [
    "FRAC_BITS",
    "MODULUS",
    "DigitsClients",
    "DriftRun",
    "DigitsTest",
    "Message",
    "client_owner",
    "client_round",
    "client_update",
    "decode",
    "dh_keypair",
    "dirichlet_split",
    "encode",
    "FedAvgConfig",
    "fedavg",
    "fedavg_reference",
    "global_optimum",
    "iid_split",
    "label_histograms",
    "label_skew",
    "local_sgd",
    "mask_update",
    "pair_mask",
    "quadratic_fedavg",
    "sample_clients",
    "server_round",
    "server_update",
    "shared_seed",
    "weighted_average",
]
