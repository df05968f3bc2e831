"""`python -m dmlbook.book`: a learner's own copy of the chapters, or where the installed ones are.

python -m dmlbook.book copy ~/dmlbook     # write (or update) your copy; your edits are kept
python -m dmlbook.book path               # the installed chapters (data, examples: --what)
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
    args = parser.parse_args(argv)
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
