"""``python -m dmlbook.netlab up | down | status | run``: the network lab from the shell, for
trying by hand what chapters 3, 4, 11 and 13 run on the lab's hosts."""

from __future__ import annotations

import argparse
import re
import sys

import dmlbook.netlab
from dmlbook.netlab.lab import Lab, NetlabError, _namespaces, down, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.netlab",
        description=dmlbook.netlab.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefix", default="dmlbook", help="namespace name prefix")
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="create the hosts")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--bandwidth", help="rate of each link, e.g. 1gbit")
    up.add_argument("--delay", help="one-way delay at each link end, e.g. 0.2ms (needs netem)")
    up.add_argument("--loss", type=float, help="percent of packets lost (needs netem)")
    up.add_argument("--second-bandwidth", help="add a second link per host (eth1) at this rate")
    sub.add_parser("down", help="remove the hosts")
    sub.add_parser("status", help="show the hosts")
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
                args.prefix,
                args.second_bandwidth,
            ).up()
            print(status(lab.prefix))
        elif args.verb == "down":
            print("removed", " ".join(down(args.prefix)) or "nothing")
        elif args.verb == "status":
            print(status(args.prefix))
        else:
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            ns = f"{args.prefix}-{args.host}"
            if ns not in _namespaces():
                raise NetlabError(f"no host {args.host!r} (namespace {ns}); see `status`")
            hosts = sum(1 for n in _namespaces() if re.fullmatch(rf"{args.prefix}-h\d+", n))
            return Lab(max(hosts, 1), prefix=args.prefix).run(args.host, cmd).returncode
    except (NetlabError, ValueError) as e:
        print(f"netlab: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
