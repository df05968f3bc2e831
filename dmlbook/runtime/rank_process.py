"""What runs inside each rank process that :func:`dmlbook.launch.run` or
:class:`dmlbook.launch.Ranks` starts (every chapter's ranks).

A rank reads what it needs from the run's private folder (:mod:`dmlbook.runtime.protocol`): the
meta data and, for a launch, the payload (the function and its arguments); it answers on its
channel, the socket pair the caller made for it: a launch's rank with its function's result,
``("done", START, value)``, and any rank that fails with its report, ``("error", START,
report)``, before it exits. A session's rank (``meta["serve"]``) has no payload: once its
process group is up it serves the caller's requests on the same channel
(:mod:`dmlbook.runtime.rank_server`) until the caller closes it. The stack file receives a
faulthandler dump when the caller sends SIGUSR1.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from dmlbook.runtime import gloo_thread, protocol, rank_server, shipping
from dmlbook.runtime.failures import failure_report


def main() -> None:
    """Entry point of a rank process: set up, call fn (or serve requests), report a failure."""
    workdir, rank = Path(sys.argv[1]), int(sys.argv[2])
    # Appended to: the caller empties it before each SIGUSR1, and a session's rank may get several.
    stack_file = open(protocol.stack_file(workdir, rank), "a")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable()  # a segfault still prints a Python stack on stderr
    meta = pickle.loads((workdir / protocol.META).read_bytes())
    _exit_with_parent(meta["parent_pid"], workdir)
    torch.set_num_threads(int(os.environ["DMLBOOK_THREADS"]))
    sys.path[:] = meta["sys_path"]
    os.chdir(meta["cwd"])
    shipping.install_sources(meta["sources"])
    channel = protocol.Channel.passed_in()
    try:
        if meta["serve"]:
            _init_process_group(rank, meta)
            rank_server.serve(channel, rank, meta["world_size"])  # until the channel closes
            # which means the caller is gone (a caller that closes the session kills us first):
            # take what this rank started along, as a rank whose parent died does.
            _orphaned(workdir)
        fn, args, kwargs = pickle.loads((workdir / protocol.PAYLOAD).read_bytes())
        _init_process_group(rank, meta)
        result = fn(*args, **kwargs)
        channel.send(("done", protocol.START, shipping.dumps(result)[0]))
    except BaseException as e:  # SystemExit and KeyboardInterrupt in fn are failures too
        try:
            report = failure_report(e, time.time(), hide=(__file__,))
            channel.send(("error", protocol.START, report))
        finally:  # even if the report cannot be sent (the caller is gone)
            _exit(1, meta["parent_pid"], workdir)
    if dist.is_initialized():  # fn may have destroyed it already, as DDP tutorials do
        dist.destroy_process_group()
    _exit(0, meta["parent_pid"], workdir)


def exit_now(code: int = 0) -> NoReturn:
    """Flush stdout and stderr, then end this process at once, without the interpreter's teardown.

    The last line of a script that torchrun runs. Once the work is done, that teardown can still
    meet one of torch's gloo threads and abort the process (SIGABRT, "terminate called without an
    active exception"): seen here once in 20 two-node runs of chapter 3's job on a loaded machine,
    after every rank had done its work, and torchrun then reports the whole job failed.
    Public as ``dmlbook.launch.exit_now``; ``run``'s own ranks leave through it too (:func:`_exit`).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # nobody reads our output any more, or it is closed
            pass
    os._exit(code)


def _exit(code: int, parent_pid: int, workdir: Path) -> None:
    """Leave at once. Skipping the interpreter's teardown of torch saves 0.5-1 s, and means a DDP
    object is never freed after its group is gone, which can block on a gloo thread
    (pytorch#56297). The caller kills what this rank started; if the caller is gone, we do."""
    if os.getppid() != parent_pid:
        _orphaned(workdir)
    exit_now(code)


def _orphaned(workdir: Path) -> None:
    """The caller died: remove its launch folder and kill this rank's whole process group."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


_JOINED, _ALL_JOINED = "dmlbook/joined", "dmlbook/all-joined"  # keys of the start-up barrier


def _init_process_group(rank: int, meta: dict) -> None:
    timeout = datetime.timedelta(seconds=meta["timeout"] + 10)  # the caller's deadline comes first
    # A file in the run's private folder (mode 0700): only this user can join or write into it.
    # (-1 workers: no rank removes the file; the caller removes the folder.)
    store = dist.FileStore(meta["store"], -1)
    store.set_timeout(timeout)
    if meta["backend"] == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        meta["backend"], store=store, rank=rank, world_size=meta["world_size"], timeout=timeout
    )
    # No rank goes on (and may finish and exit) before every rank has *returned* from
    # init_process_group: gloo's connectFullMesh on a slower rank can still be using a pair whose
    # other end has already returned, and that end's exit failed it ("Gloo connectFullMesh failed
    # ... Connection closed by peer"; 1 launch in 5 to 80 of a 2-rank function without a
    # collective, here). A store barrier, not dist.barrier(): no collective is spent on it, and
    # under NCCL it creates no communicator.
    if store.add(_JOINED, 1) == meta["world_size"]:
        store.set(_ALL_JOINED, b"1")
    store.wait([_ALL_JOINED])
    gloo_thread.follow_env()  # DMLBOOK_GLOO_LOOP, from the caller's environment


def _exit_with_parent(parent_pid: int, workdir: Path) -> None:
    """If the caller dies (a killed notebook kernel), take this rank and its children down too,
    and remove the launch folder that the caller can no longer clean up."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        _orphaned(workdir)

    threading.Thread(target=watch, daemon=True).start()
