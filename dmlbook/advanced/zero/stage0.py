"""ZeRO's engine and stage 0, plain data parallelism, in the layout the stages share (ch. 9b).

Every *unit* (by default each module that owns parameters directly) flattens its parameters into
one buffer padded to a multiple of the world size and cut into equal shards (:class:`FlatUnit`).
:class:`ZeroStage0` all-reduces the gradients and steps Adam on every element; it holds the
machinery the sharded stages (:mod:`dmlbook.advanced.zero.stages`) extend: the units, the layout
check, the collectives (torch's or chapter 2's) and the memory measurement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.advanced.zero.accounting import COLLECTIVES, MemoryMeter, distinct_storages
from dmlbook.comm import collectives as C  # a parameter below is named "collectives"
from dmlbook.comm.groups import padded_block, padded_size
from dmlbook.optim import adam_update_

# One Adam update, in place and elementwise: :func:`dmlbook.optim.adam_update_` (the same order of
# operations as torch.optim.Adam). Elementwise is what lets each ZeRO rank step only its shard and
# still match an optimizer that sees every parameter.

# --------------------------------------------------------------------------- the layout


def flat_buffer(params: Sequence[torch.Tensor], world_size: int) -> torch.Tensor:
    """One unit's parameters copied into one flat buffer, padded with zeros to N x S elements
    (S = ceil(numel / N)); each parameter becomes a view of its slice (chapter 9b). Rank r's
    shard is ``flat[r * S : (r + 1) * S]``."""
    numel = sum(p.numel() for p in params)
    S = -(-numel // world_size)  # shard size: ceil(numel / N)
    flat = params[0].new_zeros(S * world_size)  # the padding: zeros after the last parameter
    offset = 0
    for p in params:
        view = flat[offset : offset + p.numel()].view(p.shape)
        view.copy_(p.detach())
        p.data = view  # the parameter now reads and writes the buffer
        offset += p.numel()
    return flat


# --------------------------------------------------------------------------- the engine


class FlatUnit:
    """One module's parameters as a flat buffer padded to a multiple of N, cut into N shards."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], n: int, r: int):
        self.name, self.module, self.params = name, module, params
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.padded = padded_size(self.numel, n)
        self.start, self.stop = padded_block(self.numel, rank=r, world_size=n)
        self.full_param: torch.Tensor | None = None  # the whole flat buffer (stage 3: its
        # storage is resized to nothing when freed; the parameters stay views of it)
        self.param_shard: torch.Tensor | None = None  # stage 3: only the own shard is kept
        self.full_grad: torch.Tensor | None = None  # stages 0-1: always; 2-3: during backward
        self.grad_shard: torch.Tensor | None = None  # stages 2-3
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.ready: set[int] = set()  # parameters whose gradient backward has produced
        self.gathered_for_backward = False

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[o : o + n].view(shape)
            for o, n, shape in zip(self.offsets, self.numels, self.shapes, strict=True)
        ]


