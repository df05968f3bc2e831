"""Persistent ranks (dmlbook.launch.Ranks): state across cells, every request, every failure, and
no process left behind after close, an exception, or a killed caller. The magic: test_magic.py."""

import _thread
import linecache
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from processes import assert_gone

from dmlbook.launch import RankError, Ranks, RankTimeoutError
from dmlbook.runtime import session as ranks
from dmlbook.runtime import zygote
from dmlbook.runtime.errors import RanksClosedError

REPO = Path(__file__).resolve().parents[3]
RECORD_PIDS = (
    "import os, subprocess\n"
    "child = subprocess.Popen(['sleep', '600'])\n"
    "pids = [os.getpid(), child.pid]\n"
)


def _pids(session: Ranks) -> list[int]:
    """Each rank's pid and the pid of a child process it started."""
    session.exec(RECORD_PIDS)
    return [pid for pair in session.pull("pids") for pid in pair]


@pytest.fixture(scope="module")
def four():
    with Ranks(4, timeout=30) as session:
        yield session


# --------------------------------------------------------------------------- requests


def test_state_persists_across_cells_and_collectives_give_the_expected_values(four):
    assert four.exec("shard = torch.tensor([float(rank + 1)]) * torch.ones(3)") == [None] * 4
    assert four.exec("world_size, dist.get_rank(), dist.get_world_size()") == [
        (4, r, 4) for r in range(4)
    ]
    four.exec("dist.all_reduce(shard)")  # a cell later, on the tensor an earlier cell made
    expected = torch.full((3,), float(sum(range(1, 5))))
    assert all(torch.equal(t, expected) for t in four.pull("shard"))
    four.exec("gathered = [torch.zeros(1) for _ in range(world_size)]")
    four.exec("dist.all_gather(gathered, torch.tensor([10.0 * rank]))")
    on_0_and_2 = four.exec("torch.cat(gathered)", on=[0, 2])
    assert len(on_0_and_2) == 2
    assert all(torch.equal(t, torch.tensor([0.0, 10, 20, 30])) for t in on_0_and_2)
    assert four.exec("rank * 100", on=3) == [300]


def double_and_add(x, y=0):  # shipped by reference: this module is importable in the ranks
    import torch.distributed as dist

    return 2 * x + y + dist.get_rank()


def test_push_pull_and_call(four):
    weights = torch.arange(6.0).reshape(2, 3)
    four.push(weights=weights, scale=10)
    four.push({"offset": 0.5}, on=[1, 3])
    assert four.exec("float((weights * scale).sum()) + rank") == [150.0 + r for r in range(4)]
    assert four.pull("offset", on=[1, 3]) == [0.5, 0.5]
    with pytest.raises(RankError, match="name 'offset' is not defined on this rank"):
        four.pull("offset", on=[0])
    assert four.call(double_and_add, 5, y=1) == [11, 12, 13, 14]
    # a function defined in a notebook cell travels by value, its source lines with it
    cell = (
        "def square_rank(k):\n"
        "    import torch.distributed as dist\n"
        "    return k * dist.get_rank() ** 2\n"
    )
    name = "<ipython-input-3-ranks>"
    linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
    namespace = {"__name__": "__main__"}
    exec(compile(cell, name, "exec"), namespace)
    assert four.call(namespace["square_rank"], 2, on=[1, 2]) == [2, 8]
    four.push(square_rank=namespace["square_rank"])
    assert four.exec("square_rank(1)") == [0, 1, 4, 9]


def test_output_is_marked_by_rank_and_shown_in_rank_order(four, capsys):
    # rank 3 prints first and rank 0 last; the caller still shows rank 0 first
    four.exec("import sys, time\ntime.sleep(0.05 * (3 - rank))\nprint('hello', rank)\n"
              "print('careful', rank, file=sys.stderr)")  # fmt: skip
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"[rank {r}] hello {r}" for r in range(4)]
    assert err.splitlines() == [f"[rank {r}] careful {r}" for r in range(4)]


def test_a_long_request_streams_its_output(capsys):
    output = ranks._Output()
    output.add(1, "stdout", "one\n")
    output.add(0, "stdout", "tensor([1,\n        2])")  # print() writes its text, then "\n"
    output.add(0, "stdout", "\n")
    output.add(0, "stdout", "half a li")
    output.show(elapsed=0.5)  # a quick request so far: held
    assert capsys.readouterr().out == ""
    output.show(elapsed=ranks.STREAM_AFTER_S)  # then whole lines as they come, by rank
    assert capsys.readouterr().out == ("[rank 0] tensor([1,\n[rank 0]         2])\n[rank 1] one\n")
    output.add(0, "stdout", "ne\n")
    output.show(final=True)
    assert capsys.readouterr().out == "[rank 0] half a line\n"


