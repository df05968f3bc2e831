"""A learner's Jupyter server under JupyterHub: copy the book into the learner's home, then become
``jupyterhub-singleuser`` (jupyterhub_config.py makes this the spawner's command).

It runs as the learner and inside the limits the spawner set, so the copy is the learner's own.
``python -m dmlbook.classroom copy-book ~/book`` never writes over a notebook the learner has
edited, so it runs on every start: the first start makes the copy, later ones bring unedited
chapters up to the installed package. A failed copy is reported in the hub's log and does not
keep the learner out of their server.
"""

import os
import subprocess
import sys
from pathlib import Path

BOOK = Path.home() / "book"


def copy_book() -> None:
    command = [sys.executable, "-m", "dmlbook.classroom", "copy-book", str(BOOK)]
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, timeout=120)
    except subprocess.TimeoutExpired:
        print(f"learner_server: {' '.join(command)} took over 120 s; stopped", file=sys.stderr)
        return
    if done.returncode:
        print(
            f"learner_server: {' '.join(command)} exited with {done.returncode}; "
            "starting the server without a fresh copy",
            file=sys.stderr,
        )


def main() -> None:
    copy_book()
    sys.stdout.flush()
    sys.stderr.flush()
    # The server takes this process's place (same pid), so the spawner stops it directly.
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub.singleuser", *sys.argv[1:]])


if __name__ == "__main__":
    main()
