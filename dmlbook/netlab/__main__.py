"""``python -m dmlbook.netlab up | down | status | run``: the network lab from the shell, for
trying by hand what chapters 3, 4, 11 and 13 run on the lab's hosts.

A lab made by ``up`` belongs to the shell that ran it (the command's parent process): ``down``
from that shell removes it, another user's ``down`` does not (unless ``--force``), and once that
shell has exited the next lab anyone starts removes it.
"""

from __future__ import annotations

import argparse
import os
import sys

import dmlbook.netlab
from dmlbook.netlab.lab import Lab, NetlabError, down, labs, status
from dmlbook.runtime.owners import Owner


def _one_lab(prefix: str | None) -> Lab:
    """The lab ``run`` means: the one named ``prefix``, preferring this shell's."""
    found = labs(prefix)
    shell = [r for r in found if r.owner.pid == os.getppid()]
    found = shell or found
    if len(found) != 1:
        names = ", ".join(r.name for r in found) or "none"
        raise NetlabError(f"{len(found)} labs named {prefix!r} ({names}); pick one with --prefix")
    record = found[0]
    lab = Lab(record.hosts, prefix=record.prefix)
    lab.name = record.name
    return lab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.netlab",
        description=dmlbook.netlab.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--prefix",
        help="a lab's tag (up: default dmlbook) or its full name; status, down, run: "
        "default every lab",
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="create the hosts")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--bandwidth", help="rate of each link, e.g. 1gbit")
    up.add_argument("--delay", help="one-way delay at each link end, e.g. 0.2ms (needs netem)")
    up.add_argument("--loss", type=float, help="percent of packets lost (needs netem)")
    up.add_argument("--second-bandwidth", help="add a second link per host (eth1) at this rate")
    down_cmd = sub.add_parser("down", help="remove this shell's labs and those whose owner is dead")
    down_cmd.add_argument(
        "--force",
        action="store_true",
        help="also labs of live owners (other users' runs!) and unrecorded namespaces",
    )
    sub.add_parser("status", help="show the labs and their hosts")
    run = sub.add_parser("run", help="run a command inside a host: run h0 -- CMD ...")
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.verb == "up":
            lab = Lab(
                args.hosts,
                args.bandwidth,
                args.delay,
                args.loss,
                args.prefix or "dmlbook",
                args.second_bandwidth,
            ).up(owner=Owner.of(os.getppid()))  # the shell's: it outlives this command
            print(status(lab.name))
        elif args.verb == "down":
            print("removed", " ".join(down(args.prefix, force=args.force)) or "nothing")
            if left := [r.name for r in labs(args.prefix)]:
                print(f"left alone (live owners): {' '.join(left)}")
        elif args.verb == "status":
            print(status(args.prefix))
        else:
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return _one_lab(args.prefix).run(args.host, cmd).returncode
    except (NetlabError, ValueError) as e:
        print(f"netlab: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
