"""``python -m dmlbook.bench ranks``: how long a ``%%ranks`` cell takes, against a fresh launch.

The round trip of a cell on persistent ranks (:class:`dmlbook.launch.Ranks`, chapters 2 and 9), run
through IPython's own ``run_cell`` as a notebook kernel runs it: an empty cell, and a cell that
all-reduces one element, at world sizes 2 and 4. Beside them, :func:`dmlbook.launch.run` of the
same work (fresh ranks, forked from the warm helper), and ipyparallel's ``%%px`` (an empty cell
on as many engines) where ipyparallel is installed. Medians and 95th percentiles, in ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from dmlbook.bench.common import one_all_reduce
from dmlbook.launch import run

EMPTY, ALL_REDUCE = "pass", "dist.all_reduce(t)"


def _empty() -> None:
    pass


def _times_ms(fn: Callable[[], object], repeats: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def _row(name: str, times: list[float]) -> dict:
    median, p95 = statistics.median(times), statistics.quantiles(times, n=20)[18]
    print(f"{name:52s} median {median:8.2f} ms   p95 {p95:8.2f} ms   ({len(times)} runs)")
    return dict(name=name, median_ms=median, p95_ms=p95, runs=len(times))


def _cell_runner(shell, source: str) -> Callable[[], None]:
    def run_cell() -> None:
        result = shell.run_cell(source, silent=True)
        if not result.success:
            raise RuntimeError(f"the benchmark cell failed: {result.error_in_exec!r}")

    return run_cell


def bench_ranks(world_sizes=(2, 4), repeats: int = 200, launches: int = 20) -> list[dict]:
    """Time ``%%ranks`` cells, ``launch.run`` and (if installed) ``%%px``; print and return rows."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "dmlbook")
    run(_empty, 1)  # the warm helper starts once per caller; its start is not a launch
    rows = []
    for world_size in world_sizes:
        shell.run_line_magic("ranks", f"start {world_size}")
        shell.run_cell("%%ranks\nt = torch.ones(1)", silent=True)
        for what, source in (("empty", EMPTY), ("one-element all-reduce", ALL_REDUCE)):
            times = _times_ms(_cell_runner(shell, f"%%ranks\n{source}"), repeats)
            rows.append(_row(f"world size {world_size}: {what} %%ranks cell", times))
        shell.run_line_magic("ranks", "stop")
        for what, fn in (("empty", _empty), ("one-element all-reduce", one_all_reduce)):
            times = _times_ms(lambda fn=fn, n=world_size: run(fn, n), launches, warmup=2)
            rows.append(_row(f"world size {world_size}: {what} fn, launch.run", times))
        rows += _bench_px(world_size, repeats)
    return rows


def _bench_px(world_size: int, repeats: int) -> list[dict]:
    """An empty ``%%px`` cell on ``world_size`` ipyparallel engines (their start timed once)."""
    try:
        import ipyparallel
    except ImportError:
        print(f"world size {world_size}: %%px: ipyparallel not installed")
        return []
    start = time.perf_counter()
    cluster = ipyparallel.Cluster(n=world_size)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(world_size)
    print(f"world size {world_size}: ipyparallel engines started in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    try:
        view = client[:]
        rows = [_row(f"world size {world_size}: empty %%px cell",
                     _times_ms(lambda: view.execute(EMPTY, block=True), repeats))]  # fmt: skip
    finally:
        cluster.stop_cluster_sync()
    return rows
