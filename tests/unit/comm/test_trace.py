"""dmlbook.comm.trace: one recording mechanism, in a context variable."""

import threading
from dataclasses import dataclass

from dmlbook.comm import trace


@dataclass
class A:
    n: int


@dataclass
class B:
    n: int


def test_blocks_keep_their_kind_and_outer_blocks_see_inner_events():
    trace.record(A(0))  # nothing open: dropped
    with trace.recording(A) as outer:
        trace.record(A(1))
        with trace.recording(B) as bs, trace.recording(A) as inner:
            trace.record(A(2))
            trace.record(B(3))
        trace.record(A(4))
    trace.record(A(5))
    assert outer == [A(1), A(2), A(4)]
    assert inner == [A(2)] and bs == [B(3)]


def test_another_thread_records_only_into_its_own_blocks():
    seen = {}

    def other():
        trace.record(A(99))  # this thread has no block open
        with trace.recording(A) as mine:
            trace.record(A(7))
        seen["other"] = mine

    with trace.recording(A) as here:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        trace.record(A(1))
    assert here == [A(1)] and seen["other"] == [A(7)]


def test_a_block_left_by_an_exception_is_closed():
    try:
        with trace.recording(A) as events:
            trace.record(A(1))
            raise KeyError
    except KeyError:
        pass
    trace.record(A(2))
    assert events == [A(1)]
