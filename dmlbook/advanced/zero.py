"""ZeRO stages 1, 2 and 3: data parallelism without the replicated model states ("beyond the book").

Plain data parallelism (chapters 1 and 3) keeps a whole copy of the model states on every rank.
With fp32 Adam that is 16 bytes per parameter: 4 for the parameter, 4 for its gradient and 8 for
Adam's two moments. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models") removes the copies in three stages, each keeping the arithmetic of
plain data parallelism exactly:

* stage 1 (P_os) shards the optimizer state: rank r keeps Adam's moments only for its 1/N of
  the parameters, steps only those, and an all-gather hands the updated parameters round;
* stage 2 (P_os+g) also shards the gradients: each layer's gradient is reduce-scattered as soon
  as backward has produced it, and a rank keeps only the averaged gradient of its own shard;
* stage 3 (P_os+g+p) also shards the parameters: a layer's parameters are all-gathered just
  before its forward, freed after it, gathered again just before its backward and freed again.

Stage 0 is plain data parallelism in the same code (an all-reduce of the gradients, Adam on every
element), so that memory and communication can be measured for all four in one way.

The layout, as in FSDP1's flat parameter: every *unit* (by default each module that owns
parameters directly, such as an ``nn.Linear``) flattens its parameters into one flat buffer,
padded with zeros to a multiple of the world size N, and split into N equal shards; rank r owns
elements ``[r * S, (r + 1) * S)`` with ``S = ceil(numel / N)``. Padding never changes a result:
a padded element starts at 0, its gradient is always 0, so Adam leaves it at 0. It costs at most
N - 1 elements per unit, and is counted in the memory measurement.

Collectives: ``collectives="torch"`` (the default) uses ``dist.reduce_scatter_single`` and
``dist.all_gather_single`` (torch 2.13's names for ``reduce_scatter_tensor`` and
``all_gather_into_tensor``, which older versions use). Gloo on CPU runs both, ``ReduceOp.AVG``
included, but its reduce-scatter is an all-reduce from which each rank keeps its chunk (pytorch
PRs #112144 and #118911): right numbers, twice the traffic of a real reduce-scatter. NCCL's is a
real one. ``collectives="dmlbook"`` uses chapter 2's ring ``reduce_scatter`` / ``all_gather``,
built from point-to-point messages: a real ring on every backend, and
:func:`dmlbook.comm.collectives.recording` counts each message it sends.

:class:`MemoryMeter` measures what each stage holds: at every point of a step where the held
set changes (each gather, each reduce-scatter, the end of backward, the step) it adds up the
bytes of the parameters, gradients and optimizer state the rank actually holds, counted from the
tensors' storages. :func:`expected_bytes` is the paper's formula with this layout's padding and
the unit in flight (at stages 2 and 3 one unit's full gradient waits for its reduce-scatter; at
stage 3 its parameters are gathered meanwhile); :func:`paper_bytes` is the formula as the paper
writes it, which leaves such temporary buffers out. The notebook
``chapters/09b_zero_sharding.ipynb`` ("Beyond the book: ZeRO and FSDP") uses this module, and
checks it against FSDP2.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dmlbook.comm import collectives as C  # a parameter below is named "collectives"
from dmlbook.comm.groups import padded_block, padded_size
from dmlbook.optim import adam_update_

__all__ = [
    "STAGES",
    "COLLECTIVES",
    "MemoryMeter",
    "PARTS",
    "ZeroDataParallel",
    "comm_bytes_per_step",
    "ddp_train",
    "expected_bytes",
    "fsdp2_train",
    "paper_bytes",
    "train",
]

STAGES = (0, 1, 2, 3)
COLLECTIVES = ("torch", "dmlbook")
PARTS = ("parameters", "gradients", "optimizer state")


# --------------------------------------------------------------------------- Adam on a shard


# One Adam update, in place and elementwise: :func:`dmlbook.optim.adam_update_` (the same order of
# operations as torch.optim.Adam). Elementwise is what lets each ZeRO rank step only its shard and
# still match an optimizer that sees every parameter.


# --------------------------------------------------------------------------- memory


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage behind ``tensors`` (views count once)."""
    found = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


