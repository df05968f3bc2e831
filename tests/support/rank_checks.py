"""What the rank-function test files share: run a checks function at world sizes 1 to 4 (in this
process at 1, outside any group: the single-process case), and catch an expected ValueError."""

import functools
from collections.abc import Callable

from dmlbook.launch import run


def by_world(checks: Callable[[], dict], timeout: float = 90) -> Callable[[int], list[dict]]:
    """``results(world)``: every rank's ``checks()`` at that world size, computed once."""

    @functools.cache
    def results(world: int) -> list[dict]:
        return [checks()] if world == 1 else run(checks, world, timeout=timeout)

    return results


def caught(fn: Callable[[], object]) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error"."""
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"
