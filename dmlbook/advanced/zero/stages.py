"""ZeRO stages 1, 2 and 3, each a class that extends the one before (chapter 9b).

Stage 1 shards Adam's moments, stage 2 also the gradients (reduce-scattered during backward),
stage 3 also the parameters (gathered just in time for each unit's forward and backward).
:func:`zero_data_parallel` picks the class by stage number.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd import Variable

from dmlbook.advanced.zero.accounting import check_stage
from dmlbook.advanced.zero.stage0 import FlatUnit, ZeroStage0


class ZeroStage1(ZeroStage0):
    """ZeRO stage 1 (P_os): rank r keeps Adam's moments for its 1/N of each unit only. In the step
    it reduce-scatters the gradient (each rank gets the average of its own shard), steps that
    shard, and all-gathers the updated parameters."""

    stage = 1

    def _owned(self, unit: FlatUnit) -> int:
        return unit.stop - unit.start

    def step_unit(self, unit: FlatUnit) -> None:
        """Stage 1: reduce-scatter the gradient, step this rank's shard, all-gather."""
        # reduce-scatter in place, into this rank's slice of the full gradient (an output that
        # is the input's own chunk is allowed, as in NCCL)
        grad = unit.full_grad[unit.start : unit.stop]
        self._reduce_scatter_avg(grad, unit.full_grad)
        self.step_shard(unit, grad)

    def step_shard(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        """Adam on this rank's shard, then every rank's new shard to everyone."""
        mine = unit.full_param[unit.start : unit.stop]
        self._adam(mine, grad, unit)
        self._all_gather(unit.full_param, mine)


class ZeroStage2(ZeroStage1):
    """ZeRO stage 2 (P_os+g): also shards the gradients. Each unit's gradient is reduce-scattered
    as soon as backward has produced it (a post-accumulate-grad hook per parameter), and a rank
    keeps only the averaged gradient of its own shard; the step only steps and gathers."""

    stage = 2

    def _place_gradients(self, unit: FlatUnit) -> None:
        unit.grad_shard = unit.full_param.new_zeros(unit.stop - unit.start)

    def register_hooks(self) -> None:
        """On every parameter, a hook that runs when backward has produced its gradient."""
        for unit in self._units:
            for i, p in enumerate(unit.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit, i)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self._units:
            unit.grad_shard.zero_()

    def step_unit(self, unit: FlatUnit) -> None:
        """Stage 2: step this rank's shard and all-gather the parameters."""
        self.step_shard(unit, unit.grad_shard)  # reduce-scattered during backward already

    def _grad_hook(self, unit: FlatUnit, index: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self._queue_end_of_backward()  # a last pass for units backward never reached
            self.grad_ready(unit, index, param)

        return hook

    def grad_ready(self, unit: FlatUnit, index: int, param: torch.Tensor) -> None:
        """Backward has produced ``param``'s gradient (a post-accumulate-grad hook calls this):
        add it to the unit's full gradient, and once the unit's last one is in, reduce-scatter."""
        if unit.full_grad is None:  # the unit's whole gradient lives only during its backward
            unit.full_grad = param.grad.new_zeros(unit.padded)
        offset, numel = unit.offsets[index], unit.numels[index]
        unit.full_grad[offset : offset + numel] += param.grad.reshape(-1)
        param.grad = None  # autograd's copy is released; the flat buffer holds it
        unit.ready.add(index)
        if len(unit.ready) == len(unit.params):
            self.reduce_scatter_grad(unit)

    def reduce_scatter_grad(self, unit: FlatUnit) -> None:
        """Sum the unit's gradient over the ranks, keep the average of this rank's shard, and
        free the full gradient."""
        self._measure(f"backward {unit.name}: gradient complete")  # the memory meter's sample
        reduced = torch.empty_like(unit.grad_shard)
        self._reduce_scatter_avg(reduced, unit.full_grad)  # communication: reduce-scatter
        unit.grad_shard += reduced  # accumulates across backward passes until zero_grad
        unit.full_grad, unit.ready = None, set()

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for unit in self._units:  # parameters backward never reached have a zero gradient
            if self._reached_in_backward(unit):
                if unit.full_grad is None:
                    unit.full_grad = unit.grad_shard.new_zeros(unit.padded)
                self.reduce_scatter_grad(unit)
        self._measure("end of backward")

    def _reached_in_backward(self, unit: FlatUnit) -> bool:
        """Whether backward produced part of the unit's gradient, not yet reduce-scattered."""
        return unit.full_grad is not None


class ZeroStage3(ZeroStage2):
    """ZeRO stage 3 (P_os+g+p): also shards the parameters. A unit's parameters are all-gathered
    just before its forward (a forward pre-hook), freed after it, gathered again just before
    its backward and freed again; the step updates the parameter shard and gathers nothing.

    The parameters (and any view autograd saved for backward, such as a weight's transpose)
    stay views of the unit's flat buffer; freeing resizes its storage to zero bytes, and
    gathering gives it its bytes back and fills them, so every view sees the gathered numbers.
    """

    stage = 3

    def _place_gradients(self, unit: FlatUnit) -> None:
        super()._place_gradients(unit)
        unit.param_shard = unit.full_param[unit.start : unit.stop].clone()
        self.free_params(unit)

    def register_hooks(self) -> None:
        """Stage 2's gradient hooks, and on every unit a hook before and after its forward."""
        super().register_hooks()
        for unit in self._units:
            pre = functools.partial(self._call_before_forward, unit)
            post = functools.partial(self._call_after_forward, unit)
            self._handles.append(unit.module.register_forward_pre_hook(pre))
            self._handles.append(unit.module.register_forward_hook(post))

    def _call_before_forward(self, unit: FlatUnit, module, args) -> None:
        self.before_forward(unit)

    def _call_after_forward(self, unit: FlatUnit, module, args, output) -> None:
        self.after_forward(unit, output)

    def step_unit(self, unit: FlatUnit) -> None:
        """Stage 3: step this rank's parameter shard; nothing to gather."""
        self._adam(unit.param_shard, unit.grad_shard, unit)  # the next forward gathers it

    def _gathered(self, unit: FlatUnit) -> bool:
        return unit.full_param.untyped_storage().nbytes() > 0

    def gather_params(self, unit: FlatUnit) -> None:
        """Give the unit's flat buffer its bytes back and all-gather every rank's shard into it:
        the module's parameters, views of that buffer, hold the whole numbers again."""
        if self._gathered(unit):
            return
        storage = unit.full_param.untyped_storage()
        storage.resize_(unit.padded * unit.full_param.element_size())  # memory for the unit
        self._all_gather(unit.full_param, unit.param_shard)  # communication: all-gather

    def free_params(self, unit: FlatUnit) -> None:
        """Drop the gathered parameters; only this rank's ``param_shard`` stays."""
        unit.full_param.untyped_storage().resize_(0)

    def before_forward(self, unit: FlatUnit) -> None:
        """A forward pre-hook: gather the unit just in time."""
        self.gather_params(unit)
        self._measure(f"forward {unit.name}: gathered")

    def after_forward(self, unit: FlatUnit, output) -> None:
        """A forward hook: free the unit, and ask to hear when its output's gradient arrives."""
        self.free_params(unit)
        outputs = output if isinstance(output, tuple | list) else (output,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                unit.gathered_for_backward = False
                out.register_hook(lambda grad, unit=unit: self.before_backward(unit))

    def before_backward(self, unit: FlatUnit) -> None:
        """The unit's output gradient has arrived, so its backward is next: gather it again.
        (:meth:`reduce_scatter_grad` frees it once its gradient is reduce-scattered.)"""
        self._queue_end_of_backward()
        if not unit.gathered_for_backward:
            unit.gathered_for_backward = True
            self.gather_params(unit)
            self._measure(f"backward {unit.name}: gathered")

    def reduce_scatter_grad(self, unit: FlatUnit) -> None:
        super().reduce_scatter_grad(unit)
        self.free_params(unit)
        unit.gathered_for_backward = False

    def _reached_in_backward(self, unit: FlatUnit) -> bool:
        return unit.full_grad is not None or self._gathered(unit)


STAGE_CLASSES = (ZeroStage0, ZeroStage1, ZeroStage2, ZeroStage3)


def zero_data_parallel(module: nn.Module, stage: int, **kwargs) -> ZeroStage0:
    """ZeRO ``stage`` 0-3 around ``module`` (:class:`ZeroStage0` ... :class:`ZeroStage3`), with
    the keyword arguments of :class:`ZeroStage0`."""
    check_stage(stage)
    return STAGE_CLASSES[stage](module, **kwargs)