@dataclass
class MemoryMeter:
    """Samples of the bytes a rank holds, per part; ``peak`` is the sample with the largest total.

    Autograd's in-flight temporaries (a gradient between its computation and the hook that takes
    it), activations and the collectives' own scratch buffers are not model states and are not
    counted, as in the paper."""

    samples: list[dict[str, int]] = field(default_factory=list)

    def record(self, where: str, held: dict[str, int]) -> None:
        self.samples.append({"where": where, **held})

    @property
    def peak(self) -> dict[str, int]:
        """The sample with the largest total: {part: bytes, ..., "total": bytes, "where": ...}."""
        if not self.samples:
            raise ValueError("nothing measured yet: run a step first")
        best = max(self.samples, key=lambda s: sum(s[p] for p in PARTS))
        return {**{p: best[p] for p in PARTS}, "total": sum(best[p] for p in PARTS),
                "where": best["where"]}  # fmt: skip

    def reset(self) -> None:
        self.samples.clear()


def paper_bytes(
    psi: int, world_size: int, stage: int, k: int = 12, param_bytes: int = 2, grad_bytes: int = 2
) -> dict[str, float]:
    """The ZeRO paper's model-state bytes per rank: parameters, gradients, optimizer state.

    Mixed-precision Adam (the paper): 2-byte parameters and gradients and K = 12 bytes of fp32
    master copy and moments. Pure fp32 Adam (this package's runs): ``param_bytes=4,
    grad_bytes=4, k=8``. Baseline (2+2+K)Psi; P_os 2Psi + 2Psi + K Psi/N; P_os+g 2Psi + (2+K)Psi/N;
    P_os+g+p (2+2+K)Psi/N."""
    _check_stage(stage)
    n = world_size
    return {
        "parameters": param_bytes * psi / (n if stage >= 3 else 1),
        "gradients": grad_bytes * psi / (n if stage >= 2 else 1),
        "optimizer state": k * psi / (n if stage >= 1 else 1),
    }


def expected_bytes(
    unit_sizes: Sequence[int], world_size: int, stage: int, element_size: int = 4
) -> dict[str, int]:
    """What :class:`ZeroDataParallel` should hold at its peak, per part: the paper's formula for
    Adam (2 moments, so K = 2 x element_size) on the padded units, plus the transients of this
    layout: at stages 2 and 3 the full gradient of one unit (the largest) waits for its
    reduce-scatter, and at stage 3 that unit's parameters are gathered at the same time."""
    _check_stage(stage)
    padded = [padded_size(n, world_size) for n in unit_sizes]
    full, shard, largest = sum(padded), sum(padded) // world_size, max(padded, default=0)
    params = shard + largest if stage == 3 else full
    grads = full if stage <= 1 else shard + largest
    moments = 2 * (full if stage == 0 else shard)
    return {
        "parameters": params * element_size,
        "gradients": grads * element_size,
        "optimizer state": moments * element_size,
    }


def comm_bytes_per_step(numel: int, world_size: int, stage: int, element_size: int = 4) -> float:
    """Bytes one rank sends per step over a ring: all-reduce 2(N-1)/N Psi for stage 0;
    reduce-scatter + all-gather, the same 2(N-1)/N Psi, for stages 1 and 2; two all-gathers (for
    forward and for backward) and a reduce-scatter, 3(N-1)/N Psi (1.5x), for stage 3."""
    _check_stage(stage)
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * numel * element_size


def _check_stage(stage) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"stage must be one of {STAGES} (0 = plain data parallelism), got {stage!r}"
        )


# --------------------------------------------------------------------------- the engine


class _Unit:
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

    def flatten(self, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        flat = like.new_zeros(self.padded)
        for t, offset, numel in zip(tensors, self.offsets, self.numels, strict=True):
            flat[offset : offset + numel] = t.detach().reshape(-1)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[o : o + n].view(shape)
            for o, n, shape in zip(self.offsets, self.numels, self.shapes, strict=True)
        ]


