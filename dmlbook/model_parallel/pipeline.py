"""Pipeline parallelism: split a model's layers into stages on ranks, feed it micro-batches.

Chapter 6 ("Pipeline input and layer split") builds it up, and chapter 7 trains and serves with it.
It comes in three modules, one idea each; this one also gives the other two's names, so that
``from dmlbook.model_parallel import pipeline as pp`` is all a notebook imports:

- *Layer split* (:mod:`dmlbook.model_parallel.layer_split`). ``layers_of`` lists a model's layers,
  ``even_partition`` says how many go to each stage and ``split_model`` cuts them into
  ``nn.Sequential`` stages (parameters stay shared with the model). Stage ``s`` lives on rank ``s``.
- *Schedules are data* (:mod:`dmlbook.model_parallel.schedules`). ``vanilla_schedule``,
  ``gpipe_schedule`` and ``one_f_one_b_schedule`` each return a list of :class:`Action`;
  ``check_schedule`` says whether an executor can run one. The timelines a run records
  (:class:`OpRecord`) give ``measured_bubble``, to set beside ``bubble_theory``.
- *The executor* (this module). One :class:`PipelineStage` per rank runs any valid list:
  :meth:`PipelineStage.run_schedule` walks the stage's actions, :meth:`PipelineStage.forward`
  receives an activation, computes and sends, :meth:`PipelineStage.backward` receives the
  gradient of the output, backpropagates and sends the gradient of the input back.
  Beyond the book, the same executor runs interleaved 1F1B (a stage built from a list of v
  model chunks, chunk c being virtual stage c*P + stage) and ZB-H1, where ``backward`` computes
  only the input gradient and :meth:`PipelineStage.backward_weight` the weight gradient later
  (:mod:`dmlbook.model_parallel.backward_split`).
  Activations travel forward and gradients backward with ``torch.distributed`` point-to-point
  messages. With the first activation of each step goes a small header (dtype and shape): the
  receiver caches it and re-learns the shape only when it changed. Gradients need none: they have
  the shape of the activation that went forward. :class:`StepResult` is what a stage saw in a step.

Why it never deadlocks: every send is an ``isend`` whose handle we keep (it completes in the
background) and every receive blocks. A stage therefore only ever waits for data its schedule
needs next, and the schedules' dependencies (forward of micro-batch m on stage s after the one
on s - 1, backward after the one on s + 1) form no cycle. Neighbours must post their messages in
the same micro-batch order, which :func:`check_schedule` verifies before anything is sent
(activations and gradients travel with different tags, so each kind pairs in its own order).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.model_parallel import backward_split
from dmlbook.model_parallel.layer_split import (
    even_partition,
    layers_of,
    split_model,
)
from dmlbook.model_parallel.schedules import (
    SCHEDULES,
    Action,
    OpRecord,
    bubble_theory,
    check_schedule,
    check_sizes,
    format_schedule,
    gpipe_schedule,
    inference_schedule,
    interleaved_schedule,
    measured_bubble,
    one_f_one_b_schedule,
    packed_timelines,
    stage_actions,
    vanilla_schedule,
    virtual_stage,
    zb_h1_schedule,
)

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
    "inference_schedule",
    "interleaved_schedule",
    "layers_of",
    "measured_bubble",
    "one_f_one_b_schedule",
    "packed_timelines",
    "split_model",
    "stage_actions",
    "vanilla_schedule",
    "virtual_stage",
    "zb_h1_schedule",
]


# ---- What a step reports ----------------------------------------------------------------------


@dataclass
class StepResult:
    """What one stage saw in one step."""

    loss: float | None  # batch mean loss, on the last stage; None on other stages
    outputs: torch.Tensor | None  # last stage's outputs over all micro-batches (infer); else None
    timeline: list[OpRecord]  # this stage's ops, in the order run
    # most micro-batches whose forward state this stage held at once (from F to B, or to W where
    # backward is split; with model chunks, (micro-batch, chunk) pairs, each 1/v of the stage)
    peak_live_activations: int
    peak_saved_bytes: int | None = None  # bytes autograd saved, at their peak (measure_memory)
    sent_bytes: int = 0  # activation and gradient bytes this stage sent (headers excluded)
    wait_s: float = 0.0  # seconds spent blocked in receives (idle, waiting for a neighbour)


# ---- The executor -----------------------------------------------------------------------------

# The header that tells the next stage what an activation looks like: dtype code, ndim, dims.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_MAX_DIMS = 8
_TAGS = {"activation": 0, "gradient": 1}  # each kind pairs in its own order (see check_schedule)


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
    pipeline needs no process group. ``module`` may be a list of v model chunks (interleaved
    schedules): chunk c is virtual stage c * stages + stage of the model's stages * v, and
    ``self.module`` then holds them all (an ``nn.ModuleList``).
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        stage: int,
        stages: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_sizes(stages, 1)
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
            from dmlbook.comm.groups import device as rank_device

            device = rank_device()
        self.device = torch.device(device)
        if isinstance(module, nn.Module):
            self.chunks = [module.to(self.device)]
            self.module = self.chunks[0]
        else:
            self.chunks = [m.to(self.device) for m in module]
            if not self.chunks:
                raise ValueError(f"stage {stage} got an empty list of model chunks")
            self.module = nn.ModuleList(self.chunks)
        self.stage, self.stages, self.group = stage, stages, group
        self.is_first, self.is_last = stage == 0, stage == stages - 1  # feeds inputs / the loss
        self.last_virtual = stages * len(self.chunks) - 1
        # per receiving chunk: (dtype, shape) of its activations, cached from the header
        self.recv_meta: dict[int, tuple[torch.dtype, torch.Size]] = {}
        self.handshakes = 0  # how often the receive side had to (re)learn the shape
        self.split_backward = False  # this step's schedule has W ops: B is the input gradient
        self.mailbox: dict[int, list[torch.Tensor]] = {0: [], 1: []}  # one stage, many chunks
        self.pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.sent_bytes, self.wait_s = 0, 0.0
        self.t0, self.held, self.outputs, self.timeline = 0.0, {}, [], []
        self.inputs = self.targets = self.loss_fn = None
        self.microbatches, self.loss_sum, self.peak_live = 1, 0.0, 0
        self._headers_due: set[int] = set()  # chunks whose first activation is still to go
        self._headers_expected: set[int] = set()  # chunks whose first activation is still to come

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
            self._begin_step(microbatches, inputs, targets, loss_fn)
            self.run_schedule(actions)
            result = self._end_step(training=True)
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
        self._begin_step(microbatches, inputs, None, None)
        self.run_schedule(actions)
        return self._end_step(training=False)

    # -- the mechanism: one stage's loop, and its two ops

    def run_schedule(self, actions: Sequence[Action]) -> None:
        """Run this stage's actions in order: each F or B receives, computes, then sends; W
        (where backward is split) computes the weight gradients that B left."""
        ops = {"F": self.forward, "B": self.backward, "W": self.backward_weight}
        for action in actions:
            op = ops[action.op]
            # one chunk: op(mb), as chapter 6 reads it (and as wrappers that time ops call it)
            op(action.microbatch) if len(self.chunks) == 1 else op(action.microbatch, action.chunk)
        for work, _ in self.pending_sends:  # every send has left before its buffer may go
            work.wait()
        self.pending_sends = []

    def forward(self, mb: int, chunk: int = 0) -> None:
        """F of micro-batch ``mb``: receive the previous stage's activation, compute, send on."""
        here = virtual_stage(self.stage, chunk, self.stages)
        first, last = here == 0, here == self.last_virtual
        x = self.inputs[mb] if first else self._recv_activation(chunk)  # receive
        start = self._now()
        record = self.split_backward and torch.is_grad_enabled()
        with backward_split.weight_outputs(self.chunks[chunk]) if record else _nothing() as owned:
            y = self.chunks[chunk](x)  # compute
        if last and self.loss_fn is not None:
            # Scale by 1/M so that the micro-batches' gradients add up to the batch mean's.
            y = self.loss_fn(y, self.targets[mb]) / self.microbatches
            self.loss_sum += y.item()
        elif last:
            self.outputs.append(y)
        self.timeline.append(OpRecord("F", mb, start, self._now(), chunk))
        if not last:
            self._send(y.detach(), here + 1, "activation")  # send: a non-blocking isend
        if torch.is_grad_enabled():
            # kept for backward: y's graph holds the activations
            self.held[chunk, mb] = (x, y, owned)
            self.peak_live = max(self.peak_live, len(self.held))

    def backward(self, mb: int, chunk: int = 0) -> None:
        """B of micro-batch ``mb``: receive the gradient of this stage's output, backpropagate,
        send the gradient of its input to the previous stage. Where the schedule has W ops, B
        computes the input gradient only and leaves the weights' to :meth:`backward_weight`."""
        here = virtual_stage(self.stage, chunk, self.stages)
        x, y, owned = self.held[chunk, mb]
        # receive dL/dy from the next stage; the last stage's y is its scaled loss: no gradient
        last = here == self.last_virtual
        grad_y = None if last else self._recv(torch.empty_like(y), here + 1, "gradient")
        start = self._now()
        if self.split_backward:  # compute dL/dx only; keep what W needs
            grad_x, pending = backward_split.input_gradient(y, grad_y, x, owned)
            self.held[chunk, mb] = pending  # the graph lives on until W
        else:
            del self.held[chunk, mb]  # this micro-batch's activations die after its backward
            torch.autograd.backward(y, grad_y)  # compute: adds into the parameters' .grad
            grad_x = x.grad
        self.timeline.append(OpRecord("B", mb, start, self._now(), chunk))
        if here > 0:
            self._send(grad_x, here - 1, "gradient")  # send dL/dx back

    def backward_weight(self, mb: int, chunk: int = 0) -> None:
        """W of micro-batch ``mb`` (zero-bubble schedules): the weight gradients its B left,
        added into the parameters' ``.grad``. No message: nobody waits for it."""
        pending = self.held.pop((chunk, mb))  # the micro-batch's graph dies after its W
        start = self._now()
        backward_split.weight_gradient(pending)
        self.timeline.append(OpRecord("W", mb, start, self._now(), chunk))

    # -- helpers: the step's state, schedule, clock, point-to-point

    def _begin_step(self, microbatches, inputs, targets, loss_fn) -> None:
        self.microbatches, self.loss_fn = microbatches, loss_fn
        self.inputs, self.targets = inputs, targets  # micro-batches: first and last stage only
        self.pending_sends, self.sent_bytes, self.wait_s = [], 0, 0.0
        self.held = {}  # (chunk, micro-batch) -> (input, output, owners), until its backward
        self.outputs = []
        self.loss_sum, self.peak_live, self.timeline = 0.0, 0, []
        chunks = set(range(len(self.chunks)))  # each chunk's first activation has a header
        self._headers_due, self._headers_expected = set(chunks), set(chunks)
        self.mailbox = {0: [], 1: []}
        self.t0 = self._common_t0()

    def _end_step(self, training: bool) -> StepResult:
        result = StepResult(
            loss=self.loss_sum if self.is_last and training else None,
            outputs=torch.cat(self.outputs) if self.outputs else None,
            timeline=self.timeline,
            peak_live_activations=self.peak_live,
            sent_bytes=self.sent_bytes,
            wait_s=self.wait_s,
        )
        self.inputs = self.targets = self.loss_fn = None
        self.held, self.outputs = {}, []
        return result

    def _actions(self, schedule, microbatches: int, backward: bool) -> list[Action]:
        chunks = len(self.chunks)
        if isinstance(schedule, str):
            if schedule not in SCHEDULES:
                raise ValueError(f"unknown schedule {schedule!r}; use one of {list(SCHEDULES)}")
            if schedule == "interleaved":
                schedule = interleaved_schedule(self.stages, microbatches, chunks)
            elif chunks != 1:
                raise ValueError(
                    f"stage {self.stage} holds {chunks} model chunks, which the {schedule!r} "
                    f"schedule does not interleave; use 'interleaved'"
                )
            else:
                schedule = SCHEDULES[schedule](self.stages, microbatches)
        check_schedule(schedule, self.stages, microbatches, backward=backward, chunks=chunks)
        self.split_backward = backward and any(a.op == "W" for a in schedule)
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

    def _now(self) -> float:
        """Seconds since the step's common t0 (for the timeline only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels are async
        return time.time() - self.t0

    def _peer(self, stage: int) -> int:
        """Global rank of a stage (point-to-point calls take global ranks)."""
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def _send(self, tensor: torch.Tensor, to: int, kind: str) -> None:
        """Post a non-blocking send to virtual stage ``to``; each chunk's first activation of the
        step goes after a header that says what dtype and shape it has."""
        chunk = (to - 1) // self.stages  # the chunk that computed an activation going to `to`
        if kind == "activation" and chunk in self._headers_due:
            self._headers_due.discard(chunk)
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
                raise ValueError(f"cannot send a {tensor.dtype} activation of {tensor.dim()} dims")
            code = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
            code += [0] * (_MAX_DIMS + 2 - len(code))
            self._post(torch.tensor(code, dtype=torch.int64, device=self.device), to, kind)
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self._post(tensor.contiguous(), to, kind)
        self._reap_sends()

    def _post(self, tensor: torch.Tensor, to: int, kind: str) -> None:
        if self.stages == 1:  # chunks of one stage: the message stays here
            self.mailbox[_TAGS[kind]].append(tensor.clone())
            return
        work = dist.isend(tensor, self._peer(to % self.stages), self.group, _TAGS[kind])
        self.pending_sends.append((work, tensor))  # the tensor must live until the send is done

    def _reap_sends(self) -> None:
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]

    def _recv(self, buffer: torch.Tensor, source: int, kind: str) -> torch.Tensor:
        """Receive into ``buffer`` the next ``kind`` message from virtual stage ``source``."""
        if self.stages == 1:
            return buffer.copy_(self.mailbox[_TAGS[kind]].pop(0))
        start = time.perf_counter()
        dist.recv(buffer, self._peer(source % self.stages), self.group, _TAGS[kind])  # blocks
        self.wait_s += time.perf_counter() - start  # idle time
        return buffer

    def _recv_activation(self, chunk: int = 0) -> torch.Tensor:
        """The previous stage's output for the next micro-batch, as a leaf that needs a grad.

        The first activation of a step (per chunk) follows a header; the receiver caches the
        shape and only re-learns it when the sender's shape changed (a new batch size or
        sequence length).
        """
        source = virtual_stage(self.stage, chunk, self.stages) - 1
        if chunk in self._headers_expected:
            self._headers_expected.discard(chunk)
            header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
            code = self._recv(header, source, "activation").tolist()
            meta = (_DTYPES[code[0]], torch.Size(code[2 : 2 + code[1]]))
            if meta != self.recv_meta.get(chunk):
                self.recv_meta[chunk] = meta
                self.handshakes += 1
        dtype, shape = self.recv_meta[chunk]
        # A fresh buffer per micro-batch: autograd keeps it until that micro-batch's backward.
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        x = self._recv(buffer, source, "activation")
        return x.requires_grad_(dtype.is_floating_point and torch.is_grad_enabled())


@contextlib.contextmanager
def _nothing():
    yield []
