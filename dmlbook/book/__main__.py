"""`python -m dmlbook.book`: where the installed chapters are, or the book as a static site.

python -m dmlbook.book path               # the installed chapters (data, examples: --what)
python -m dmlbook.book site build/site     # the book as a static site (`make site`; a checkout)

A learner's own copy of the chapters is `python -m dmlbook.classroom copy-book DIR`.
"""

from __future__ import annotations

import argparse
import sys

from dmlbook import book


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.book", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    path = commands.add_parser("path", help="print where the installed book's files are")
    path.add_argument("--what", choices=("chapters", "data", "examples"), default="chapters")
    site = commands.add_parser(
        "site", help="build the static site: chapters with outputs, guides, API, search"
    )
    site.add_argument("folder", help="where the site goes (replaced)")
    site.add_argument(
        "--cached-only",
        action="store_true",
        help="fail if a chapter has no executed run in the cache instead of running it",
    )
    args = parser.parse_args(argv)
    if args.command == "site":
        from dmlbook.book import static_site as site_builder

        try:
            built = site_builder.build(args.folder, run_missing=not args.cached_only)
        except site_builder.SiteError as err:
            print(f"python -m dmlbook.book site: {err}", file=sys.stderr)
            return 1
        ran = f"; ran now: {', '.join(built.ran_now)}" if built.ran_now else ""
        print(f"site in {built.folder}/index.html ({built.seconds:.0f} s{ran})")
        return 0
    print(
        {"chapters": book.chapters_dir, "data": book.data_dir, "examples": book.examples_dir}[
            args.what
        ]()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
