"""``python -m dmlbook.bench ...``: the benchmark command line, :func:`dmlbook.bench.main`; the
measurements chapters 2, 3, 4, 6 and 13 and the README quote."""

from dmlbook.bench import main

if __name__ == "__main__":  # not in the ranks that torch's spawn starts, which import this file
    main()
