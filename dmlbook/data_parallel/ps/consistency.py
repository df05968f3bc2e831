"""How far a worker may run ahead, and when a server applies a gradient: consistency (chapter 2).

A worker's *clock* is how many gradients it has pushed. Each consistency model is a small frozen
object that answers the two questions the server asks:

* ``bound``: a server answers a pull for clock ``c`` only when ``c`` is at most ``bound`` steps
  ahead of the slowest worker's clock (0, k or infinity). Under :class:`Synchronous` that means
  the previous step must be applied, since its gradients are applied together;
* ``on_arrival``: whether the server applies each gradient as it arrives, or holds a step's
  gradients until all of them are in and applies them together.

:func:`dmlbook.data_parallel.ps.train_parameter_server` takes one as ``consistency=`` (default
:class:`Synchronous`). The three cover the spectrum the book describes, from bulk-synchronous to
fully asynchronous, with stale synchronous parallel (Ho et al., NeurIPS 2013) between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Synchronous:
    """Bulk-synchronous: every worker waits for the step's last gradient; equals one-process SGD.

    The server applies a step's W gradients together (their sum, each already its share of the
    global batch's mean), so a pull for step ``c`` waits until step ``c - 1`` is applied.
    """

    bound: ClassVar[int] = 0  # a pull waits for the previous step's update
    on_arrival: ClassVar[bool] = False  # a step's gradients are applied together


@dataclass(frozen=True)
class BoundedStaleness:
    """Stale synchronous parallel: a worker runs at most ``bound`` steps ahead of the slowest.

    Each gradient is applied as it arrives. ``BoundedStaleness(0)`` is a barrier per step, yet
    unlike :class:`Synchronous` a worker may already see some of the faster workers' gradients of
    the current step.
    """

    bound: int  # k: the most clocks a worker may lead the slowest worker by
    on_arrival: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.bound, bool) or not isinstance(self.bound, int):
            raise TypeError(
                f"BoundedStaleness(k) needs a whole number of steps k, got {self.bound!r}"
            )
        if self.bound < 0:
            raise ValueError(f"BoundedStaleness(k) needs k >= 0 steps, got {self.bound}")


@dataclass(frozen=True)
class Asynchronous:
    """Asynchronous: no bound; every gradient is applied on arrival, however stale."""

    bound: ClassVar[float] = math.inf
    on_arrival: ClassVar[bool] = True


# What ps.train_parameter_server's consistency= takes.
Consistency = Synchronous | BoundedStaleness | Asynchronous
_CALLS = {  # how to create each, for the error message
    Synchronous: "Synchronous()",
    BoundedStaleness: "BoundedStaleness(k)",
    Asynchronous: "Asynchronous()",
}


def check_consistency(consistency) -> None:
    """Reject anything but an instance of the three, with a message naming what is accepted."""
    if isinstance(consistency, Consistency):
        return
    if isinstance(consistency, type) and consistency in _CALLS:  # the class, not an instance
        got = f"the class {consistency.__name__}; create one: {_CALLS[consistency]}"
    else:
        got = repr(consistency)
    raise TypeError(
        "consistency must be one of Synchronous(), BoundedStaleness(k) with k >= 0, or "
        f"Asynchronous() (from dmlbook.data_parallel.ps), got {got}"
    )
