"""The class side of the book: the copies learners get, and grading their exercises.

One command, ``python -m dmlbook.classroom``, with a module per operation:

* ``book_copy``: a learner's own, writable copy of the installed chapters, which a later copy
  updates without touching what the learner changed (``copy-book DIR``); a class's JupyterHub
  runs it as each learner's server starts (jupyterhub/learner_server.py);
* ``exercise_copies``: the learners' exercise copies of the chapters, every solution replaced by
  nbgrader's stub and the hidden tests removed (``copy-exercises chapters/ OUT/``, or
  ``make copy-exercises``);
* ``grading``: run exercise copies in fresh kernels and grade each exercise, passed, failed or
  not attempted, as a table and JSON (``grade OUT/``, or ``make grade``).

The notebooks are nbgrader assignments as they are, so a class can use nbgrader instead of the
last two (docs/guides/instructors.md). Nothing here is imported with the package: each command
imports only its module (grading starts kernels and imports torch; a copy of the book does not).
"""
