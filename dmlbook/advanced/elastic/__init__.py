"""Elastic training and serving: jobs that lose, gain and resize workers (chapter 11).

Chapter 11 ("Elastic model training and serving") teaches three pieces with this module:

1. **Elastic data parallelism under torchrun's elastic agent.** ``torchrun --nnodes 1:N
   --max-restarts K`` runs an *agent* per machine. When a worker dies, the agent stops the others,
   meets the surviving agents again (the c10d *rendezvous*) and starts a fresh group at whatever
   world size is there now. Nothing survives in memory, so :func:`train_worker` (what each worker
   runs; ``examples/elastic_train.py`` is the script) checkpoints with chapter 3's atomic
   :func:`dmlbook.data_parallel.checkpoint.save` and, on every start:

   * resumes from the latest checkpoint (:func:`resume`): the model, the momentum, and the
     position in the epoch counted in **samples** (a position in batches means nothing once the
     batch size changes);
   * re-partitions the rest of the epoch for the new world size (:func:`elastic_batches`, with
     :func:`rank_batch`): global batch ``t`` is the next ``local_batch x world`` samples of the
     epoch's shuffled order, and rank ``r`` takes its own contiguous part, so no sample is lost
     or seen twice;
   * rescales the learning rate to the new global batch with the linear rule
     (:func:`lr_for`, :func:`dmlbook.data_parallel.linear_scaling`).

   Each set of workers the agents start together is a *generation*. The worker writes a
   :class:`Timeline` (JSON lines under the run directory: start, checkpoint, step, kill, fault,
   end, with wall times, and when the agent spawned each worker) and, per rank and generation,
   the sample indices it trained on (:func:`samples_by_generation`, :func:`samples_trained`), so
   tests and the notebook can check the story instead of trusting it. :func:`torchrun_command`
   writes the agents' command lines (``--standalone``, or a c10d endpoint for several nodes) and
   :func:`run_agents` runs them and leaves no process behind. torchrun needs
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (:data:`AGENT_ENV`) for restarts to work here.

2. **Adaptive training on a parameter server**: chapter 2's parameter server
   (:func:`dmlbook.data_parallel.ps.train_parameter_server` with ``members``) lets workers join
   and leave between rounds. Workers only ever talk to the server, so a membership change needs
   no rendezvous and no restart: each round's global batch goes to whoever is there.

3. **Elastic serving** (:func:`serve_elastic`): a pool of inference worker processes that an
   :class:`Autoscaler` grows and shrinks with the measured request rate (a :class:`FixedPool`
   is the baseline), with every request's latency; :func:`serve_side_by_side` runs several
   pools at the same time, so that they share the machine as it is and compare fairly.

The parts, each a module of this package: ``training`` (the worker, its data order and learning
rate, the reference), ``agents`` (torchrun's agents from Python) and ``serving``; every public
name is importable from ``dmlbook.advanced.elastic`` itself.
"""

from dmlbook.advanced.elastic.agents import (
    AGENT_ENV,
    SCRIPT,
    AgentRun,
    alive,
    run_agents,
    samples_by_generation,
    samples_trained,
    torchrun_command,
)
from dmlbook.advanced.elastic.serving import (
    Autoscaler,
    FixedPool,
    request_schedule,
    serve_elastic,
    serve_side_by_side,
)
from dmlbook.advanced.elastic.training import (
    ElasticConfig,
    ResumePoint,
    Timeline,
    elastic_batches,
    epoch_order,
    lr_for,
    position_after,
    rank_batch,
    resume,
    train_worker,
    uninterrupted_run,
)

__all__ = [
    "SCRIPT",
    "alive",
    "AGENT_ENV",
    "AgentRun",
    "Autoscaler",
    "ElasticConfig",
    "FixedPool",
    "ResumePoint",
    "Timeline",
    "elastic_batches",
    "epoch_order",
    "lr_for",
    "rank_batch",
    "position_after",
    "request_schedule",
    "resume",
    "run_agents",
    "samples_by_generation",
    "samples_trained",
    "serve_elastic",
    "serve_side_by_side",
    "torchrun_command",
    "uninterrupted_run",
    "train_worker",
]
