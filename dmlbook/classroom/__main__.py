"""`python -m dmlbook.classroom`: a learner's copy of the book, the exercise copies, grading.

python -m dmlbook.classroom copy-book ~/book               # your own copy; your edits are kept
python -m dmlbook.classroom copy-exercises chapters/ OUT/  # solutions stubbed (make copy-exercises)
python -m dmlbook.classroom grade OUT/                     # a table, and OUT/grades.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "python -m dmlbook.classroom"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    book = commands.add_parser("copy-book", help="write or update a learner's copy of the book")
    book.add_argument("folder", type=Path, help="where the copy goes (created if missing)")
    book.add_argument(
        "--force", action="store_true", help="also replace notebooks you have changed (loses them)"
    )
    exercises = commands.add_parser(
        "copy-exercises", help="write the exercise copies: every solution replaced by a stub"
    )
    exercises.add_argument("source", type=Path, help="the chapters folder, or one notebook")
    exercises.add_argument("out", type=Path, help="the folder to write the exercise copies into")
    grader = commands.add_parser("grade", help="run notebooks and grade their exercises")
    grader.add_argument("paths", type=Path, nargs="+", help="folders or notebooks to grade")
    grader.add_argument(
        "--json",
        type=Path,
        help="where to write the JSON report (default: grades.json in the "
        "first folder given; '-' prints it)",
    )
    grader.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    args = parser.parse_args(argv)

    if args.command == "copy-book":
        from dmlbook.classroom import book_copy

        try:
            result = book_copy.copy_book(args.folder, force=args.force)
        except OSError as err:
            print(f"{PROG} copy-book: {err}", file=sys.stderr)
            return 1
        print(book_copy.copy_report(result))
        return 0
    if args.command == "copy-exercises":
        from dmlbook.classroom import exercise_copies

        try:
            written = exercise_copies.write_exercise_copies(args.source, args.out)
        except (OSError, ValueError) as err:
            print(f"{PROG} copy-exercises: {err}", file=sys.stderr)
            return 1
        print(f"wrote {len(written)} exercise copies to {args.out}")
        return 0
    return _grade(args.paths, args.json, args.timeout)


def _grade(paths: list[Path], json_path: Path | None, timeout: float) -> int:
    from dmlbook.classroom import grading

    try:
        grades = grading.grade(paths, timeout, progress=lambda line: print(line, file=sys.stderr))
    except FileNotFoundError as err:  # a path that is neither a notebook nor a folder of them
        print(f"{PROG} grade: {err}", file=sys.stderr)
        return 1
    print(grading.table(grades))
    report = json.dumps(grading.to_json(grades), indent=2)
    if json_path == Path("-"):
        print(report)
    else:
        first = paths[0] if paths[0].is_dir() else paths[0].parent
        target = json_path or first / "grades.json"
        target.write_text(report + "\n")
        print(f"JSON report: {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
