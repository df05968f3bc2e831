"""Communication: what every parallelism in the book is built on.

* ``groups``: a rank's place in a group, and the block of a size each rank owns (every chapter)
* ``trace``: recording what a rank sends, in one mechanism, and the ``Send`` record (chapters 2,
  4, 9, 9b and 13)
* ``collectives``: every collective from point-to-point messages, with ``torch.distributed``'s
  signatures; ring, tree, recursive-doubling and naive all-reduce, and a ring with
  reduced-precision transfer (chapters 2 and 4)
* ``algorithms``: the message schedules behind them, one function per algorithm (2 and 4)
* ``p2p``: the plumbing the collectives share: a rank's view of its group, checks, buffers
* ``costmodel``: the alpha-beta model of each algorithm and of a parameter server (2 and 4)
* ``compression``: gradient compression as DDP communication hooks (chapter 4)
* ``alltoall``: all-to-all from point-to-point messages, and its autograd form (chapter 13)
* ``shm``: all-reduce, all-gather and reduce-scatter through shared memory, for ranks on one host
  (chapter 4)

Gloo's transport thread and the scheduler (chapter 4's finding) are the runtime's:
:mod:`dmlbook.runtime.gloo_thread`.
"""
