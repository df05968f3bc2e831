"""dmlbook: from-scratch, tested implementations for *Distributed Machine Learning with Python*.

The package follows the book's sections; every module's docstring names the chapter that
teaches it. Its top level is three groups; no teaching module imports machinery
(``tests/unit/test_layers.py``).

Teaching (the book's algorithms, read beside the chapters):

* ``comm``: what every parallelism is built on: ``groups`` (a rank's place in a group and its
  device, the block of a size it owns), ``trace`` (recording traffic), ``collectives`` (every
  collective from send/recv, chapters 2 and 4; its schedules in ``algorithms``, its plumbing in
  ``p2p``), ``costmodel`` (alpha-beta), ``compression`` (DDP hooks) and ``shm`` (shared memory,
  chapter 4), ``alltoall`` (chapter 13)
* ``data_parallel`` (section 1, chapters 1-4): ``averaging``, ``loop``, ``stages``, ``job``,
  ``ddp`` (DDP from scratch), ``ps`` (a sharded parameter server), ``checkpoint``,
  ``input_pipeline``, ``serving`` (data-parallel inference), ``tuning``,
  ``compression_experiment`` (chapter 4's hooks trained and measured)
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

Shared pieces (what chapters and teaching code both read): ``datasets``, ``models``, ``optim``,
``viz`` (the plots, a module per topic), ``notebook`` (helpers chapters repeat), ``exercises``
(checkers), ``cpu_wait`` (did each rank have a core while it was timed? chapters 4, 7 and 12)

Machinery (what runs, serves and measures the book):

* ``launch`` runs a rank function on N processes, or in place under torchrun (every chapter):
  the public face of ``runtime`` (the warm helper, rank processes, persistent ranks
  ``launch.Ranks`` and the ``%load_ext dmlbook`` magics ``%ranks``/``%%ranks``, chapters 2 and 9;
  ``gloo_thread``, gloo's transport threads and the scheduler, chapter 4; ``owners``, who made a
  file, told by pid, start time and host; no import circle)
* ``netlab`` makes several hosts on one machine (chapters 3, 4, 11, 13)
* ``book`` (the chapters, data and scripts in the installed package, and the site),
  ``classroom`` (``python -m dmlbook.classroom``: a learner's copy of the book, exercise copies,
  grading), ``bench`` (``python -m dmlbook.bench``: each implementation against torch's own;
  ``make gpu-check``)
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
