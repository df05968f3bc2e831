"""``python -m dmlbook.bench``: the records it writes (correctness only; timings are never
asserted). ``all --json`` is every bench's records in one file, each tagged with its bench."""

import json

import pytest
import torch

from dmlbook.bench.__main__ import main as bench_main  # the program's main


@pytest.mark.timeout(120)
def test_one_bench_writes_its_records_whole(tmp_path):
    from dmlbook.bench import allreduce

    path = tmp_path / "allreduce.json"
    bench_main(["allreduce", "--sizes", "4KiB", "--repeats", "1", "--json", str(path)])
    records = json.loads(path.read_text())
    names = {r["algorithm"] for r in records}
    expected = {"ring", "recursive_doubling", "tree", "naive", "auto", "bare ring", "shm", "memcpy"}
    assert expected <= names
    assert all("bench" not in r and r["bytes"] == 4096 and r["median_s"] > 0 for r in records)
    assert list(tmp_path.iterdir()) == [path]  # no partial file left beside it
    assert allreduce.parse_size("4KiB") == 4096


def test_time_all_reduces_gives_every_run_or_a_summary_of_them():
    # examples/time_allreduce.py asks for the runs themselves (chapter 4 checks its network
    # claims on each algorithm's fastest run); the bench and chapter 2 take the medians.
    from dmlbook.bench.allreduce import repeats_for, time_all_reduces
    from dmlbook.launch import run

    (runs,) = run(time_all_reduces, 2, [4096], 2, 0, False, summary=None)[0]
    (medians,) = run(time_all_reduces, 2, [4096], 2, 0, False)[0]
    assert runs.keys() == medians.keys() and "torch" in medians
    for times in runs.values():
        assert len(times) == repeats_for(4096, 2) and all(t > 0 for t in times)
    assert all(isinstance(m, float) and m > 0 for m in medians.values())


def _bare_ring_against_torch(numel: int) -> dict:
    import torch.distributed as dist

    from dmlbook.bench.allreduce import bare_ring
    from dmlbook.comm.groups import balanced_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    ours, theirs, scratch = mine.clone(), mine.clone(), torch.empty_like(mine)
    blocks = balanced_blocks(numel, world)
    bare_ring([ours[a:b] for a, b in blocks], [scratch[a:b] for a, b in blocks])
    dist.all_reduce(theirs)
    one_process = sum(
        torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        for r in range(world)
    )
    return {
        "torch": (ours - theirs).abs().max().item(),
        "one process": (ours - one_process).abs().max().item(),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_bare_ring_is_an_all_reduce(world):
    """The bench's reference line must be a real all-reduce, or its time says nothing: equal to
    torch's and to one process's sum, on a length no world size divides."""
    from dmlbook.launch import run

    for gaps in run(_bare_ring_against_torch, world, 1001):
        assert gaps["torch"] < 1e-12 and gaps["one process"] < 1e-12, gaps


def test_all_writes_every_bench_tagged(tmp_path, monkeypatch):
    """Each bench stubbed by a function that returns one record: main must keep them all."""
    import importlib

    calls = []
    for module, function in [
        ("launch", "bench_launch"),
        ("ranks", "bench_ranks"),
        ("data_parallel", "bench_data_parallel"),
        ("ddp", "bench_ddp"),
        ("allreduce", "bench_allreduce"),
        ("recompute", "bench_recompute"),
        ("pipeline", "bench_pipeline"),
        ("netlab", "bench_netlab"),
        ("composed", "bench_composed"),
        ("tp_check", "bench_tp_check"),
        ("gpu", "bench_gpu"),
    ]:
        mod = importlib.import_module(f"dmlbook.bench.{module}")

        def stub(*args, _name=module, **kwargs):
            calls.append(_name)
            return [{"figure": _name}]

        monkeypatch.setattr(mod, function, stub)
    path = tmp_path / "all.json"
    bench_main(["all", "--json", str(path)])
    records = json.loads(path.read_text())
    expected = ["launch", "ranks", "data-parallel", "ddp", "allreduce", "recompute", "pipeline"]
    expected += ["netlab", "composed", "tp-check"] + (["gpu"] if torch.cuda.is_available() else [])
    assert [r["bench"] for r in records] == expected
    assert all(r["figure"] == r["bench"].replace("-", "_") for r in records)
