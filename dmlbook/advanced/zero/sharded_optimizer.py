"""Any torch.optim optimizer with its state split over N ranks, 1/N each: ZeRO-1 (chapter 9b).

Beyond the book: chapter 9b, ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models"), stage 1, with the contract of torch's
``torch.distributed.optim.ZeroRedundancyOptimizer``: ``ShardedOptimizer(params, optimizer_class,
**defaults)`` in place of ``optimizer_class(params, **defaults)``, under a data-parallel loop
(DDP, or :func:`dmlbook.data_parallel.average_gradients`) that has already averaged the gradients.

Each rank *owns* whole parameters (:func:`partition_parameters`), builds the wrapped optimizer
over its own parameters only, and so keeps the optimizer state of only those. A step runs the
wrapped optimizer on them, then every owner broadcasts its updated parameters, so every rank holds
the whole model again.

Why whole parameters: the wrapped optimizer sees each of its tensors whole, exactly as it would
unsharded, so *any* optimizer works, including those whose update is not elementwise:
Adafactor's row and column statistics and RMS clipping, the per-tensor trust ratios of LARS and
LAMB, Shampoo's and Muon's matrix preconditioners. Flat-sharded ZeRO-1
(:mod:`dmlbook.advanced.zero`, DeepSpeed) cuts the flattened parameters at arbitrary elements,
which is only right for an elementwise update such as SGD's or Adam's; anything else would need
extra collectives for the norms and statistics that straddle a cut.

What whole parameters cost, compared with flat-sharded ZeRO-1:

* balance: a parameter cannot be split, so a rank may hold up to the average plus one largest
  parameter (an embedding can dominate a small model), and ranks beyond the number of parameters
  own nothing;
* traffic: the gradients are all-reduced whole (2 passes of the model over a ring) and then each
  parameter is broadcast from its owner (one more pass): 1.5x plain data parallelism, where a
  flat reduce-scatter plus all-gather costs the same 2 passes as the all-reduce;
* gradients: every rank still holds the whole averaged gradient, though it steps only 1/N;
* messages: one broadcast per parameter (torch's ``parameters_as_bucket_view`` packs each rank's
  parameters into one buffer to send fewer, larger messages).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dmlbook.data_parallel.ps.sharding import assign_shards

__all__ = ["ShardedOptimizer", "optimizer_state_bytes", "partition_parameters"]


def partition_parameters(numels: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """The rank that owns each parameter, ``owners[group][i]``: sorted-greedy, as torch's
    ZeroRedundancyOptimizer. Group by group, parameters go largest first (equal sizes keep their
    order) to the rank holding the fewest elements so far (the lowest such rank); the loads carry
    over from one group to the next, so a new group leaves the earlier owners as they were.
    The greedy rule is chapter 2's :func:`~dmlbook.data_parallel.ps.sharding.assign_shards`."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size  # elements each rank owns so far, carried from group to group
    return [assign_shards(group, world_size, loads) for group in numels]


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``, each storage once: for a
    :class:`ShardedOptimizer`, the share this rank holds."""
    storages = {}
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if torch.is_tensor(value) and (nbytes := value.untyped_storage().nbytes()):
                storages[value.device, value.untyped_storage().data_ptr()] = nbytes
    return sum(storages.values())


class ShardedOptimizer(Optimizer):
    """Each rank of ``group`` keeps ``optimizer_class``'s state for only the whole parameters it
    owns, steps them, and broadcasts them to the others: 1/N of the state (ZeRO-1, chapter 9b).

    ``params`` and ``defaults`` are what ``optimizer_class`` takes: tensors, ``(name, tensor)``
    pairs or param-group dicts with their own hyper-parameters. A parameter listed twice in a
    group (tied weights) is kept once. Every rank must pass the same parameters, in the same
    order; a mismatch raises ``ValueError`` on every rank at construction, naming the rank and the
    parameter. Parameters whose ``.grad`` is None are left alone by the wrapped optimizer, and
    frozen ones (``requires_grad=False``, the same on every rank) are not sent.

    ``param_groups`` are the wrapper's (an LR scheduler changes them there; each step copies them
    to the wrapped optimizer). ``state`` holds this rank's share; :meth:`memory_per_rank` measures
    every rank's. Saving is torch's two-step: :meth:`consolidate_state_dict` on every rank, then
    :meth:`state_dict` on the receiving rank, which returns the plain ``optimizer_class``'s format
    (so a plain optimizer over the same param groups loads it, and this one loads a plain one's).
    Outside a process group it is the wrapped optimizer on one rank.
    """

    def __init__(self, params, optimizer_class: type[Optimizer], *, group=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                "optimizer_class must be a torch.optim.Optimizer subclass such as "
                f"torch.optim.AdamW (the class, not an instance), got {optimizer_class!r}"
            )
        groups = _as_groups(params)
        if dist.is_initialized():
            self.group = group if group is not None else dist.group.WORLD
            self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the group it was given")
        elif group is not None:
            raise ValueError("a group was given, but torch.distributed is not initialised")
        else:
            self.group, self.rank, self.world_size = None, 0, 1
        self.optim: Optimizer | None = None  # the wrapped optimizer, over this rank's parameters
        self._consolidated: dict[int, Any] | None = None
        super().__init__(groups, defaults)  # calls add_param_group for each group
        self._check_same_parameters()
        self._partition()
        local = [self._local_group(i) for i in range(len(self.param_groups))]
        self.optim = optimizer_class(local, **defaults)
        for ours, theirs in zip(self.param_groups, self.optim.param_groups, strict=True):
            for key, value in theirs.items():  # the class's own defaults, so that schedulers
                ours.setdefault(key, value)  # and state_dict() see every hyper-parameter
        self.defaults = dict(self.optim.defaults)
        self.state = self.optim.state  # this rank's share of the state

    # ---- who owns what

    def _partition(self) -> None:
        """``owner[p]``: the group rank that owns ``p``; ``partition[r]``: rank r's parameters."""
        numels = [[p.numel() for p in g["params"]] for g in self.param_groups]
        owners = partition_parameters(numels, self.world_size)
        self.owner: dict[torch.Tensor, int] = {}
        for group, group_owners in zip(self.param_groups, owners, strict=True):
            self.owner.update(zip(group["params"], group_owners, strict=True))
        ranks = range(self.world_size)
        self.partition = [[p for p, o in self.owner.items() if o == r] for r in ranks]

    def _local_group(self, index: int) -> dict[str, Any]:
        """Param group ``index`` as the wrapped optimizer sees it: only this rank's parameters."""
        group = self.param_groups[index]
        mine = [i for i, p in enumerate(group["params"]) if self.owner[p] == self.rank]
        local = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        local["params"] = [group["params"][i] for i in mine]
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        return local

    def _check_same_parameters(self) -> None:
        """Every rank must pass the same parameters, or the broadcasts would pair up the wrong
        tensors or wait forever: one all-gather of a short description compares them first, and
        every rank raises the same error."""
        if self.world_size == 1:
            return
        mine = [(g, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
                for g, group in enumerate(self.param_groups) for p in group["params"]]  # fmt: skip
        names = [
            n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))
        ]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)  # communication
        for rank, theirs in enumerate(everyone[1:], start=1):
            where = f"rank {dist.get_global_rank(self.group, rank)}"
            if len(theirs) != len(everyone[0]):
                raise ValueError(
                    f"ranks passed different parameters: {where} passed {len(theirs)}, "
                    f"rank {dist.get_global_rank(self.group, 0)} passed {len(everyone[0])}"
                )
            for i, (want, got) in enumerate(zip(everyone[0], theirs, strict=True)):
                if want != got:
                    name = f"parameter {i}" + (f" ({names[i]!r})" if names[i] else "")
                    raise ValueError(
                        f"ranks passed different parameters: on {where}, {name} is "
                        f"{_describe(got)}; on rank {dist.get_global_rank(self.group, 0)} it is "
                        f"{_describe(want)}"
                    )

    # ---- the optimizer's interface

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (on every rank: collective); its parameters are shared out as the first
        ones were, which leaves the owners of the earlier groups unchanged."""
        super().add_param_group(_without_duplicates(param_group))
        if self.optim is None:  # still inside Optimizer.__init__
            return
        self._check_same_parameters()
        self._partition()
        self.optim.add_param_group(self._local_group(len(self.param_groups) - 1))

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the wrapped optimizer on this rank's parameters, then share them with the ranks."""
        self._consolidated = None  # a consolidated state is out of date after a step
        for ours, theirs in zip(self.param_groups, self.optim.param_groups, strict=True):
            theirs.update({k: v for k, v in ours.items() if k not in ("params", "param_names")})
        loss = self.optim.step() if closure is None else self.optim.step(closure)  # compute
        self._broadcast_parameters()
        return loss

    def _broadcast_parameters(self) -> None:
        """Each owner sends its parameters to every rank; all start, then all are waited for."""
        if self.world_size == 1:
            return
        works = []
        for owner, params in enumerate(self.partition):
            src = dist.get_global_rank(self.group, owner)  # broadcast names a global rank
            for p in params:
                if p.requires_grad:  # a frozen parameter has not changed
                    works.append(dist.broadcast(p.detach(), src, self.group, async_op=True))
        for work in works:  # communication
            work.wait()

    def memory_per_rank(self) -> list[int]:
        """Bytes of optimizer state each rank of the group holds, measured from its state
        tensors (collective)."""
        mine = optimizer_state_bytes(self.optim)
        if self.world_size == 1:
            return [mine]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)  # communication
        return everyone

    # ---- saving and loading

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's share of the state, on CPU, onto group rank ``to`` (collective)."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        mine = {index[p]: _cpu_copy(state) for p, state in self.optim.state.items()}
        everyone: list[Any] | None = [None] * self.world_size if self.rank == to else None
        if self.world_size == 1:
            everyone = [mine]
        else:
            dst = dist.get_global_rank(self.group, to)
            dist.gather_object(mine, everyone, dst=dst, group=self.group)  # communication
        if self.rank == to:
            self._consolidated = dict(sorted(kv for share in everyone for kv in share.items()))

    def state_dict(self) -> dict[str, Any]:
        """The whole state in the plain ``optimizer_class``'s format, on the rank that
        :meth:`consolidate_state_dict` gathered it on, as of that call (a step makes it stale)."""
        if self._consolidated is None:
            raise RuntimeError(
                f"no consolidated state on rank {self.rank} (or a step has changed it since): "
                f"call consolidate_state_dict(to={self.rank}) on every rank first"
            )
        groups, start = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": self._consolidated, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (from :meth:`state_dict` or a plain optimizer's) on every rank; each
        rank keeps a copy of only its own parameters' state."""
        saved_groups = state_dict["param_groups"]
        sizes, saved_sizes = (
            [len(g["params"]) for g in gs] for gs in (self.param_groups, saved_groups)
        )
        if saved_sizes != sizes:
            raise ValueError(f"the state dict's groups hold {saved_sizes} parameters, not {sizes}")
        local_state, local_groups, local_index = {}, [], 0  # the wrapped optimizer's numbering
        for ours, saved in zip(self.param_groups, saved_groups, strict=True):
            ours.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
            local = {k: v for k, v in ours.items() if k not in ("params", "param_names")}
            local["params"] = []
            for p, i in zip(ours["params"], saved["params"], strict=True):
                if self.owner[p] == self.rank:
                    if i in state_dict["state"]:
                        local_state[local_index] = copy.deepcopy(state_dict["state"][i])
                    local["params"].append(local_index)
                    local_index += 1
            local_groups.append(local)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state  # loading replaced the wrapped optimizer's state object
        self._consolidated = None


def _as_groups(params: Iterable) -> list[dict[str, Any]]:
    """``params`` as a list of param-group dicts, each parameter once per group."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or param-group dicts, not a tensor")
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [_without_duplicates(g) for g in groups]
    if not sum(len(g["params"]) for g in groups):
        raise ValueError("ShardedOptimizer got an empty parameter list: there is nothing to shard")
    return groups


def _without_duplicates(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``group`` in which a parameter reachable twice (tied weights) appears once."""
    params = group["params"]
    if isinstance(params, set):  # unordered: the Optimizer refuses it with its own message
        return group
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    seen, kept = set(), []
    for entry in params:
        tensor = entry[1] if isinstance(entry, tuple) else entry
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept.append(entry)
    return {**group, "params": kept}


def _describe(entry: tuple) -> str:
    group, shape, dtype, trainable = entry
    return f"{dtype} {list(shape)} in group {group}" + ("" if trainable else ", frozen")


def _cpu_copy(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
        for k, v in state.items()
    }
