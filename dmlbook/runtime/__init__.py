"""The runtime: real rank processes for every chapter, behind :mod:`dmlbook.launch`.

Read from the leaves up; every arrow points one way (``tests/unit/test_imports.py`` checks that no
module imports, even inside a function, one that imports it back):

* ``errors``: what a failed launch raises (``RankError``, ``RankTimeoutError``,
  ``RanksClosedError``) and the limits every module shares; a leaf;
* ``protocol``: the wire protocol between the caller, the warm helper and the ranks (the private
  folder's files that every rank reads first, and each rank's ``Channel`` of length-prefixed
  pickles, on which a launch's and a session's ranks alike answer); a leaf, standard library
  only, so that the helper may import it;
* ``shipping``: functions by value, with their file names and the cells' source lines;
* ``owners``: who made a file, a folder or a lab (pid, start time, host), so that what a crashed
  run left is recognised by its dead owner, never by its name; a leaf;
* ``gloo_thread``: gloo's transport threads and the scheduler (chapter 4): the policy every rank
  puts them under, and (by a watcher) the threads of groups made later;
* ``failures``: a rank's failure report, and the ``RankError`` that names the rank that failed
  first;
* ``private_net``: each run's ranks in a user and network namespace of their own, that no other
  user can reach (standard library only, beside ``protocol``);
* ``zygote``: the warm helper that has imported torch and forks the ranks;
* ``rank_server`` (a session's rank answering requests) and ``rank_process`` (every rank's
  ``main``);
* ``rank_group``: starting N ranks, waiting on their channels, output and exits, killing them;
* ``launch`` (``run``: one function on N fresh ranks, or in place under torchrun) and
  ``session`` (``Ranks``: ranks that live across cells), and ``magic`` (``%ranks``/``%%ranks``).

This ``__init__`` imports nothing: the helper imports ``zygote`` through it and must not load
the rest of the package before it forks.
"""