class ZeroDataParallel(nn.Module):
    """Train ``module`` data-parallel with Adam and ZeRO ``stage`` 0-3 over ``group``.

    Use it as a model and an optimizer in one: ``out = zero(x)``, ``loss.backward()``,
    ``zero.step()``, ``zero.zero_grad()``. Every rank must pass the same initial parameters.
    ``units`` lists the modules whose parameters form one flat buffer each (and, at stage 3, are
    gathered together); by default every module that owns parameters directly. Stage 3 needs
    each unit's parameters to be used only inside that unit's forward, once per step. Outside a
    process group it runs as world size 1. Between steps at stage 3 the module's parameters have
    no storage: read them with :meth:`full_parameters`, not ``state_dict()``.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        group=None,
        collectives: str = "torch",
        units: Sequence[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        _check_stage(stage)
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.module, self.stage, self.group = module, stage, group
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
        self._install_hooks()
        self._measure("after setup")

    # ---- layout

    def _build_units(self, units: Sequence[nn.Module] | None) -> list[_Unit]:
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
                built.append(_Unit(names[module] or "<root>", module, params, self.world_size,
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

    def _shard(self, unit: _Unit) -> None:
        like = unit.params[0]
        flat = unit.flatten(unit.params, like)
        moments = flat.numel() if self.stage == 0 else unit.stop - unit.start
        unit.exp_avg, unit.exp_avg_sq = like.new_zeros(moments), like.new_zeros(moments)
        unit.full_param = flat  # the module's parameters become views of it
        for p, view in zip(unit.params, unit.views(flat), strict=True):
            p.data = view
        if self.stage == 3:
            unit.param_shard = flat[unit.start : unit.stop].clone()
            self._free_params(unit)
        if self.stage <= 1:  # gradients accumulate straight into the flat buffer
            unit.full_grad = torch.zeros_like(flat)
            for p, view in zip(unit.params, unit.views(unit.full_grad), strict=True):
                p.grad = view
        else:
            unit.grad_shard = like.new_zeros(unit.stop - unit.start)

    def _install_hooks(self) -> None:
        if self.stage >= 2:
            for unit in self._units:
                for i, p in enumerate(unit.params):
                    hook = p.register_post_accumulate_grad_hook(self._grad_hook(unit, i))
                    self._handles.append(hook)
        if self.stage == 3:
            for unit in self._units:
                self._handles.append(unit.module.register_forward_pre_hook(self._pre_forward(unit)))
                self._handles.append(unit.module.register_forward_hook(self._post_forward(unit)))

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

    # ---- stage 3: gather just in time, free right after

    # The parameters (and any view autograd saved for backward, such as a weight's transpose)
    # stay views of the unit's flat buffer; freeing resizes its storage to zero bytes, and
    # gathering gives it its bytes back and fills them, so every view sees the gathered numbers.

    @staticmethod
    def _gathered(unit: _Unit) -> bool:
        return unit.full_param.untyped_storage().nbytes() > 0

    def _gather_params(self, unit: _Unit) -> None:
        if self._gathered(unit):
            return
        storage = unit.full_param.untyped_storage()
        storage.resize_(unit.padded * unit.full_param.element_size())
        self._all_gather(unit.full_param, unit.param_shard)

    def _free_params(self, unit: _Unit) -> None:
        unit.full_param.untyped_storage().resize_(0)

    def _pre_forward(self, unit: _Unit) -> Callable:
        def hook(module, args):
            self._gather_params(unit)
            self._measure(f"forward {unit.name}: gathered")

        return hook

    def _post_forward(self, unit: _Unit) -> Callable:
        def hook(module, args, output):
            self._free_params(unit)
            outputs = output if isinstance(output, tuple | list) else (output,)
            for out in outputs:
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    unit.gathered_for_backward = False
                    out.register_hook(self._pre_backward(unit))

        return hook

    def _pre_backward(self, unit: _Unit) -> Callable:
        def hook(grad):  # the gradient of the unit's output: its backward is next
            self._queue_end_of_backward()
            if not unit.gathered_for_backward:
                unit.gathered_for_backward = True
                self._gather_params(unit)
                self._measure(f"backward {unit.name}: gathered")

        return hook

    # ---- stages 2 and 3: reduce-scatter each unit's gradient as soon as backward has made it

    def _grad_hook(self, unit: _Unit, index: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self._queue_end_of_backward()
            if unit.full_grad is None:
                unit.full_grad = param.grad.new_zeros(unit.padded)
            offset, numel = unit.offsets[index], unit.numels[index]
            unit.full_grad[offset : offset + numel] += param.grad.reshape(-1)
            param.grad = None  # autograd's copy is released; the flat buffer holds it
            unit.ready.add(index)
            if len(unit.ready) == len(unit.params):
                self._reduce_unit_grad(unit)

        return hook

    def _reduce_unit_grad(self, unit: _Unit) -> None:
        self._measure(f"backward {unit.name}: gradient complete")
        reduced = torch.empty_like(unit.grad_shard)
        self._reduce_scatter_avg(reduced, unit.full_grad)
        unit.grad_shard += reduced  # accumulates across backward passes until zero_grad
        unit.full_grad, unit.ready = None, set()
        if self.stage == 3:
            self._free_params(unit)
            unit.gathered_for_backward = False

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for unit in self._units:  # parameters backward never reached have a zero gradient
            if unit.full_grad is not None or (self.stage == 3 and self._gathered(unit)):
                if unit.full_grad is None:
                    unit.full_grad = unit.param_shard.new_zeros(unit.padded)
                self._reduce_unit_grad(unit)
        self._measure("end of backward")

    # ---- the step

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self) -> None:
        for unit in self._units:
            if self.stage <= 1:
                unit.full_grad.zero_()
            else:
                unit.grad_shard.zero_()

    def step(self) -> None:
        """Average the gradients, step Adam on this rank's shard, and share the new parameters."""
        self.steps += 1
        for unit in self._units:
            if self.stage == 0:  # plain data parallelism: every rank steps every element
                self._all_reduce_avg(unit.full_grad)
                self._adam(unit.full_param, unit.full_grad, unit)
                continue
            if self.stage == 1:  # reduce-scatter in place, into this rank's slice of the full
                # gradient (an output that is the input's own chunk is allowed, as in NCCL)
                grad = unit.full_grad[unit.start : unit.stop]
                self._reduce_scatter_avg(grad, unit.full_grad)
            else:
                grad = unit.grad_shard
            if self.stage == 3:
                self._adam(unit.param_shard, grad, unit)
            else:
                mine = unit.full_param[unit.start : unit.stop]
                self._adam(mine, grad, unit)
                self._all_gather(unit.full_param, mine)
        self._measure("after step")

    def _adam(self, param: torch.Tensor, grad: torch.Tensor, unit: _Unit) -> None:
        with torch.no_grad():
            adam_update_(param, grad, unit.exp_avg, unit.exp_avg_sq, self.steps, self.lr,
                         *self.betas, self.eps, self.weight_decay)  # fmt: skip

    # ---- what the rank holds

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now, counted from
        the storages of the tensors (the module's parameters and gradients and the flat
        buffers), each storage once."""
        params = _storages([p for u in self._units for p in u.params]
                           + [u.full_param for u in self._units]
                           + [u.param_shard for u in self._units])  # fmt: skip
        grads = _storages([p.grad for u in self._units for p in u.params]
                          + [u.full_grad for u in self._units]
                          + [u.grad_shard for u in self._units])  # fmt: skip
        state = _storages([u.exp_avg for u in self._units] + [u.exp_avg_sq for u in self._units])
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

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> the whole parameter (a copy), gathering the shards at stage 3 (collective)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        full = {}
        for unit in self._units:
            was_gathered = self._gathered(unit)
            self._gather_params(unit)
            for p in unit.params:
                full[names[id(p)]] = p.detach().clone()
            if not was_gathered:
                self._free_params(unit)
        return full


# --------------------------------------------------------------------------- rank functions


def _local_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a global batch (equal shares: the global batch must divide)."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(x) % size:
        raise ValueError(f"global batch of {len(x)} does not split evenly over {size} ranks")
    share = len(x) // size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    stage: int,
    lr: float = 1e-2,
    loss_fn: Callable = nn.functional.cross_entropy,
    collectives: str = "torch",
    record_sends: bool = False,
) -> dict:
    """Rank function: train ``make_model()`` with ZeRO ``stage`` on each global batch (this rank
    takes its equal share of the rows). Returns the full parameters, the losses, the peak
    memory (and every sample), the unit sizes and the bytes this rank passed to (and, with
    ``record_sends``, actually sent through) the collectives in the last step."""
    zero = ZeroDataParallel(make_model(), stage, lr=lr, collectives=collectives)
    losses, sends = [], []
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if last:
            zero.memory.reset()
            zero.sent_bytes = dict.fromkeys(zero.sent_bytes, 0)
        xs, ys = _local_batch(x, y)
        zero.zero_grad()
        recording = C.recording() if record_sends and last else nullcontext([])
        with recording as sent:
            loss = loss_fn(zero(xs), ys)
            loss.backward()
            zero.step()
        sends = [s.nbytes for s in sent]
        losses.append(loss.item())
    passed = dict(zero.sent_bytes)  # before full_parameters() gathers once more
    return {
        "parameters": zero.full_parameters(),
        "losses": losses,
        "peak": zero.memory.peak,
        "samples": list(zero.memory.samples),
        "unit_sizes": zero.unit_sizes,
        "passed_bytes": passed,
        "sent_bytes": sum(sends),
    }


def ddp_train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-2,
    loss_fn: Callable = nn.functional.cross_entropy,
    torch_ddp: bool = False,
) -> dict[str, torch.Tensor]:
    """Rank function, the reference: plain data parallelism with Adam on the same shares of the
    same batches; returns the parameters. By default chapter 3's
    :class:`~dmlbook.data_parallel.BucketedDDP` (checked against torch's DDP in chapter 3) and
    :func:`adam_update_` per parameter; ``torch_ddp=True`` uses torch's DistributedDataParallel and
    ``torch.optim.Adam``, whose first step imports torch._dynamo (seconds on a small machine).
    Outside a process group it is single-process training."""
    model = make_model()
    if torch_ddp:
        from torch.nn.parallel import DistributedDataParallel

        ddp, optimizer = DistributedDataParallel(model), torch.optim.Adam(model.parameters(), lr)
    else:
        from dmlbook.data_parallel import BucketedDDP

        ddp = BucketedDDP(model) if dist.is_initialized() else model
        optimizer = _PlainAdam(list(model.parameters()), lr)
    for x, y in batches:
        xs, ys = _local_batch(x, y)
        optimizer.zero_grad()
        loss_fn(ddp(xs), ys).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _PlainAdam:
    """:func:`adam_update_` on every parameter, with its moments: Adam with nothing sharded."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params, self.lr, self.steps = params, lr, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for p, (exp_avg, exp_avg_sq) in zip(self.params, self.moments, strict=True):
            adam_update_(p, p.grad, exp_avg, exp_avg_sq, self.steps, self.lr, 0.9, 0.999, 1e-8)


def fsdp2_train(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-2,
    loss_fn: Callable = nn.functional.cross_entropy,
) -> dict[str, torch.Tensor]:
    """Rank function, torch's counterpart of stage 3: FSDP2 (``fully_shard`` on every module
    that owns parameters, then on the root) with ``torch.optim.Adam`` on the sharded DTensor
    parameters; returns the full parameters."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for module in list(model.modules()):
        if module is not model and any(True for _ in module.parameters(False)):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in batches:
        xs, ys = _local_batch(x, y)
        optimizer.zero_grad()
        with warnings.catch_warnings():  # a caution that in-place ops on an output that is a
            # view would skip the pre-backward gather; the models here do none
            warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
            output = model(xs)
        loss_fn(output, ys).backward()  # FSDP2 reduce-scatters the averaged gradient
        optimizer.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
