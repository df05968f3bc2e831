"""Backward in two halves: the input gradient (B) and the weight gradient (W) (chapter 6,
section 6.8: beyond the book; its exercises 3-4 split a Linear -> tanh -> Linear block).

Zero-bubble pipeline schedules (Qi et al. 2023, :func:`dmlbook.model_parallel.schedules.
zb_h1_schedule`) rest on one observation: of a layer's backward, only the gradient of its *input*
is on the critical path (the previous stage waits for it); the gradient of its *weights* is needed
only by the optimizer step, so it can wait and fill a gap. The split is shown on one linear layer
first, ``y = x W^T + b``:

- :func:`linear_input_gradient` is B: ``grad_x = grad_y W``;
- :func:`linear_weight_gradient` is W: ``grad_W = grad_y^T x`` and ``grad_b`` the rows' sum of
  ``grad_y``. Together they are what autograd's one backward of the layer computes.

Then for any ``nn.Module`` (the pipeline executor's stages,
:class:`dmlbook.model_parallel.pipeline.PipelineStage`, with a schedule that has W ops):

- :func:`weight_outputs` records, during the forward, the output of every submodule that owns
  parameters (each ``Linear``, ``LayerNorm``, ``Embedding``...), as the autograd edge it leaves;
- :func:`input_gradient` (B) runs ``torch.autograd.grad`` from the stage's output to its input
  *and* to those recorded outputs, keeping the graph: autograd skips every weight-gradient
  product, and what B keeps (each recorded output's gradient) is exactly what W needs;
- :func:`weight_gradient` (W), later, runs each owner's weight-gradient products from its
  output's gradient and adds them into ``.grad``.

B + W equal one ``backward()`` as long as every use of a parameter lies inside the forward of the
module that owns it (no weights tied across modules), which :func:`weight_outputs` cannot see:
``tests/unit/model_parallel/test_backward_split.py`` checks the equality on the book's models.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = [
    "input_gradient",
    "linear_input_gradient",
    "linear_weight_gradient",
    "weight_gradient",
    "weight_outputs",
]


# ---- one linear layer, by hand ------------------------------------------------------------------


def linear_input_gradient(grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B of ``y = x W^T + b``: the gradient of the input, ``grad_y W`` (any leading dims)."""
    return grad_y @ weight


def linear_weight_gradient(
    x: torch.Tensor, grad_y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """W of ``y = x W^T + b``: ``(grad_W, grad_b) = (grad_y^T x, grad_y summed over rows)``,
    leading dims flattened into rows."""
    rows_x, rows_g = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    return rows_g.T @ rows_x, rows_g.sum(0)


# ---- any module: record in forward, B now, W later ----------------------------------------------


def _owners(module: nn.Module) -> list[nn.Module]:
    """The submodules that own parameters that need a gradient."""
    return [m for m in module.modules() if any(p.requires_grad for p in m.parameters(False))]


@contextmanager
def weight_outputs(module: nn.Module) -> Iterator[list[tuple[nn.Module, GradientEdge]]]:
    """Inside the ``with``, every forward of a submodule of ``module`` that owns parameters
    appends ``(submodule, edge of its output)`` to the list it yields: where W will start."""
    recorded: list[tuple[nn.Module, GradientEdge]] = []

    def record(owner: nn.Module, args, output) -> None:
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"{type(owner).__name__} owns parameters but returns a "
                f"{type(output).__name__}: splitting its backward needs one output tensor"
            )
        if output.requires_grad:  # taken now: a later in-place op does not move the edge
            recorded.append((owner, get_gradient_edge(output)))

    handles = [m.register_forward_hook(record) for m in _owners(module)]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class PendingWeights:
    """What B leaves for W: each owner's output edge and the gradient B computed for it."""

    outputs: list[tuple[nn.Module, GradientEdge]]
    grads: list[torch.Tensor | None]


def input_gradient(
    y: torch.Tensor,
    grad_y: torch.Tensor | None,
    x: torch.Tensor,
    outputs: list[tuple[nn.Module, GradientEdge]],
) -> tuple[torch.Tensor | None, PendingWeights]:
    """B: the gradient of the stage input ``x`` (None where ``x`` needs none, e.g. token ids),
    from ``y``'s gradient ``grad_y`` (None where ``y`` is the loss), computing no weight gradient;
    returns it and what W needs. The graph is kept for W."""
    wants_x = x.requires_grad
    inputs = ([x] if wants_x else []) + [edge for _, edge in outputs]
    if not inputs:
        return None, PendingWeights([], [])
    grads = torch.autograd.grad(
        [y], inputs, None if grad_y is None else [grad_y], retain_graph=True, allow_unused=True
    )
    grad_x = grads[0] if wants_x else None
    return grad_x, PendingWeights(outputs, list(grads[1:] if wants_x else grads))


def weight_gradient(pending: PendingWeights) -> None:
    """W: each owner's weight gradient from its output's gradient, added into ``.grad``."""
    for (owner, edge), grad in zip(pending.outputs, pending.grads, strict=True):
        params = [p for p in owner.parameters(False) if p.requires_grad]
        if grad is None or not params:
            continue  # this output did not reach the loss
        dws = torch.autograd.grad([edge], params, [grad], retain_graph=True, allow_unused=True)
        for p, dw in zip(params, dws, strict=True):
            if dw is not None:
                p.grad = dw if p.grad is None else p.grad + dw
