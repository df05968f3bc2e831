"""nbgrader for a class taught from dmlbook (README, "For instructors").

The chapters are nbgrader assignments as they are: each exercise is a solution cell and a locked
checker cell worth one point with a hidden test. The instructor runs nbgrader's own commands in
the course folder with this file on the Jupyter config path; learners' servers get the same path
from jupyterhub_config.py::

    export JUPYTER_CONFIG_PATH=/path/to/dmlbook/jupyterhub
    nbgrader generate_assignment ch10 && nbgrader release_assignment ch10
    nbgrader collect ch10 && nbgrader autograde ch10 && nbgrader export
"""

import os

c = get_config()  # noqa: F821 (nbgrader defines it when it loads this file)

c.CourseDirectory.course_id = "dmlbook"
# The exchange every learner's fetch and submit go through: a folder all users may write to
# (nbgrader creates it world-writable on the first release). $DMLBOOK_EXCHANGE moves it (the tests
# use a private one).
c.Exchange.root = os.environ.get("DMLBOOK_EXCHANGE", "/srv/nbgrader/exchange")

# A cell's time limit when nbgrader runs a notebook (autograde, validate). nbgrader's default, 30 s,
# fails chapter 13's network-lab cell (30-38 s on the quiet 2-core reference machine). The longest
# cell of any chapter, measured under nbval on that machine shared with other jobs (load average
# 15-25 on 2 cores): 18-109 s, and one of chapter 4's cells passed nbval's 120 s limit once
# (README, "For instructors"). 300 s fits those with margin; a cell that hangs still fails.
c.Execute.timeout = 300
# After a cell's reply, how long to wait for the rest of its output. nbgrader fails the learner's
# notebook when that wait runs out (raise_on_iopub_timeout), and the default, 4 s, is short for a
# kernel on a server that thirty learners' kernels keep busy; the wait ends as soon as the output
# is in, so a longer limit costs nothing where the machine is quiet.
c.Execute.iopub_timeout = 60
