"""dmlbook.notebook's timing helpers: the median item by a key, interleaved median times."""

import pytest

from dmlbook.notebook import interleaved_medians, median_by


def test_median_by_keeps_the_median_item_whole():
    rounds = [{"speed": 3, "id": "a"}, {"speed": 1, "id": "b"}, {"speed": 2, "id": "c"}]
    assert median_by(rounds, key=lambda r: r["speed"])["id"] == "c"
    assert median_by([5, 1, 4, 2], key=float) == 4  # an even count takes the upper one
    with pytest.raises(ValueError, match="no items"):
        median_by([], key=float)


def test_interleaved_medians_calls_each_once_per_round_after_a_warm_up():
    calls = []
    medians = interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                  rounds=3)  # fmt: skip
    assert calls == ["a", "b"] * 4  # warm-up, then three interleaved rounds
    assert set(medians) == {"a", "b"}
    with pytest.raises(ValueError, match="rounds"):
        interleaved_medians({"a": lambda: None}, rounds=0)


def test_interleaved_medians_on_the_threads_cpu_clock_leave_out_waiting():
    """A callable that sleeps takes wall time but almost none of its thread's CPU time."""
    import time

    sleep = {"sleep": lambda: time.sleep(0.05)}
    assert interleaved_medians(sleep, rounds=2)["sleep"] >= 0.05
    assert interleaved_medians(sleep, rounds=2, clock=time.thread_time)["sleep"] < 0.01
