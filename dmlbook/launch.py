"""Run one ordinary function on N ranks: fresh local processes, or in place under torchrun.

Every chapter starts here (chapter 1 first; chapter 3 explains world size, rank and local rank).
A *rank function* is a plain function that uses ``torch.distributed``. The same function runs

* from a notebook cell, a test or a script: ``run(fn, 4)`` starts 4 processes, ships ``fn`` by
  value with cloudpickle, gives every rank an initialised process group and returns
  ``[fn's result on rank 0, ..., rank 3]``. The caller itself is never forked (forking a process
  that has run torch ops can deadlock); on Linux the ranks fork from a warm helper that has only
  imported torch (:mod:`dmlbook.runtime.zygote`; about 20x faster to start, measured), elsewhere
  or with ``DMLBOOK_START=spawn`` each is a fresh interpreter;
* under ``torchrun --nnodes N --nproc-per-node M script.py`` on many machines: ``run`` sees the
  ``RANK``/``WORLD_SIZE`` that torchrun set, initialises from the environment and calls ``fn`` in
  place. End such a script with :func:`exit_now`, as ``examples/`` do: the interpreter's teardown
  of torch can abort a rank after its work is done, and torchrun would fail the job.

Functions travel by :mod:`dmlbook.runtime.shipping`, which keeps each code object's file name and
sends the source lines of notebook cells along, so a rank's traceback shows the user's lines
whatever the installed cloudpickle does with code objects.

Failures are loud and quick: a rank that raises or dies becomes :class:`RankError` naming the rank
that failed first (with its traceback); ranks still running at ``timeout`` become
:class:`RankTimeoutError` with a stack dump of each stuck rank. Every child is gone when ``run``
returns or raises.

The warm helper leaves after a few idle minutes (:func:`set_helper_idle_timeout`) and comes back
on the next launch. The ranks rendezvous through a ``FileStore`` in the launch's private folder
(mode 0700), and their own sockets stay on the loopback interface
(:func:`dmlbook.runtime.rank_group.rendezvous_env`) of a network namespace of their own, one per
launch or session, inside a user namespace of their own (:mod:`dmlbook.runtime.private_net`):
no other user of the machine can connect to any of their sockets, or find them in
``/proc/net/tcp``, and nothing on the network can reach them (nor can they reach the network, or
a server on the machine's 127.0.0.1: fetch data in the caller). Where the kernel refuses user
namespaces, the ranks share the machine's loopback as they used to, and ``run`` and ``Ranks`` warn
in one line that their gloo listeners on 127.0.0.1 are reachable by other local users.
``DMLBOOK_PRIVATE_NET=0`` turns the private network off (the ranks then use the machine's
loopback, silently); runs under torchrun never use it.

``run`` starts fresh ranks every call. For ranks that live across notebook cells (chapters 2
and 9), :class:`Ranks` (:mod:`dmlbook.runtime.session`) keeps them and their namespaces until it
is closed; ``%load_ext dmlbook`` puts it behind ``%ranks`` and ``%%ranks``. Both start, watch and
stop ranks through :mod:`dmlbook.runtime.rank_group`.

This module is the runtime's public face: the machinery lives in :mod:`dmlbook.runtime`. A rank's
device is :func:`dmlbook.comm.groups.device`, beside ``group_rank_size``.
"""

from dmlbook.runtime.errors import (
    BACKENDS,
    EXIT_GRACE_S,
    FAILURE_GRACE_S,
    INSIDE_RUN,
    RankError,
    RankTimeoutError,
)
from dmlbook.runtime.launch import free_port, run, set_helper_idle_timeout
from dmlbook.runtime.rank_group import threads_per_rank
from dmlbook.runtime.rank_process import exit_now
from dmlbook.runtime.session import Ranks

__all__ = [
    "run",
    "set_helper_idle_timeout",
    "Ranks",
    "exit_now",
    "free_port",
    "threads_per_rank",
    "RankError",
    "RankTimeoutError",
    # the backends run() takes, its graces, and the variable set in every rank that run() starts
    "BACKENDS",
    "EXIT_GRACE_S",
    "FAILURE_GRACE_S",
    "INSIDE_RUN",
]
