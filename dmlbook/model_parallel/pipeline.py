"""Pipeline parallelism: split a model's layers into stages on ranks, feed it micro-batches.

Chapter 6 ("Pipeline input and layer split") builds it up, and chapter 7 trains and serves with it:

- *Layer split.* ``layers_of`` lists a model's layers, ``even_partition`` says how many go to each
  stage and ``split_model`` cuts them into ``nn.Sequential`` stages (parameters stay shared with
  the model). Stage ``s`` lives on rank ``s``. Activations travel forward and gradients backward
  with ``torch.distributed`` point-to-point messages. With the first activation of each step
  goes a small header (dtype and shape): the receiver caches it and re-learns the shape only
  when it changed. Gradients need none: they have the shape of the activation that went forward.
- *Schedules are data.* ``vanilla_schedule`` (the whole batch at once: one stage works, the others
  wait), ``gpipe_schedule`` (Huang et al. 2019: all forwards of M micro-batches, then all
  backwards) and ``one_f_one_b_schedule`` (PipeDream-Flush, Narayanan et al. 2021: each stage
  alternates one forward and one backward, so it holds at most P - s micro-batches' activations
  instead of M) each return a list of :class:`Action`. One executor, :class:`PipelineStage`, runs
  any valid list.
- *Timelines.* Every stage records when each of its ops ran (:class:`OpRecord`, seconds since a
  t0 the stages agree on as the step starts). ``measured_bubble`` is the idle fraction of a real
  run, to set beside the theory, ``bubble_theory`` = (P - 1) / (M + P - 1);
  ``dmlbook.viz.gantt`` draws the timelines.

Why it never deadlocks: every send is an ``isend`` whose handle we keep (it completes in the
background) and every receive blocks. A stage therefore only ever waits for data its schedule
needs next, and the schedules' dependencies (forward of micro-batch m on stage s after the one
on s - 1, backward after the one on s + 1) form no cycle. Neighbours must post their messages in
the same micro-batch order, which :func:`check_schedule` verifies before anything is sent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dmlbook.models import CNN, MLP, CharGPT

__all__ = [
    "Action",
    "OpRecord",
    "PipelineStage",
    "SCHEDULES",
    "StepResult",
    "bubble_theory",
    "check_schedule",
    "even_partition",
    "format_schedule",
    "gpipe_schedule",
    "gpt_loss",
    "inference_schedule",
    "layers_of",
    "measured_bubble",
    "one_f_one_b_schedule",
    "packed_timelines",
    "split_model",
    "stage_actions",
    "vanilla_schedule",
]

# ---- Schedules: plain lists of actions -------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One op of one stage: the ``step``-th thing stage ``stage`` does in a training step."""

    stage: int  # pipeline stage (rank in the pipeline group)
    step: int  # position in that stage's own order: 0, 1, 2, ...
    op: str  # "F" (forward) or "B" (backward)
    microbatch: int


def _number(stage: int, ops: Sequence[tuple[str, int]]) -> list[Action]:
    return [Action(stage, step, op, mb) for step, (op, mb) in enumerate(ops)]


