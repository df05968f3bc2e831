"""Model-parallel workflows: train and fine-tune a model cut into pipeline stages.

Chapter 7 ("Model-parallel training and serving workflows") puts chapter 6's pipeline
(:mod:`dmlbook.model_parallel.pipeline`) to work. Everything here is a *rank function* for
``dmlbook.launch.run(fn, P, ...)``: rank s builds the whole model from the same seed, keeps stage
s (``counts[s]`` consecutive layers) and runs its part of every step.

- :func:`train_pipelined` is the one training loop for every pipeline: any number of stages
  (P = 1 is plain single-process training, with or without a process group), any split
  (``counts`` from ``even_partition`` or a balancer,
  :mod:`dmlbook.model_parallel.stage_balancing`), any number of micro-batches. ``microbatches=1``
  turns pipelining off, ``> 1`` turns it on; nothing else changes. :class:`PipelinedTrainer` is
  that loop one step at a time, so that several splits can take turns on the same ranks and be
  timed under the same conditions. :func:`train_unsplit` is what they must all agree with: the
  whole model, unsplit, trained in one process by the one reference trainer
  (:func:`dmlbook.data_parallel.loop.train_reference`), as a one-stage :class:`TrainResult`.
- Fine-tuning is training from other weights: :func:`with_weights` wraps a model factory so every
  rank starts from a pre-trained state dict; :func:`finetune_text` is a second text that ships
  with Python (stdlib docstrings) to fine-tune on, and :func:`lm_batches` and :func:`lm_loss`
  make batches and held-out losses of a character language model.
- Serving is in :mod:`dmlbook.model_parallel.pipeline_serving` (:func:`serve_pipelined`,
  :func:`serve_reference`), and the CPU-wait probes that tell whether a timing says anything
  on a shared machine in :mod:`dmlbook.cpu_wait`: :func:`cpu_wait_fraction` is the share of a
  pipelined run's step time its ranks lost waiting for a CPU. This module gives their names too,
  so that a notebook imports one module for the chapter.
- :func:`unbalanced_mlp` is a model whose layers differ a lot in cost, for balancing.
- Timing on a shared machine: every op's CPU time is recorded beside its wall-clock record
  (``op_cpu``); :func:`busy_cpu_s` is a stage's work per step on that clock, and
  :func:`ideal_steps` replays each step's ops on it with instant messages
  (``pp.packed_timelines``): the step the stages' own work alone would take.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dmlbook.comm.groups import barrier, group_rank_size
from dmlbook.cpu_wait import cpu_wait_in_burst, cpu_wait_s  # noqa: F401  tests read pw.cpu_wait_in_burst
from dmlbook.data_parallel.loop import Callback, LoopState, train_reference
from dmlbook.datasets import char_blocks
from dmlbook.model_parallel import pipeline as pp
from dmlbook.model_parallel.layer_split import stage_for_rank
from dmlbook.model_parallel.pipeline_serving import (
    ServeResult,
    clock_ops_on_cpu,
    on_cpu_clock,
    serve_pipelined,
    serve_reference,
    serve_window,
)
from dmlbook.models import Batch, next_token_loss

__all__ = [
    "PipelinedTrainer",
    "ServeResult",
    "TrainResult",
    "cpu_wait_fraction",
    "finetune_text",
    "lm_batches",
    "lm_loss",
    "merge_states",
    "on_cpu_clock",
    "busy_cpu_s",
    "ideal_steps",
    "span_s",
    "serve_pipelined",
    "serve_reference",
    "serve_window",
    "step_times",
    "train_pipelined",
    "train_unsplit",
    "unbalanced_mlp",
    "with_weights",
]


@dataclass
class TrainResult:
    """What one stage (or the single process) saw over a training run."""

    stage: int
    counts: list[int]  # layers per stage of the split that was trained
    losses: list[float] | None  # batch mean loss per step: last stage only (None elsewhere)
    step_times: list[float]  # seconds per step on this rank, optimizer step included
    state: dict[str, torch.Tensor]  # this stage's parameters after training, full-model names
    timelines: list[list[pp.OpRecord]] = field(default_factory=list)  # each step's ops
    sent_bytes: int = 0  # activation and gradient bytes this stage sent in the last step
    cpu_waits: list[float] = field(default_factory=list)  # per step: seconds spent without a CPU
    op_cpu: list[list[float]] = field(default_factory=list)  # per step: each op's CPU seconds

    @property
    def timeline(self) -> list[pp.OpRecord]:
        """The last step's ops."""
        return self.timelines[-1] if self.timelines else []


# ---- Helpers ----------------------------------------------------------------------------------