class ZeroStage0(nn.Module):
    """Train ``module`` data-parallel with Adam over ``group``: stage 0, plain data parallelism
    (an all-reduce of the gradients, Adam on every element), and the machinery the sharded
    stages extend (:class:`ZeroStage1`, :class:`ZeroStage2`, :class:`ZeroStage3`; pick one by
    number with :func:`zero_data_parallel`).

    Use it as a model and an optimizer in one: ``out = zero(x)``, ``loss.backward()``,
    ``zero.step()``, ``zero.zero_grad()``. Every rank must pass the same initial parameters.
    ``units`` lists the modules whose parameters form one flat buffer each (and, at stage 3, are
    gathered together); by default every module that owns parameters directly. Stage 3 needs
    each unit's parameters to be used only inside that unit's forward, once per step. Outside a
    process group it runs as world size 1. Between steps at stage 3 the module's parameters have
    no storage: read them with :meth:`full_parameters`, not ``state_dict()``.
    """

    stage = 0

    def __init__(
        self,
        module: nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        group=None,
        collectives: str = "torch",
        units: Sequence[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.module, self.group = module, group
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.collectives = collectives
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:  # one process on its own: every stage is plain Adam, no communication
            self.rank, self.world_size = 0, 1
        self.steps = 0
        self.memory = MemoryMeter()
        self.sent_bytes = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}  # tensor bytes
        self._units = self._build_units(units)
        self._check_same_layout()
        self._handles: list = []
        self._callback_queued = False
        for unit in self._units:
            self._shard(unit)
        self.register_hooks()
        self._measure("after setup")

    # ---- layout

    def _build_units(self, units: Sequence[nn.Module] | None) -> list[FlatUnit]:
        names = {m: n for n, m in self.module.named_modules()}
        if units is None:
            units = [m for m in self.module.modules() if any(True for _ in m.parameters(False))]
        claimed: set[int] = set()
        built = []
        for module in units:
            if module not in names:
                raise ValueError(f"unit {type(module).__name__} is not a submodule of the model")
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in claimed]
            claimed.update(id(p) for p in params)
            if params:
                built.append(FlatUnit(names[module] or "<root>", module, params, self.world_size,
                                   self.rank))  # fmt: skip
        missing = [n for n, p in self.module.named_parameters() if p.requires_grad
                   and id(p) not in claimed]  # fmt: skip
        if missing:
            raise ValueError(f"parameters {missing} belong to no unit: add their modules to units")
        return built

    def _check_same_layout(self) -> None:
        """Every rank must cut the same units: a mismatch would make the collectives wait for
        each other forever, so two tiny all-reduces compare the layouts first."""
        if self.world_size == 1:
            return
        like = self._units[0].params[0] if self._units else torch.empty(0)
        layout = [len(self._units), sum(u.numel for u in self._units)]
        mine = torch.tensor(layout, dtype=torch.int64, device=like.device)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(high, dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(low, high):
            raise ValueError(
                f"ranks passed different models: rank {self.rank} has {mine[0]} units of "
                f"{mine[1]} parameters; units range over {low[0]}..{high[0]}, parameters over "
                f"{low[1]}..{high[1]}"
            )

    def _shard(self, unit: FlatUnit) -> None:
        like = unit.params[0]
        moments = self._owned(unit)
        unit.exp_avg, unit.exp_avg_sq = like.new_zeros(moments), like.new_zeros(moments)
        unit.full_param = flat_buffer(unit.params, self.world_size)  # parameters: views of it
        self._place_gradients(unit)

    def _owned(self, unit: FlatUnit) -> int:
        """How many elements of the unit this rank steps (and keeps Adam's moments for)."""
        return unit.padded

    def _place_gradients(self, unit: FlatUnit) -> None:
        """Gradients accumulate straight into the unit's flat buffer."""
        unit.full_grad = torch.zeros_like(unit.full_param)
        for p, view in zip(unit.params, unit.views(unit.full_grad), strict=True):
            p.grad = view

    def register_hooks(self) -> None:
        """Stage 0 and 1 need none: the gradients are averaged in :meth:`step`."""

    # ---- the collectives, torch's or chapter 2's

    def _reduce_scatter_avg(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard <- this rank's shard of the average over ranks of ``full``."""
        self.sent_bytes["reduce_scatter"] += full.numel() * full.element_size()
        if self.world_size == 1:
            shard.copy_(full)
        elif self.collectives == "dmlbook":
            C.reduce_scatter(
                shard, list(full.chunk(self.world_size)), dist.ReduceOp.AVG, self.group
            )
        else:
            rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            rs(shard, full, op=dist.ReduceOp.AVG, group=self.group)

    def _all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full <- every rank's shard, in rank order (``shard`` may be a view of ``full``)."""
        self.sent_bytes["all_gather"] += full.numel() * full.element_size()
        if self.world_size == 1:
            full.copy_(shard)
            return
        if shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            shard = shard.clone()  # a separate send buffer: the output is written while sending
        if self.collectives == "dmlbook":
            C.all_gather(list(full.chunk(self.world_size)), shard, self.group)
        else:
            ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            ag(full, shard, group=self.group)

    def _all_reduce_avg(self, full: torch.Tensor) -> None:
        self.sent_bytes["all_reduce"] += full.numel() * full.element_size()
        if self.world_size == 1:
            return
        if self.collectives == "dmlbook":
            C.all_reduce(full, dist.ReduceOp.AVG, self.group)
        else:
            dist.all_reduce(full, dist.ReduceOp.AVG, group=self.group)

    # ---- the step

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (they stay allocated: ``set_to_none`` is accepted,
        as the one training loop passes it, and changes nothing)."""
        for unit in self._units:
            unit.full_grad.zero_()

    def step(self) -> None:
        """Average the gradients, step Adam on this rank's part, and share the new parameters."""
        self.steps += 1
        for unit in self._units:
            self.step_unit(unit)
        self._measure("after step")

    def step_unit(self, unit: FlatUnit) -> None:
        """Stage 0: all-reduce the gradient, and every rank steps every element."""
        self._all_reduce_avg(unit.full_grad)
        self._adam(unit.full_param, unit.full_grad, unit)

    def _adam(self, param: torch.Tensor, grad: torch.Tensor, unit: FlatUnit) -> None:
        with torch.no_grad():
            adam_update_(param, grad, unit.exp_avg, unit.exp_avg_sq, self.steps, self.lr,
                         *self.betas, self.eps, self.weight_decay)  # fmt: skip

    # ---- what the rank holds

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now, counted from
        the storages of the tensors (the module's parameters and gradients and the flat
        buffers), each storage once."""
        params = distinct_storages([p for u in self._units for p in u.params]
                                   + [u.full_param for u in self._units]
                                   + [u.param_shard for u in self._units])  # fmt: skip
        grads = distinct_storages([p.grad for u in self._units for p in u.params]
                                  + [u.full_grad for u in self._units]
                                  + [u.grad_shard for u in self._units])  # fmt: skip
        state = distinct_storages(
            [u.exp_avg for u in self._units] + [u.exp_avg_sq for u in self._units]
        )
        return {
            "parameters": sum(params.values()),
            "gradients": sum(grads.values()),
            "optimizer state": sum(state.values()),
        }

    def _measure(self, where: str) -> None:
        self.memory.record(where, self.held_bytes())

    @property
    def unit_sizes(self) -> list[int]:
        """Unpadded number of parameters in each unit."""
        return [u.numel for u in self._units]

    @property
    def shard_sizes(self) -> list[int]:
        """Elements of each unit a rank owns, padding included (the same on every rank)."""
        return [u.stop - u.start for u in self._units]

    def _gathered(self, unit: FlatUnit) -> bool:
        return True  # below stage 3 every rank holds every parameter

    def gather_params(self, unit: FlatUnit) -> None:
        pass

    def free_params(self, unit: FlatUnit) -> None:
        pass

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> the whole parameter (a copy), gathering the shards at stage 3 (collective)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        full = {}
        for unit in self._units:
            was_gathered = self._gathered(unit)
            self.gather_params(unit)
            for p in unit.params:
                full[names[id(p)]] = p.detach().clone()
            if not was_gathered:
                self.free_params(unit)
        return full
