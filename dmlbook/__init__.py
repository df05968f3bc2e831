"""dmlbook: from-scratch, tested implementations for *Distributed Machine Learning with Python*.

The package follows the book's sections; every module's docstring names the chapter that
teaches it.

* the runtime: ``launch`` runs a rank function on N processes, or in place under torchrun
  (every chapter), and is the public face of ``runtime`` (the warm helper, rank processes,
  persistent ranks and the ``%%ranks`` magic, over two leaves: ``runtime.errors`` and the wire
  protocol ``runtime.protocol``; no import circle); ``netlab`` makes several hosts on one
  machine (chapters 3, 4, 11, 13); ``owners`` tells a crashed run's leftovers by their dead
  owner (pid, start time, host)
* ``comm``: what every parallelism is built on: ``groups`` (a rank's place in a group and its
  device, the block of a size it owns), ``trace`` (recording traffic), ``collectives`` (every
  collective from send/recv, chapters 2 and 4; its schedules in ``algorithms``, its plumbing in
  ``p2p``), ``costmodel`` (alpha-beta), ``compression`` and ``shm`` (shared memory, chapter 4),
  ``alltoall`` (chapter 13), ``gloo_thread`` (gloo's transport thread and the scheduler)
* ``data_parallel`` (section 1, chapters 1-4): ``averaging``, ``loop``, ``stages``, ``job``,
  ``ddp`` (DDP from scratch), ``ps`` (a sharded parameter server), ``checkpoint``,
  ``input_pipeline``, ``serving`` (data-parallel inference), ``tuning``
* ``model_parallel`` (section 2, chapters 5-8): ``memory``, ``recompute``, ``layer_split``,
  ``schedules``, ``pipeline``, ``stage_balancing``, ``pipeline_workflows``, ``pipeline_serving``,
  ``efficiency`` (a model made cheaper to train and serve: freezing, offload, low rank,
  distillation, quantization, reduced precision)
* ``advanced`` (section 3 and beyond, chapters 9-13 and 9b), one folder per strategy:
  ``tensor_parallel`` (Megatron layers, vocabulary parallelism, sequence parallelism, their
  ``comm``), ``context_parallel``, ``expert_parallel``, ``zero`` (stages 1-3 and
  ``zero.sharded_optimizer``), ``composition`` (the rank grid ``Layout``, plans, ``compose``,
  chapter 9's DP x TP training, chapter 13's training and planner), ``federated``, ``elastic``,
  ``speedups``
* shared pieces: ``datasets``, ``models``, ``optim``, ``viz`` (the plots, a module per topic),
  ``notebook`` (helpers chapters repeat), ``cpu_wait`` (did each rank have a core while it was
  timed? chapters 7 and 12), ``exercises`` (checkers)
* what serves the book: ``classroom`` (``python -m dmlbook.classroom``: a learner's copy of
  the book, exercise copies, grading), ``bench`` (``python -m dmlbook.bench``: each
  implementation against torch's own; ``make gpu-check``), ``book`` (the chapters, data and
  scripts in the installed package)
* ranks that live across notebook cells: ``dmlbook.launch.Ranks`` (``runtime.session``) and the
  IPython extension ``%load_ext dmlbook`` (``runtime.magic``: ``%ranks`` and ``%%ranks``,
  chapters 2 and 9)
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """``%load_ext dmlbook``: registers the ``%ranks`` and ``%%ranks`` magics
    (:class:`dmlbook.runtime.magic.RanksMagics`)."""
    from dmlbook.runtime.magic import RanksMagics  # imports torch: on demand, not with dmlbook

    ipython.register_magics(RanksMagics)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext dmlbook``: stop the ranks the magics started."""
    magics = ipython.magics_manager.registry.get("RanksMagics")
    if magics is not None and magics.session is not None:
        magics.session.close()
        magics.session = None