def test_status_and_values_that_cannot_travel(four):
    states = four.status()
    assert [s.rank for s in states] == [0, 1, 2, 3]
    assert all(s.alive and not s.busy and s.rss_bytes > 10 * 2**20 for s in states)
    assert len({s.pid for s in states}) == 4 and os.getpid() not in {s.pid for s in states}
    assert "running" in repr(four)
    shown = four.exec("(i for i in range(3))", on=0)[0]  # a generator cannot be pickled
    assert "generator object" in repr(shown) and "not picklable" in repr(shown)
    four.exec("import threading\nlock = threading.Lock()")
    with pytest.raises(RankError, match="cannot send the value back"):
        four.pull("lock", on=0)  # pull and call say so instead


def test_bad_input_is_refused_at_once_without_touching_the_ranks(four):
    start = time.monotonic()
    with pytest.raises(SyntaxError):
        four.exec("x = = 1")
    for on in (4, -1, [0, 0], [], "0", [1.0]):
        with pytest.raises(ValueError, match="on="):
            four.exec("1", on=on)
    with pytest.raises(ValueError, match="not one"):
        four.push({"not a name": 1})
    with pytest.raises(ValueError, match="timeout"):
        four.exec("1", timeout=0)
    with pytest.raises(TypeError, match="cannot ship"):
        four.push(lock=threading.Lock())
    with pytest.raises(TypeError, match="callable"):
        four.call(42)
    for world_size in (0, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            Ranks(world_size)
    with pytest.raises(ValueError, match="backend"):
        Ranks(2, backend="mpi")
    assert time.monotonic() - start < 5
    assert four.exec("rank") == [0, 1, 2, 3]


# --------------------------------------------------------------------------- failures


def test_a_rank_that_raises_names_itself_and_the_cells_line_and_the_others_keep_state(four):
    four.exec("kept = rank")
    source = "x = 1\nif rank == 2:\n    raise ValueError('bad shard on purpose')\nx = 2\n"
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        four.exec(source)
    assert time.monotonic() - start < 5
    assert info.value.rank == 2 and isinstance(info.value.__cause__, ValueError)
    message = str(info.value)
    assert "rank 2 failed first: ValueError: bad shard on purpose" in message
    assert "line 3, in <module>" in message and "raise ValueError('bad shard" in message
    assert "restart" not in message  # nobody was left waiting: the session goes on
    assert four.exec("kept, x") == [(0, 2), (1, 2), (2, 1), (3, 2)]


def test_a_hang_times_out_with_stacks_and_a_rank_stuck_in_a_collective_needs_a_restart():
    with Ranks(3, timeout=30) as session:
        session.exec("import time\nkept = rank")
        with pytest.raises(RankTimeoutError) as info:
            session.exec("if rank == 0:\n    time.sleep(600)\n", timeout=2)
        assert info.value.ranks == [0] and "time.sleep(600)" in info.value.stacks[0]
        assert "interrupted and keep their state" in str(info.value)
        assert session.pull("kept") == [0, 1, 2]  # the sleeper was interrupted, not killed

        # rank 2 fails before an all-reduce: ranks 0 and 1 wait in it, where no signal reaches
        start = time.monotonic()
        with pytest.raises(RankError) as failed:
            session.exec(
                "t = torch.ones(1)\nif rank == 2:\n    raise KeyError('x')\ndist.all_reduce(t)"
            )
        assert time.monotonic() - start < 10
        assert failed.value.rank == 2 and "Ranks [0, 1] are still stuck" in str(failed.value)
        assert "%ranks restart" in str(failed.value)
        assert [s.busy for s in session.status()] == [True, True, False]
        with pytest.raises(RanksClosedError, match="restart"):
            session.exec("1")
        session.restart()
        assert session.exec("'kept' in globals(), rank") == [(False, r) for r in range(3)]


def test_a_session_rank_killed_by_a_signal_is_reported_with_its_last_stderr_lines():
    # What C++ code writes (gloo's reason for an abort) reaches the rank's stderr pipe, not the
    # session's channel: os.write to descriptor 2 stands in for it.
    with Ranks(2, timeout=30) as session:
        with pytest.raises(RankError) as info:
            session.exec(
                "import os, signal\n"
                "if rank == 1:\n"
                "    os.write(2, b'what(): Received data size does not match\\n')\n"
                "    os.kill(os.getpid(), signal.SIGABRT)\n"
            )
        message = str(info.value)
        assert info.value.rank == 1 and info.value.exitcode == -signal.SIGABRT
        assert "died with signal SIGABRT" in message and "session is closed" in message
        assert "what(): Received data size does not match" in message


def test_a_rank_that_dies_closes_the_session_and_the_next_request_says_restart():
    with Ranks(2, timeout=30) as session:
        pids = _pids(session)
        with pytest.raises(RankError) as info:
            session.exec("import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(1)")
        assert info.value.rank == 1 and info.value.exitcode == 3
        assert "died with exit code 3" in str(info.value) and "session is closed" in str(info.value)
        assert_gone(pids)
        assert not any(s.alive or s.busy for s in session.status())
        with pytest.raises(RanksClosedError, match="rank 1 died.*restart"):
            session.exec("1")
        session.restart()
        assert session.exec("rank") == [0, 1]
        # a rank killed between cells: the next request notices
        os.kill(session.status()[0].pid, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(RankError, match="rank 0 .* signal SIGKILL"):
            session.exec("1")


def test_interrupt_stops_every_ranks_cell_and_keeps_the_ranks():
    # A kernel interrupt is SIGINT in the caller's main thread, where Python raises it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, lambda: _thread.interrupt_main(signal.SIGINT))
    try:
        with Ranks(2, timeout=30) as session:
            session.exec("import time\nkept = 10 * rank")
            timer.start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt, match="keeps its state"):
                session.exec("time.sleep(600)")
            assert time.monotonic() - start < 5
            assert session.pull("kept") == [0, 10]
            assert session.exec("dist.all_reduce(t := torch.ones(1)) or t.item()") == [2.0, 2.0]
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------------- no orphans


def test_no_rank_outlives_close_or_an_exception():
    session = Ranks(2)
    pids = _pids(session)
    session.close()
    session.close()  # twice is fine
    assert_gone(pids)
    with pytest.raises(RanksClosedError, match="stopped"):
        session.exec("1")
    with pytest.raises(ZeroDivisionError):
        with Ranks(2) as session:
            pids = _pids(session)
            raise ZeroDivisionError("in the with block")
    assert_gone(pids)


def test_no_rank_outlives_a_killed_caller(tmp_path):
    # A notebook kernel killed outright runs no finally and no atexit: the ranks must notice.
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from dmlbook.runtime import zygote
        from dmlbook.launch import Ranks
        session = Ranks(2)
        session.exec({RECORD_PIDS!r})
        pids = [p for pair in session.pull("pids") for p in pair]
        helper = [zygote.helper().process.pid] if zygote.enabled() else []
        # and the helper's child that makes each run's network (dmlbook.runtime.private_net)
        makers = [int(c) for h in helper for c in
                  open(f"/proc/{{h}}/task/{{h}}/children").read().split() if int(c) not in pids]
        print("PIDS", *pids, *helper, *makers, flush=True)
        time.sleep(600)
    """)
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    caller = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
    try:
        line = caller.stdout.readline().decode()
    finally:
        caller.kill()
        caller.wait()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 4 + 2 * zygote.enabled()
    assert_gone(pids)


def test_spawned_ranks_serve_the_same(monkeypatch):
    # DMLBOOK_START=spawn: fresh interpreters, the launcher's other way to start ranks
    monkeypatch.setenv("DMLBOOK_START", "spawn")
    with warnings.catch_warnings(record=True) as refused:  # a kernel that refuses them a network
        warnings.simplefilter("always")
        session = Ranks(2, timeout=60)
    with session:
        session.exec("import os\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)")
        assert session.exec("t.item(), os.getppid()") == [(3.0, os.getpid())] * 2
        nets = set(session.exec("os.readlink('/proc/self/ns/net')"))
        assert len(nets) == 1  # one network for the session's ranks, their own unless refused
        assert (nets == {os.readlink("/proc/self/ns/net")}) == bool(refused)
        with pytest.raises(RankError, match="line 1"):
            session.exec("1 / 0")
        pids = _pids(session)
    assert_gone(pids)


@pytest.mark.gpu
def test_nccl_ranks_keep_their_tensors_on_their_gpus():
    world_size = torch.cuda.device_count()
    with Ranks(world_size, timeout=120) as session:
        assert session.backend == "nccl"
        session.exec("from dmlbook.comm.groups import device\nt = torch.ones(1, device=device())")
        session.exec("dist.all_reduce(t)")  # a cell later, on the tensor an earlier one put there
        assert session.exec("str(t.device), t.item()") == [
            (f"cuda:{r}", float(world_size)) for r in range(world_size)
        ]
