"""``python -m dmlbook.bench ...``: the benchmark command line, :func:`dmlbook.bench.main`."""

from dmlbook.bench import main

if __name__ == "__main__":  # not in the ranks that torch's spawn starts, which import this file
    main()
