"""``python -m dmlbook.bench launch``: what starting ranks costs (the launcher every chapter uses).

The wall time from the call to the results of one all-reduce on N new ranks: ranks forked from
:func:`dmlbook.launch.run`'s warm helper (the default), ranks as fresh interpreters
(``DMLBOOK_START=spawn``), and torch's ``mp.spawn`` around the same rank function.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmlbook.bench import _one_all_reduce, _report
from dmlbook.launch import free_port, run, threads_per_rank


def _torch_spawn_rank(rank: int, world_size: int, port: int) -> None:
    # What torch's own spawn needs around the same rank function: env, init, destroy.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    _one_all_reduce()
    dist.destroy_process_group()


def bench_launch(repeats: int = 5) -> None:
    """Wall time from the call to the results of one all-reduce on N new ranks: ranks forked
    from the warm helper (the default), ranks as fresh interpreters (``DMLBOOK_START=spawn``),
    and torch's ``mp.spawn``, interleaved."""
    os.environ.pop("DMLBOOK_START", None)  # the default first, then spawn explicitly
    run(_one_all_reduce, 1)  # the helper starts once per caller; its start is not a launch
    for world_size in (2, 4):
        forked, spawned, theirs = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            run(_one_all_reduce, world_size)
            forked.append(time.perf_counter() - start)
            os.environ["DMLBOOK_START"] = "spawn"
            try:
                start = time.perf_counter()
                run(_one_all_reduce, world_size)
                spawned.append(time.perf_counter() - start)
            finally:
                del os.environ["DMLBOOK_START"]
            start = time.perf_counter()
            mp.spawn(_torch_spawn_rank, args=(world_size, free_port()), nprocs=world_size)
            theirs.append(time.perf_counter() - start)
        _report(f"launch + all-reduce, {world_size} ranks, forked", forked, theirs)
        _report(f"launch + all-reduce, {world_size} ranks, spawned", spawned, theirs)
