"""``%load_ext dmlbook``: every ``%ranks`` command and ``%%ranks`` cells, in IPython's own shell,
which compiles cells as a notebook kernel does (the browser test drives one in JupyterLab)."""

import sys

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from processes import assert_gone

from dmlbook.launch import RankError, RankTimeoutError
from dmlbook.runtime.errors import RanksClosedError


@pytest.fixture(scope="module")
def shell():
    hooks = sys.displayhook, sys.excepthook
    ip = InteractiveShell.instance()
    yield ip
    ip.run_line_magic("unload_ext", "dmlbook")
    InteractiveShell.clear_instance()
    sys.displayhook, sys.excepthook = hooks


def three_ranks(shell):
    """What the tests after the first start from: the extension loaded and 3 ranks running. The
    tests run in order, each going on from the last (as a notebook's cells do), so this does
    nothing there; it lets one of them run alone."""
    magics = shell.magics_manager.registry.get("RanksMagics")
    if magics is None:
        run(shell, "%load_ext dmlbook")
        magics = shell.magics_manager.registry["RanksMagics"]
    if magics.session is None or not magics.session.running:
        run(shell, "%ranks start 3 --timeout 30")


def run(shell, source: str):
    """Run a cell; return its result (the value shown as Out), raising what it raised."""
    result = shell.run_cell(source)
    if result.error_before_exec or result.error_in_exec:
        raise result.error_before_exec or result.error_in_exec
    return result.result


def test_magic_commands_and_state_across_cells(shell, capsys):
    run(shell, "%load_ext dmlbook")
    run(shell, "%ranks start 3 --timeout 30")
    assert "3 ranks started (gloo)" in capsys.readouterr().out
    cell = "%%ranks\nshard = torch.full((2,), float(rank + 1))\nprint('holds', shard)"
    assert run(shell, cell) is None
    assert capsys.readouterr().out.splitlines() == [
        f"[rank {r}] holds tensor([{r + 1}., {r + 1}.])" for r in range(3)
    ]
    # a later cell uses what an earlier one built; the last expression comes back by rank
    summed = run(shell, "%%ranks\ndist.all_reduce(shard)\nshard")
    assert all(torch.equal(t, torch.full((2,), 6.0)) for t in summed) and len(summed) == 3
    assert run(shell, "%%ranks --on 0,2\nrank * 10") == [0, 20]
    # push the notebook's values; pull a name into the notebook
    run(shell, "import torch\nweights = torch.arange(3.0)\nscale = 2")
    run(shell, "%ranks push weights scale --on 1,2")
    assert run(shell, "%%ranks --on 1,2\nfloat(weights.sum()) * scale + rank") == [7.0, 8.0]
    run(shell, "pulled = %ranks pull shard")
    assert all(torch.equal(t, torch.full((2,), 6.0)) for t in shell.user_ns["pulled"])
    assert run(shell, "%ranks pull weights --on 2")[0].tolist() == [0.0, 1.0, 2.0]
    capsys.readouterr()
    run(shell, "%ranks status")
    table = capsys.readouterr().out.splitlines()
    assert "running" in table[0] and table[1].split() == ["rank", "pid", "alive", "busy", "memory"]
    assert [row.split()[0] for row in table[2:]] == ["0", "1", "2"]
    assert all(row.split()[2:4] == ["yes", "no"] and row.endswith("MiB") for row in table[2:])


def test_a_failing_cell_shows_the_cells_own_line_and_the_ranks_go_on(shell, capsys):
    three_ranks(shell)
    run(shell, "%%ranks\nkept = rank")
    cell = "%%ranks\nx = 1\nif rank == 1:\n    y = undefined_name\n"
    with pytest.raises(RankError) as info:
        run(shell, cell)
    message = str(info.value)
    assert info.value.rank == 1 and "NameError: name 'undefined_name' is not defined" in message
    # line 4 of the notebook cell, counting the %%ranks line, as the learner sees it
    assert "line 4, in <module>" in message and "y = undefined_name" in message
    assert run(shell, "%%ranks\nkept") == [0, 1, 2]
    with pytest.raises(RankTimeoutError) as hung:
        run(shell, "%%ranks --timeout 1 --on 2\nimport time\ntime.sleep(600)")
    assert "time.sleep(600)" in hung.value.stacks[2]
    assert run(shell, "%%ranks --on 2\nkept") == [2]


def test_mistakes_are_usage_errors(shell, capsys):
    from IPython.core.error import UsageError

    three_ranks(shell)
    for line in ("%ranks", "%ranks bogus", "%ranks start", "%ranks start two",
                 "%ranks start 3", "%ranks push not_defined_here", "%ranks pull a b",
                 "%ranks pull x --on 0,x"):  # fmt: skip
        with pytest.raises(UsageError):
            run(shell, line)
    for cell in ("%%ranks --on 7\n1", "%%ranks --timeout -1\n1", "%%ranks --bad\n1"):
        with pytest.raises(UsageError):
            run(shell, cell)
    with pytest.raises(SyntaxError):
        run(shell, "%%ranks\nx = = 1")
    assert "3 ranks are running already" in str(_raised(shell, "%ranks start 3"))


def _raised(shell, source):
    try:
        run(shell, source)
    except Exception as e:
        return e
    raise AssertionError(f"{source!r} did not raise")


def test_restart_stop_and_a_dead_rank(shell, capsys):
    three_ranks(shell)
    run(shell, "%ranks restart")
    assert "3 new ranks started" in capsys.readouterr().out
    with pytest.raises(RankError, match="name 'kept' is not defined"):  # the state went
        run(shell, "%%ranks\nkept")
    with pytest.raises(RankError, match="(?s)rank 0 failed first: it died.*session is closed"):
        run(shell, "%%ranks\nimport os, time\nif rank == 0:\n    os._exit(5)\ntime.sleep(1)")
    with pytest.raises(RanksClosedError, match="restart"):
        run(shell, "%%ranks\n1")
    run(shell, "%ranks restart")
    assert run(shell, "%%ranks\nrank") == [0, 1, 2]
    pids = [s.pid for s in shell.magics_manager.registry["RanksMagics"].session.status()]
    run(shell, "%ranks stop")
    assert "3 ranks stopped" in capsys.readouterr().out
    assert "no ranks" in str(_raised(shell, "%%ranks\n1"))
    assert_gone(pids)
