"""`python -m dmlbook.book`: a learner's own copy of the chapters, or where the installed ones are.

python -m dmlbook.book copy ~/dmlbook     # write (or update) your copy; your edits are kept
python -m dmlbook.book path               # the installed chapters (data, examples: --what)
python -m dmlbook.book site build/site     # the book as a static site (`make site`; a checkout)
"""

from __future__ import annotations

import argparse
import sys

from dmlbook import book
from dmlbook.book import learner_copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dmlbook.book", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    copy = commands.add_parser("copy", help="write or update a learner's copy of the chapters")
    copy.add_argument("folder", help="where the copy goes (created if missing)")
    copy.add_argument(
        "--force", action="store_true", help="also replace notebooks you have changed (loses them)"
    )
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
    if args.command == "path":
        print(
            {"chapters": book.chapters_dir, "data": book.data_dir, "examples": book.examples_dir}[
                args.what
            ]()
        )
        return 0
    try:
        result = learner_copy.copy_book(args.folder, force=args.force)
    except OSError as err:
        print(f"python -m dmlbook.book copy: {err}", file=sys.stderr)
        return 1
    print(learner_copy.summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