def _check_sizes(stages: int, microbatches: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def vanilla_schedule(stages: int, microbatches: int = 1) -> list[Action]:
    """Plain model parallelism: the whole batch goes forward through every stage, then backward.
    Only one stage works at a time; the others idle (the bubble is (P - 1) / P)."""
    _check_sizes(stages, microbatches)
    if microbatches != 1:
        raise ValueError(
            f"vanilla model parallelism runs the whole batch as one micro-batch, got "
            f"microbatches={microbatches}; use 'gpipe' or '1f1b' to pipeline micro-batches"
        )
    return gpipe_schedule(stages, 1)


def gpipe_schedule(stages: int, microbatches: int) -> list[Action]:
    """GPipe: every stage runs the forwards of all M micro-batches, then all their backwards.
    Each stage holds the activations of all M micro-batches at the turn."""
    _check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        forwards = [("F", mb) for mb in range(microbatches)]
        backwards = [("B", mb) for mb in range(microbatches)]
        actions += _number(stage, forwards + backwards)
    return actions


def one_f_one_b_schedule(stages: int, microbatches: int) -> list[Action]:
    """1F1B: stage s warms up with P - s - 1 forwards, then alternates one forward and one
    backward, then cools down with the backwards left. It never holds more than P - s
    micro-batches' activations; the bubble is the same as GPipe's."""
    _check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        ops = [("F", mb) for mb in range(warmup)]  # fill the pipe below this stage
        for i in range(microbatches - warmup):  # steady state: one forward, one backward
            ops += [("F", warmup + i), ("B", i)]
        ops += [("B", mb) for mb in range(microbatches - warmup, microbatches)]  # drain
        actions += _number(stage, ops)
    return actions


def inference_schedule(stages: int, microbatches: int) -> list[Action]:
    """Serving: forwards only, micro-batch after micro-batch, on every stage."""
    _check_sizes(stages, microbatches)
    actions = []
    for stage in range(stages):
        actions += _number(stage, [("F", mb) for mb in range(microbatches)])
    return actions


SCHEDULES: dict[str, Callable[[int, int], list[Action]]] = {
    "vanilla": vanilla_schedule,
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
}


def bubble_theory(stages: int, microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B when every op takes the same time: (P-1)/(M+P-1)."""
    _check_sizes(stages, microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def stage_actions(actions: Sequence[Action], stage: int) -> list[Action]:
    """The actions of one stage, in the order it runs them."""
    return sorted((a for a in actions if a.stage == stage), key=lambda a: a.step)


def check_schedule(
    actions: Sequence[Action], stages: int, microbatches: int, backward: bool = True
) -> None:
    """Raise ValueError unless ``actions`` is a schedule one executor can run without deadlock.

    Every stage runs each micro-batch's forward once (and, with ``backward``, its backward once,
    after its forward); steps are numbered 0, 1, ...; and every stage sends and receives in the
    same micro-batch order as its neighbours, so that messages pair up.
    """
    _check_sizes(stages, microbatches)
    if any(a.stage not in range(stages) for a in actions):
        raise ValueError(f"an action names a stage outside 0..{stages - 1}")
    wanted_ops = ("F", "B") if backward else ("F",)
    orders: dict[str, list[list[int]]] = {op: [] for op in wanted_ops}
    for stage in range(stages):
        mine = stage_actions(actions, stage)
        if [a.step for a in mine] != list(range(len(mine))):
            raise ValueError(f"stage {stage}'s steps must be numbered 0, 1, 2, ...")
        for a in mine:
            if a.op not in wanted_ops or not 0 <= a.microbatch < microbatches:
                raise ValueError(f"{a} is not an op of this schedule")
        for op in wanted_ops:
            order = [a.microbatch for a in mine if a.op == op]
            if sorted(order) != list(range(microbatches)):
                raise ValueError(
                    f"stage {stage} must run {op} once for each of {microbatches} micro-batches, "
                    f"runs it for {order}"
                )
            orders[op].append(order)
        if backward:
            forward_at = {a.microbatch: a.step for a in mine if a.op == "F"}
            for a in mine:
                if a.op == "B" and a.step < forward_at[a.microbatch]:
                    raise ValueError(f"stage {stage} runs B{a.microbatch} before F{a.microbatch}")
    for op, per_stage in orders.items():
        for stage in range(1, stages):
            if per_stage[stage] != per_stage[stage - 1]:
                raise ValueError(
                    f"stages {stage - 1} and {stage} run {op} in different micro-batch orders "
                    f"({per_stage[stage - 1]} vs {per_stage[stage]}): their messages would not pair"
                )


def format_schedule(actions: Sequence[Action]) -> str:
    """One line per stage, e.g. ``stage 0: F0 F1 F2 B0 B1 B2``."""
    stages = sorted({a.stage for a in actions})
    return "\n".join(
        f"stage {s}: " + " ".join(f"{a.op}{a.microbatch}" for a in stage_actions(actions, s))
        for s in stages
    )


# ---- Layer split ------------------------------------------------------------------------------


class _CharGPTEmbedding(nn.Module):
    """CharGPT's first layer, token ids (B, T) -> residual stream (B, T, C), as a module."""

    def __init__(self, gpt: CharGPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop  # shared, not copied
        object.__setattr__(self, "gpt", gpt)  # not a submodule: its other layers live elsewhere

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt.embed(idx)  # (B, T) -> (B, T, C)


class _CharGPTHead(nn.Module):
    """CharGPT's last layer, residual stream (B, T, C) -> logits (B, T, V), as a module."""

    def __init__(self, gpt: CharGPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head
        object.__setattr__(self, "gpt", gpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt.head(x)  # (B, T, C) -> (B, T, V)


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The model as a chain of layers to cut into stages; they share parameters with ``model``.

    CharGPT: [embedding, *blocks, head]. MLP: its Linear(+ReLU) units (the first flattens its
    input, as ``MLP.forward`` does). CNN: the layers of ``.layers``. nn.Sequential: its children.
    """
    if isinstance(model, CharGPT):
        return [_CharGPTEmbedding(model), *model.blocks, _CharGPTHead(model)]
    if isinstance(model, MLP):
        units: list[list[nn.Module]] = []  # each Linear with the ReLU after it
        for layer in model.layers:
            if isinstance(layer, nn.Linear) or not units:
                units.append([])
            units[-1].append(layer)
        units[0].insert(0, nn.Flatten())
        return [nn.Sequential(*unit) for unit in units]
    if isinstance(model, CNN):
        return list(model.layers)
    if isinstance(model, nn.Sequential):
        return list(model)
    raise TypeError(f"no layer list for {type(model).__name__}; pass a list of modules instead")


def even_partition(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, as equal as can be (sizes differ by at most one, longer ones first)."""
    _check_sizes(stages, 1)
    if n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers into {stages} non-empty stages")
    short, longer = divmod(n_layers, stages)
    return [short + 1] * longer + [short] * (stages - longer)


def split_model(layers: Sequence[nn.Module], counts: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``layers`` into consecutive stages of ``counts[s]`` layers each (shared, not copied)."""
    if any(c < 1 for c in counts) or sum(counts) != len(layers):
        raise ValueError(f"counts {list(counts)} must be >= 1 and sum to {len(layers)} layers")
    stages, start = [], 0
    for count in counts:
        stages.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return stages


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CharGPT's loss from the last stage's logits (B, T, V): cross entropy over all B*T tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---- What a step reports ----------------------------------------------------------------------


@dataclass
class OpRecord:
    """When one op computed on one stage, in seconds since the step's common t0: ``start`` is when
    its input was there (after the receive), ``end`` when its result was (before the send)."""

    op: str
    microbatch: int
    start: float
    end: float


@dataclass
class StepResult:
    """What one stage saw in one step."""

    loss: float | None  # batch mean loss, on the last stage; None on other stages
    outputs: torch.Tensor | None  # last stage's outputs over all micro-batches (infer); else None
    timeline: list[OpRecord]  # this stage's ops, in the order run
    peak_live_activations: int  # most micro-batches whose forward state this stage held at once
    peak_saved_bytes: int | None = None  # bytes autograd saved, at their peak (measure_memory)
    sent_bytes: int = 0  # activation and gradient bytes this stage sent (headers excluded)
    wait_s: float = 0.0  # seconds spent blocked in receives (idle, waiting for a neighbour)


def measured_bubble(timelines: Sequence[Sequence[OpRecord]]) -> float:
    """Idle fraction of a real run: 1 - (busy time summed over stages) / (stages x makespan)."""
    records = [r for timeline in timelines for r in timeline]
    if not records:
        raise ValueError("no op records: nothing ran")
    makespan = max(r.end for r in records) - min(r.start for r in records)
    busy = sum(r.end - r.start for r in records)
    return 1.0 - busy / (len(timelines) * makespan)


def packed_timelines(timelines: Sequence[Sequence[OpRecord]]) -> list[list[OpRecord]]:
    """The same ops with the same durations, each started as soon as its stage is free and its
    input exists: the step as it would run with instant messages and no other delay.

    A forward on stage s needs that micro-batch's forward on stage s - 1, a backward on stage s
    its backward on stage s + 1. Comparing ``measured_bubble`` of a run and of its packed
    timelines splits the gap to the theory in two: op times that differ (packed vs theory) and
    waiting on messages and the operating system (measured vs packed).
    """
    stages = len(timelines)
    done: dict[tuple[int, str, int], float] = {}  # (stage, op, micro-batch) -> packed end
    packed: list[list[OpRecord]] = [[] for _ in range(stages)]
    while any(len(packed[s]) < len(timelines[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while len(packed[s]) < len(timelines[s]):
                r = timelines[s][len(packed[s])]
                source = s - 1 if r.op == "F" else s + 1  # where this op's input comes from
                needs = (source, r.op, r.microbatch) if 0 <= source < stages else None
                if needs is not None and needs not in done:
                    break  # its input is not computed yet: try the other stages first
                free = packed[s][-1].end if packed[s] else 0.0
                start = max(free, done.get(needs, 0.0))
                packed[s].append(OpRecord(r.op, r.microbatch, start, start + r.end - r.start))
                done[s, r.op, r.microbatch] = start + r.end - r.start
                progressed = True
        if not progressed:
            raise ValueError("the timelines wait on each other in a cycle: not a valid schedule")
    return packed


# ---- The executor -----------------------------------------------------------------------------

# The header that tells the next stage what an activation looks like: dtype code, ndim, dims.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_MAX_DIMS = 8


def _split(batch: torch.Tensor, microbatches: int, what: str) -> tuple[torch.Tensor, ...]:
    if batch.dim() == 0 or batch.shape[0] % microbatches:
        raise ValueError(
            f"{what} has batch size {batch.shape[0] if batch.dim() else 'none'}, which "
            f"{microbatches} micro-batches do not divide evenly"
        )
    return batch.split(batch.shape[0] // microbatches)  # views: no copy


class PipelineStage:
    """Stage ``stage`` of a ``stages``-stage pipeline, on rank ``stage`` of ``group`` (chapter 6).

    ``train_step`` runs one schedule over the batch's micro-batches and accumulates gradients
    into ``module``'s ``.grad`` exactly as one backward of the whole batch's mean loss would; the
    caller zeroes them and steps its own optimizer, as in single-process training. A one-stage
    pipeline needs no process group.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        stages: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        _check_sizes(stages, 1)
        if dist.is_initialized():
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if size != stages:
                raise ValueError(
                    f"a {stages}-stage pipeline needs {stages} ranks in its group, one per stage; "
                    f"the group has {size}"
                )
            if rank != stage:
                raise ValueError(f"stage {stage} must run on rank {stage} of its group, not {rank}")
        elif stages != 1:
            raise RuntimeError(
                f"a {stages}-stage pipeline needs an initialised process group (use launch.run)"
            )
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
        if device is None:
            from dmlbook.launch import device as rank_device

            device = rank_device()
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.stage, self.stages, self.group = stage, stages, group
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.recv_meta: tuple[torch.dtype, torch.Size] | None = None  # cached from the header
        self.handshakes = 0  # how often the receive side had to (re)learn the shape
        self.pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.sent_bytes, self.wait_s = 0, 0.0

    # -- public steps

    def train_step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        microbatches: int = 1,
        schedule: str | Sequence[Action] = "gpipe",
        measure_memory: bool = False,
    ) -> StepResult:
        """Forward and backward of one batch as ``microbatches`` micro-batches, by ``schedule``.

        The first stage passes ``inputs`` (the whole batch), the last ``targets`` and
        ``loss_fn(outputs, targets) -> mean loss``. With ``measure_memory`` the stage also counts
        the bytes autograd saves for backward (``recompute.SavedTensorMeter``), leaving out the
        parameters and the batch itself.
        """
        actions = self._actions(schedule, microbatches, backward=True)
        data = []  # the batch itself: held by the caller, not activation memory
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs the batch's inputs")
            data.append(inputs := inputs.to(self.device))
            inputs = _split(inputs, microbatches, "inputs")
        if self.is_last:
            if targets is None or loss_fn is None:
                raise ValueError("the last stage needs targets and loss_fn")
            data.append(targets := targets.to(self.device))
            targets = _split(targets, microbatches, "targets")
        meter = contextlib.nullcontext()
        if measure_memory:
            from dmlbook.model_parallel.recompute import SavedTensorMeter

            meter = SavedTensorMeter([*self.module.parameters(), *self.module.buffers(), *data])
        with meter:
            result = self._run(actions, microbatches, inputs, targets, loss_fn)
        if measure_memory:
            result.peak_saved_bytes = meter.peak
        return result

    @torch.no_grad()
    def infer(self, inputs: torch.Tensor | None = None, microbatches: int = 1) -> StepResult:
        """Forward only (serving): the last stage returns the outputs of the whole batch."""
        schedule = inference_schedule(self.stages, microbatches)
        actions = self._actions(schedule, microbatches, backward=False)
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs the batch's inputs")
            inputs = _split(inputs.to(self.device), microbatches, "inputs")
        return self._run(actions, microbatches, inputs, None, None)

    # -- the loop learners step through

    def _run(self, actions, microbatches, inputs, targets, loss_fn) -> StepResult:
        """Run this stage's actions in order; F and B each receive, compute, then send."""
        self.pending_sends, self.sent_bytes, self.wait_s = [], 0, 0.0
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # mb -> (input, output)
        outputs: list[torch.Tensor] = []
        loss_sum, peak_live, timeline = 0.0, 0, []
        first_forward = True
        t0 = self._common_t0()
        for action in actions:
            mb = action.microbatch
            if action.op == "F":
                # receive: the previous stage's activation (the first stage has the inputs)
                x = inputs[mb] if self.is_first else self._recv_activation(first_forward)
                start = self._now(t0)
                y = self.module(x)  # compute
                if self.is_last and loss_fn is not None:
                    # Scale by 1/M so that the micro-batches' gradients add up to the batch mean's.
                    y = loss_fn(y, targets[mb]) / microbatches
                    loss_sum += y.item()
                elif self.is_last:
                    outputs.append(y)
                end = self._now(t0)
                if not self.is_last:
                    self._send(y.detach(), self.stage + 1, header=first_forward)  # communication
                if torch.is_grad_enabled():
                    held[mb] = (x, y)  # kept for backward: y's graph holds the activations
                    peak_live = max(peak_live, len(held))
                first_forward = False
            else:  # "B"
                x, y = held.pop(mb)  # this micro-batch's activations die after its backward
                if self.is_last:
                    start = self._now(t0)
                    y.backward()  # compute: the scaled micro-batch loss
                else:
                    grad_y = self._recv(torch.empty_like(y), self.stage + 1)  # from the next
                    start = self._now(t0)
                    torch.autograd.backward(y, grad_y)  # compute
                end = self._now(t0)
                if not self.is_first:
                    self._send(x.grad, self.stage - 1)  # communication: dL/dx to the previous
                del x, y
            timeline.append(OpRecord(action.op, mb, start, end))
            self._reap_sends()
        for work, _ in self.pending_sends:  # every send has left before its buffer may go
            work.wait()
        self.pending_sends = []
        training = any(a.op == "B" for a in actions)
        return StepResult(
            loss=loss_sum if self.is_last and training else None,
            outputs=torch.cat(outputs) if outputs else None,
            timeline=timeline,
            peak_live_activations=peak_live,
            sent_bytes=self.sent_bytes,
            wait_s=self.wait_s,
        )

    # -- helpers: schedule, clock, point-to-point

    def _actions(self, schedule, microbatches: int, backward: bool) -> list[Action]:
        if isinstance(schedule, str):
            if schedule not in SCHEDULES:
                raise ValueError(f"unknown schedule {schedule!r}; use one of {list(SCHEDULES)}")
            schedule = SCHEDULES[schedule](self.stages, microbatches)
        check_schedule(schedule, self.stages, microbatches, backward=backward)
        return stage_actions(schedule, self.stage)

    def _common_t0(self) -> float:
        """The step's t0: the wall-clock time at which the last stage arrived here.

        The all-reduce is also a barrier, so every stage starts the step together. Stamps use
        the wall clock, which all processes on one host share (across hosts: as good as NTP).
        """
        arrived = time.time()
        if self.stages > 1:
            latest = torch.tensor([arrived], dtype=torch.float64, device=self.device)
            dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=self.group)
            arrived = latest.item()
        return arrived

    def _now(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # for the timeline only: kernels are async
        return time.time() - t0

    def _peer(self, stage: int) -> int:
        """Global rank of a stage (point-to-point calls take global ranks)."""
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def _send(self, tensor: torch.Tensor, stage: int, header: bool = False) -> None:
        """Post a non-blocking send; with ``header``, first say what dtype and shape it has."""
        if header:
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
                raise ValueError(f"cannot send a {tensor.dtype} activation of {tensor.dim()} dims")
            code = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
            code += [0] * (_MAX_DIMS + 2 - len(code))
            self._post(torch.tensor(code, dtype=torch.int64, device=self.device), stage)
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self._post(tensor.contiguous(), stage)

    def _post(self, tensor: torch.Tensor, stage: int) -> None:
        work = dist.isend(tensor, dst=self._peer(stage), group=self.group)
        self.pending_sends.append((work, tensor))  # the tensor must live until the send is done

    def _reap_sends(self) -> None:
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]

    def _recv(self, buffer: torch.Tensor, stage: int) -> torch.Tensor:
        start = time.perf_counter()
        dist.recv(buffer, src=self._peer(stage), group=self.group)  # blocks: idle time
        self.wait_s += time.perf_counter() - start
        return buffer

    def _recv_activation(self, first_of_step: bool) -> torch.Tensor:
        """The previous stage's output for the next micro-batch, as a leaf that needs a grad.

        The first activation of a step follows a header; the receiver caches the shape and only
        re-learns it when the sender's shape changed (a new batch size or sequence length).
        """
        if first_of_step:
            header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
            code = self._recv(header, self.stage - 1).tolist()
            meta = (_DTYPES[code[0]], torch.Size(code[2 : 2 + code[1]]))
            if meta != self.recv_meta:
                self.recv_meta = meta
                self.handshakes += 1
        dtype, shape = self.recv_meta
        # A fresh buffer per micro-batch: autograd keeps it until that micro-batch's backward.
        x = self._recv(torch.empty(shape, dtype=dtype, device=self.device), self.stage - 1)
        return x.requires_grad_(dtype.is_floating_point and torch.is_grad_enabled())
