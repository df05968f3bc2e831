"""``%ranks`` and ``%%ranks``: ranks that stay alive between notebook cells (chapters 2 and 9).

``%load_ext dmlbook`` registers one magic, a thin layer over :class:`dmlbook.launch.Ranks`::

    %ranks start 4 [--backend gloo] [--timeout 60]   # 4 ranks, each with a process group
    %%ranks [--on 0,2] [--timeout 10]                # this cell's code, on every rank (or some)
    %ranks push NAME [NAME ...] [--on 0,2]           # the notebook's values, to the ranks
    shards = %ranks pull NAME [--on 0,2]             # a name's value on each rank, by rank
    %ranks status                                    # alive, busy and memory of each rank
    %ranks restart                                   # new ranks (the old state is lost)
    %ranks stop

A ``%%ranks`` cell runs in each rank's own namespace, which starts with ``torch``, ``dist``,
``rank`` and ``world_size`` and keeps what the cells define. Each rank's output is shown marked
``[rank r]``, rank by rank. If the cell's last line is an expression, its values come back as
the cell's result, a list by rank. Tracebacks point at the cell's own lines.
"""

from __future__ import annotations

import argparse
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from dmlbook.runtime.errors import BACKENDS, RankError, RanksClosedError, RankTimeoutError
from dmlbook.runtime.session import Ranks

__all__ = ["RanksMagics"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as IPython's UsageError instead of exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--on takes ranks like 0,2; got {text!r}") from None


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    line = _Parser(prog="%ranks", add_help=False)
    commands = line.add_subparsers(dest="command", required=True, parser_class=_Parser)
    start = commands.add_parser("start", help="start N ranks")
    start.add_argument("world_size", type=int)
    start.add_argument("--backend", choices=BACKENDS, default="auto")
    start.add_argument("--timeout", type=float, default=60.0, help="seconds a cell may run")
    for name in ("push", "pull"):
        command = commands.add_parser(name)
        command.add_argument("names", nargs="+" if name == "push" else 1)
        command.add_argument("--on", type=_rank_list)
    for name in ("status", "restart", "stop"):
        commands.add_parser(name)
    cell = _Parser(prog="%%ranks", add_help=False)
    cell.add_argument("--on", type=_rank_list, help="only these ranks, e.g. 0,2")
    cell.add_argument("--timeout", type=float, help="seconds this cell may run")
    return line, cell


@magics_class
class RanksMagics(Magics):
    """The ``%ranks`` line magic and the ``%%ranks`` cell magic, over one :class:`Ranks`."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.session: Ranks | None = None
        self._line_parser, self._cell_parser = _parsers()

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        """``%ranks start N | push NAME.. | pull NAME | status | restart | stop``, or a
        ``%%ranks [--on 0,2] [--timeout S]`` cell run on every rank (``dmlbook.runtime.magic``)."""
        try:
            if cell is not None:
                return self._cell(self._cell_parser.parse_args(shlex.split(line)), cell)
            args = self._line_parser.parse_args(shlex.split(line))
            return getattr(self, f"_{args.command}")(args)
        except ValueError as e:  # a bad rank, name or timeout: said before anything runs
            raise UsageError(f"%ranks: {e}") from None
        except (RankError, RankTimeoutError, RanksClosedError, KeyboardInterrupt) as e:
            # The message holds the rank's traceback; the frames of dmlbook and IPython would
            # only hide it, so the error is shown from here.
            raise e.with_traceback(None)  # noqa: B904 (the same exception, raised again)

    def _cell(self, args, cell: str):
        # A blank first line stands for the %%ranks line: the cell's lines keep their numbers.
        values = self._session().exec("\n" + cell, on=args.on, timeout=args.timeout)
        return values if any(v is not None for v in values) else None

    def _start(self, args) -> None:
        if self.session is not None and self.session.running:
            raise UsageError(
                f"{self.session.world_size} ranks are running already: "
                "%ranks stop (or %ranks restart) first"
            )
        self.session = Ranks(args.world_size, backend=args.backend, timeout=args.timeout)
        print(f"{args.world_size} ranks started ({self.session.backend})")

    def _push(self, args) -> None:
        missing = [name for name in args.names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%ranks push: not defined in the notebook: {', '.join(missing)}")
        self._session().push({name: self.shell.user_ns[name] for name in args.names}, on=args.on)

    def _pull(self, args) -> list:
        return self._session().pull(args.names[0], on=args.on)

    def _status(self, args) -> None:
        session = self._session()
        print(f"{session!r}\n{'rank':>4} {'pid':>8} {'alive':>6} {'busy':>5} {'memory':>11}")
        for s in session.status():
            memory = "?" if s.rss_bytes is None else f"{s.rss_bytes / 2**20:.1f} MiB"
            alive, busy = ("yes" if s.alive else "no"), ("yes" if s.busy else "no")
            print(f"{s.rank:>4} {s.pid:>8} {alive:>6} {busy:>5} {memory:>11}")

    def _restart(self, args) -> None:
        session = self._session()
        session.restart()
        print(f"{session.world_size} new ranks started ({session.backend})")

    def _stop(self, args) -> None:
        if self.session is not None:
            self.session.close()
            print(f"{self.session.world_size} ranks stopped")
            self.session = None

    def _session(self) -> Ranks:
        # A session whose ranks died stays here: its next request says to restart it.
        if self.session is None:
            raise UsageError("no ranks: start them with %ranks start N")
        return self.session