def _named_state(model: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers, named as in ``model``'s state dict, copied to CPU."""
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    tensors = [*module.parameters(), *module.buffers()]
    return {names[id(t)]: t.detach().to("cpu", copy=True) for t in tensors}


def merge_states(results: Sequence[TrainResult]) -> dict[str, torch.Tensor]:
    """The whole model's state dict from every stage's part (``run``'s list of results)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result.state)
    return merged


def step_times(results: Sequence[TrainResult]) -> list[float]:
    """A pipeline step lasts until its slowest stage is done: the max over ranks, step by step."""
    return [max(times) for times in zip(*(r.step_times for r in results), strict=True)]


def busy_cpu_s(result: TrainResult, skip: int = 1) -> float:
    """How long one stage works per step: the median over steps (the first ``skip`` warm-up
    steps left out) of its ops' summed CPU time. A thread's CPU clock stops while it sleeps in a
    receive or waits for a core, so other work on the machine does not inflate it."""
    return statistics.median(sum(cpu) for cpu in result.op_cpu[skip:])


def ideal_steps(results: Sequence, skip: int = 1) -> list[list[list[pp.OpRecord]]]:
    """Per step (or serving window) of a run, the first ``skip`` left out: every stage's ops,
    each lasting its CPU time (``op_cpu``), replayed with instant messages
    (:func:`pp.packed_timelines`). The step the stages' own work alone would take, however busy
    the machine was; ``results`` is ``run``'s list of :class:`TrainResult` or ``ServeResult``."""
    return [
        pp.packed_timelines(
            on_cpu_clock([r.timelines[k] for r in results], [r.op_cpu[k] for r in results])
        )
        for k in range(skip, len(results[0].timelines))
    ]


def span_s(timelines: Sequence[Sequence[pp.OpRecord]]) -> float:
    """Seconds from the first op's start to the last op's end, over all stages."""
    ops = [r for timeline in timelines for r in timeline]
    return max(r.end for r in ops) - min(r.start for r in ops)


def cpu_wait_fraction(results: Sequence[TrainResult], skip: int = 1) -> float:
    """Seconds a pipelined run's ranks spent ready to run without a CPU (summed over a rank's
    threads; each step, the rank that waited most) per second of step time, leaving out the
    first ``skip`` warm-up steps. Near 0 on a machine with a free core per stage; above about
    0.1 the timings say more about the other work on the machine than about the pipeline."""
    waits = [max(w) for w in zip(*(r.cpu_waits for r in results), strict=True)][skip:]
    return sum(waits) / sum(step_times(results)[skip:])


# ---- A model that an even split serves badly -------------------------------------------------


def unbalanced_mlp(
    widths: Sequence[int] = (4096, 4096, 4096, 4096, 64, 64, 64, 64),
    dim: int = 64,
    classes: int = 10,
    seed: int = 0,
) -> nn.Sequential:
    """A classifier of (N, dim) inputs whose layers differ a lot in cost: layer i is the block
    Linear(dim, widths[i]) -> ReLU -> Linear(widths[i], dim) -> ReLU, then a Linear head. Every
    layer hands the next an (N, dim) tensor, so a cut anywhere sends the same bytes and only the
    compute differs between splits (the balancing demo of chapter 7)."""

    def build() -> nn.Sequential:
        blocks = [
            nn.Sequential(nn.Linear(dim, w), nn.ReLU(), nn.Linear(w, dim), nn.ReLU())
            for w in widths
        ]
        return nn.Sequential(*blocks, nn.Linear(dim, classes))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


# ---- Training ---------------------------------------------------------------------------------


def _batch_for(batches: Sequence[Batch], step: int) -> Batch:
    return batches[step % len(batches)]


def _check_training(batches: Sequence[Batch], steps: int | None) -> int:
    if not batches:
        raise ValueError("batches is empty: nothing to train on")
    steps = len(batches) if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return steps


class PipelinedTrainer:
    """Stage ``rank`` of ``model_fn()`` cut into ``counts`` layers per stage (None: even), trained
    one :meth:`step` at a time. Several trainers can live side by side on the same ranks and take
    turns, so that two splits are timed under the same conditions (chapter 7's balancing)."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        counts: Sequence[int] | None,
        microbatches: int = 1,
        schedule: str = "gpipe",
        lr: float = 1e-3,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank, self.size = group_rank_size(group)
        self.model = model_fn()
        self.module, self.counts = stage_for_rank(self.model, counts, self.rank, self.size)
        self.stage = pp.PipelineStage(self.module, self.rank, self.size, group=group)
        self.optimizer = optimizer(self.module.parameters(), lr=lr)
        self.microbatches, self.schedule = microbatches, schedule
        self.loss_fn, self.group = loss_fn, group
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.timelines: list[list[pp.OpRecord]] = []
        self.cpu_waits: list[float] = []
        self.op_cpu: list[list[float]] = []
        self._cpu = clock_ops_on_cpu(self.stage)  # each op's CPU time, beside its wall time
        self.sent_bytes = 0

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> pp.StepResult:
        """One training step on one batch (every rank passes the same batch; the first stage
        uses the inputs, the last the targets), then this stage's own optimizer step."""
        barrier(self.group)  # every stage starts the step together: honest times
        start, waited = time.perf_counter(), cpu_wait_s()
        self.optimizer.zero_grad()
        stage = self.stage
        result = stage.train_step(
            inputs if stage.is_first else None,
            targets if stage.is_last else None,
            self.loss_fn if stage.is_last else None,
            self.microbatches,
            self.schedule,
        )
        self.optimizer.step()  # each stage updates only what it holds: no communication
        self.step_times.append(time.perf_counter() - start)
        self.cpu_waits.append(cpu_wait_s() - waited)
        self.losses.append(result.loss)
        self.timelines.append(result.timeline)
        self.op_cpu.append(list(self._cpu))
        self._cpu.clear()
        self.sent_bytes = result.sent_bytes
        return result

    def result(self) -> TrainResult:
        """What this stage saw so far, with a copy of its parameters."""
        return TrainResult(
            stage=self.rank,
            counts=self.counts,
            losses=list(self.losses) if self.stage.is_last else None,
            step_times=list(self.step_times),
            state=_named_state(self.model, self.module),
            timelines=list(self.timelines),
            sent_bytes=self.sent_bytes,
            cpu_waits=list(self.cpu_waits),
            op_cpu=list(self.op_cpu),
        )


def train_pipelined(
    model_fn: Callable[[], nn.Module],
    counts: Sequence[int] | None,
    batches: Sequence[Batch],
    microbatches: int = 1,
    schedule: str = "gpipe",
    lr: float = 1e-3,
    steps: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
    group: dist.ProcessGroup | None = None,
) -> TrainResult:
    """Train stage ``rank`` of ``model_fn()`` cut into ``counts`` layers per stage (None: even).

    Every step takes the next of ``batches`` (cycling; ``steps`` defaults to one pass), splits
    it into ``microbatches``, runs the schedule, then steps this stage's own optimizer
    (``optimizer(params, lr=lr)``) on its own parameters: the update needs no communication,
    because no parameter lives on two stages. ``microbatches=1`` is vanilla model parallelism;
    P = 1 is single-process training.
    """
    steps = _check_training(batches, steps)
    trainer = PipelinedTrainer(
        model_fn, counts, microbatches, schedule, lr, loss_fn, optimizer, group
    )
    for step in range(steps):
        trainer.step(*_batch_for(batches, step))
    return trainer.result()


class _StepTimes(Callback):
    """Seconds per step, from the step's start to the end of its optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.start = 0.0

    def on_step_start(self, state: LoopState) -> None:
        self.start = time.perf_counter()

    def on_step(self, state: LoopState) -> None:
        self.times.append(time.perf_counter() - self.start)


def train_unsplit(
    model_fn: Callable[[], nn.Module],
    batches: Sequence[Batch],
    lr: float = 1e-3,
    steps: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
) -> TrainResult:
    """What :func:`train_pipelined` must equal: the whole model, not split into stages, trained
    in this one process by the one reference trainer
    (:func:`dmlbook.data_parallel.loop.train_reference`) on the same batches for the same steps,
    each step timed; returned as a one-stage :class:`TrainResult` (``state`` has every layer)."""
    steps = _check_training(batches, steps)
    timer = _StepTimes()
    plan = (_batch_for(batches, step) for step in range(steps))
    done = train_reference(model_fn, plan, optimizer=optimizer, lr=lr, loss_fn=loss_fn,
                           callbacks=[timer])  # fmt: skip
    model = done.model
    n_layers = len(pp.layers_of(model))
    return TrainResult(0, [n_layers], done.losses, timer.times, _named_state(model, model))


# ---- Fine-tuning ----------------------------------------------------------------------------


def _build_with_weights(model_fn: Callable[[], nn.Module], state: dict) -> nn.Module:
    model = model_fn()
    model.load_state_dict(state)
    return model


def with_weights(
    model_fn: Callable[[], nn.Module], state: dict[str, torch.Tensor]
) -> Callable[[], nn.Module]:
    """A model factory that builds ``model_fn()`` and loads ``state`` into it: how every rank of
    a fine-tuning run starts from the same pre-trained weights (the state travels with it)."""
    return functools.partial(_build_with_weights, model_fn, state)


FINETUNE_MODULES = (
    "statistics",
    "json",
    "random",
    "textwrap",
    "itertools",
    "collections",
    "functools",
    "heapq",
)


def finetune_text(modules: Sequence[str] = FINETUNE_MODULES) -> str:
    """The docstrings of some standard-library modules (about 48k characters): a second text that
    ships with Python, in another register than ``char_corpus``'s language reference."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue  # private, or imported from elsewhere
            if doc := inspect.getdoc(obj):
                parts.append(f"{attr}: {doc}")
    return "\n\n".join(parts)


def lm_batches(
    ids: torch.Tensor, block_size: int, batch_size: int, steps: int, seed: int = 0
) -> list[Batch]:
    """``steps`` batches of ``batch_size`` random windows of ``ids`` (next-character pairs)."""
    x, y = char_blocks(ids, block_size, seed=seed, n=steps * batch_size)
    return list(zip(x.split(batch_size), y.split(batch_size), strict=True))


@torch.no_grad()
def lm_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean next-character loss of a CharGPT over held-out batches (all of equal size)."""
    was_training = model.training
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
