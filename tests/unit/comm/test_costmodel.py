"""The alpha-beta cost model: hand-computed formulas, what they imply, the fit, a real link."""

import itertools
import math

import pytest

from dmlbook.comm import costmodel as cm
from dmlbook.comm.algorithms import ALGORITHMS
from dmlbook.comm.costmodel import Link
from dmlbook.launch import run

N = 1200.0  # divisible by 2, 3, 4, 5 and 8, so ring's chunks are whole bytes
LINK = Link(alpha=5e-6, beta=1e-9, gamma=2e-10)  # 5 us, 1 GB/s, reduction at 5 GB/s

# (algorithm, p) -> (messages, bytes, bytes reduced) on the critical path, computed by hand.
HAND = {
    ("ring", 2): (2, N, N / 2),
    ("ring", 3): (4, 4 * N / 3, 2 * N / 3),
    ("ring", 4): (6, 1.5 * N, 0.75 * N),
    ("ring", 5): (8, 1.6 * N, 0.8 * N),
    ("ring", 8): (14, 1.75 * N, 0.875 * N),
    ("tree", 2): (2, 2 * N, N),  # ceil(log2 2) = 1 round each way
    ("tree", 3): (4, 4 * N, 2 * N),  # ceil(log2 3) = 2
    ("tree", 4): (4, 4 * N, 2 * N),
    ("tree", 5): (6, 6 * N, 3 * N),  # ceil(log2 5) = 3
    ("tree", 8): (6, 6 * N, 3 * N),
    ("recursive_doubling", 2): (1, N, N),
    ("recursive_doubling", 3): (3, 3 * N, 2 * N),  # p'=2: pre-step, 1 round, post-step
    ("recursive_doubling", 4): (2, 2 * N, 2 * N),
    ("recursive_doubling", 5): (4, 4 * N, 3 * N),  # p'=4: pre-step, 2 rounds, post-step
    ("recursive_doubling", 8): (3, 3 * N, 3 * N),
    ("naive", 2): (2, 2 * N, N),
    ("naive", 3): (4, 4 * N, 2 * N),
    ("naive", 4): (6, 6 * N, 3 * N),
    ("naive", 5): (8, 8 * N, 4 * N),
    ("naive", 8): (14, 14 * N, 7 * N),
}


@pytest.mark.parametrize(("algorithm", "p"), list(HAND))
def test_terms_and_times_match_hand_computed_values(algorithm, p):
    messages, nbytes, reduced = HAND[algorithm, p]
    assert cm.terms(algorithm, p, N) == pytest.approx((messages, nbytes, reduced), rel=1e-15)
    expected = messages * LINK.alpha + nbytes * LINK.beta + reduced * LINK.gamma
    assert cm.all_reduce_time(algorithm, p, N, LINK) == pytest.approx(expected, rel=1e-12)


def test_world_size_one_costs_nothing():
    for algorithm in ALGORITHMS:
        assert cm.terms(algorithm, 1, N) == (0, 0, 0)
        assert cm.all_reduce_time(algorithm, 1, 1e9, LINK) == 0


def test_link_units():
    link = Link.from_bandwidth(2e-6, 400)  # 400 Gb/s = 50 GB/s
    assert link.alpha == 2e-6 and link.beta == pytest.approx(1 / 50e9)
    assert link.bandwidth_GBps == pytest.approx(50)
    assert link.send_time(1e6) == pytest.approx(2e-6 + 1e6 / 50e9)
    assert Link(1e-6, 0).bandwidth_GBps == math.inf
    assert "50 GB/s" in str(link) and "2 us" in str(link)


def test_ring_bandwidth_term_approaches_2n_beta():
    link = Link(alpha=0, beta=1e-9)
    ratios = [
        cm.all_reduce_time("ring", p, N, link) / (2 * N * link.beta) for p in (2, 8, 64, 4096)
    ]
    assert ratios == sorted(ratios) and all(r < 1 for r in ratios)
    assert ratios[0] == pytest.approx(0.5) and ratios[-1] == pytest.approx(1, abs=1e-3)
    # ...while tree's and naive's grow with p: ring is the bandwidth-optimal one
    assert cm.terms("tree", 4096, N)[1] == 24 * N and cm.terms("naive", 4096, N)[1] == 8190 * N


def test_latency_bound_algorithms_win_small_messages_ring_wins_large_ones():
    link = Link(alpha=10e-6, beta=1e-9)
    p = 8
    for fast_start in ("tree", "recursive_doubling"):
        assert cm.all_reduce_time(fast_start, p, 8, link) < cm.all_reduce_time("ring", p, 8, link)
        assert cm.all_reduce_time(fast_start, p, 1e8, link) > cm.all_reduce_time(
            "ring", p, 1e8, link
        )
        n = cm.crossover_bytes(fast_start, "ring", p, link)
        assert n is not None and 8 < n < 1e8
        # exactly where the two predictions meet; each side wins on its side
        t = cm.all_reduce_time(fast_start, p, n, link)
        assert cm.all_reduce_time("ring", p, n, link) == pytest.approx(t, rel=1e-12)
        assert cm.all_reduce_time("ring", p, 0.5 * n, link) > cm.all_reduce_time(
            fast_start, p, 0.5 * n, link
        )
        assert cm.all_reduce_time("ring", p, 2 * n, link) < cm.all_reduce_time(
            fast_start, p, 2 * n, link
        )
    # recursive doubling vs ring at p=8: 3 alpha + 3 n beta = 14 alpha + 1.75 n beta
    assert cm.crossover_bytes("recursive_doubling", "ring", p, link) == pytest.approx(
        11 * link.alpha / (1.25 * link.beta)
    )
    # naive is never better than ring: same messages, more bytes
    assert cm.crossover_bytes("naive", "ring", p, link) is None


def test_naive_grows_linearly_in_world_size():
    times = [cm.all_reduce_time("naive", p, N, LINK) for p in range(1, 10)]
    steps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert steps == pytest.approx([steps[0]] * len(steps), rel=1e-12)
    assert steps[0] == pytest.approx(2 * LINK.send_time(N) + N * LINK.gamma)


def test_predictions_table():
    link = Link.from_bandwidth(5e-6, 400)
    rows = cm.predict_all_reduce(link, [8, 1024], [1e3, 4e8])
    assert len(rows) == len(ALGORITHMS) * 4
    assert set(rows[0]) == {"algorithm", "world_size", "bytes", "predicted_s"}
    best = {
        (r["world_size"], r["bytes"]): min(
            (s for s in rows if (s["world_size"], s["bytes"]) == (r["world_size"], r["bytes"])),
            key=lambda s: s["predicted_s"],
        )["algorithm"]
        for r in rows
    }
    assert best[1024, 1e3] == "recursive_doubling" and best[1024, 4e8] == "ring"
    ps_rows = cm.predict_ps(link, [4], [1, 4], [1e8])
    assert [r["predicted_s"] for r in ps_rows] == [cm.ps_time(1e8, 4, s, link) for s in (1, 4)]


# --------------------------------------------------------------------------- parameter server


def test_ps_formula():
    a, b, g = LINK.alpha, LINK.beta, LINK.gamma
    n, w, s = 1e6, 6, 4
    expected = 2 * max(w * (a + n / s * b), s * a + n * b) + g * w * n / s
    assert cm.ps_time(n, w, s, LINK) == pytest.approx(expected, rel=1e-15)
    assert cm.ps_time(n, 1, 1, Link(a, b)) == pytest.approx(2 * (a + n * b))


def test_one_server_is_w_times_worse_than_w_shards_for_large_models():
    link = Link(alpha=10e-6, beta=1e-9)
    n = 1e10
    for w in (2, 4, 16):
        ratio = cm.ps_time(n, w, 1, link) / cm.ps_time(n, w, w, link)
        assert ratio == pytest.approx(w, rel=1e-4)
        # fully sharded, the PS moves 2 n per link: what ring All-Reduce approaches
        ring = cm.all_reduce_time("ring", w, n, link)
        assert cm.ps_time(n, w, w, link) == pytest.approx(ring * w / (w - 1), rel=1e-4)


def test_ps_monotonic():
    link = Link(alpha=10e-6, beta=1e-9, gamma=1e-10)
    sizes = [0, 1e3, 1e5, 1e7, 1e9]
    for w in (1, 3, 8):
        for s in (1, 2, 8):
            times = [cm.ps_time(n, w, s, link) for n in sizes]
            assert times == sorted(times)
    for s in (1, 2, 8):
        times = [cm.ps_time(1e6, w, s, link) for w in range(1, 20)]
        assert times == sorted(times)
    # bandwidth-bound: more shards help, up to one per worker
    big = [cm.ps_time(1e9, 8, s, link) for s in range(1, 9)]
    assert big == sorted(big, reverse=True) and big[0] > 7 * big[-1]
    # latency-bound: each worker pays one message per shard, so shards beyond W only cost
    tiny = [cm.ps_time(0, 8, s, link) for s in range(8, 20)]
    assert tiny == sorted(tiny) and tiny[0] == pytest.approx(2 * 8 * link.alpha)


# --------------------------------------------------------------------------- fit


def _records(link, cases):
    return [
        dict(algorithm=a, world_size=p, bytes=n, median_s=cm.all_reduce_time(a, p, n, link))
        if a != "p2p"
        else dict(algorithm=a, world_size=2, bytes=n, median_s=link.send_time(n))
        for a, p, n in cases
    ]


def _assert_same_link(got, want):
    assert got.alpha == pytest.approx(want.alpha, rel=1e-9)
    assert got.beta == pytest.approx(want.beta, rel=1e-9)
    assert got.gamma == pytest.approx(want.gamma, rel=1e-9, abs=1e-30)


SIZES = [2.0**k for k in range(4, 26, 3)]


def test_fit_recovers_the_link_from_one_algorithm():
    want = Link(alpha=37e-6, beta=1 / 2.3e9)
    for algorithm in ALGORITHMS:
        _assert_same_link(cm.fit(_records(want, [(algorithm, 4, n) for n in SIZES])), want)
    _assert_same_link(cm.fit(_records(want, [("p2p", 2, n) for n in SIZES])), want)
    _assert_same_link(
        cm.fit_point_to_point([{"bytes": n, "seconds": want.send_time(n)} for n in SIZES]), want
    )


def test_fit_recovers_the_link_from_mixed_algorithms_and_gamma():
    want = Link(alpha=3e-6, beta=1 / 12.5e9, gamma=1 / 40e9)
    cases = [(a, p, n) for a in ALGORITHMS for p in (1, 2, 3, 5, 8) for n in SIZES]
    cases += [("p2p", 2, n) for n in SIZES]
    got = cm.fit(_records(want, cases), fit_gamma=True)
    _assert_same_link(got, want)
    # without gamma, the reduction's cost is folded into beta (and the fit is no longer exact)
    got = cm.fit(_records(want, cases))
    assert got.gamma == 0 and want.beta < got.beta < want.beta + want.gamma
    # gamma also separates from beta with recursive doubling at non-powers of two alone
    rd = [("recursive_doubling", p, n) for p in (3, 4, 5) for n in SIZES]
    _assert_same_link(cm.fit(_records(want, rd), fit_gamma=True), want)


def test_fit_keeps_alpha_and_beta_non_negative():
    # times that fall with size would give a negative beta; the fit clamps it to 0
    records = [dict(algorithm="p2p", bytes=n, median_s=t) for n, t in [(1e3, 2e-5), (1e6, 1e-5)]]
    link = cm.fit(records)
    assert link.beta == 0 and link.alpha > 0
    # small messages faster than the bandwidth allows would give a negative alpha: clamped to 0
    records = [dict(algorithm="p2p", bytes=n, median_s=t) for n, t in [(1e3, 5e-7), (1e9, 1.0)]]
    link = cm.fit(records)
    assert link.alpha == 0 and 5e-10 < link.beta < 1e-9


def test_fit_rejects_bad_records():
    good = _records(LINK, [("ring", 4, n) for n in SIZES])
    with pytest.raises(ValueError, match="at least 2 records"):
        cm.fit(good[:1])
    with pytest.raises(ValueError, match="at least 2 records"):
        cm.fit(_records(LINK, [("ring", 1, n) for n in SIZES]))  # world size 1 says nothing
    with pytest.raises(ValueError, match="at least 3 records"):
        cm.fit(good[:2], fit_gamma=True)
    with pytest.raises(ValueError, match="cannot tell"):
        cm.fit(_records(LINK, [("ring", 4, 1e6)] * 5))  # one size: alpha and beta collinear
    with pytest.raises(ValueError, match="cannot tell"):
        cm.fit(good, fit_gamma=True)  # ring alone: reduced bytes are always half the bytes
    with pytest.raises(ValueError, match="unknown algorithm"):
        cm.fit([{**good[0], "algorithm": "butterfly"}, *good])
    with pytest.raises(ValueError, match="world_size"):
        cm.fit([{k: v for k, v in good[0].items() if k != "world_size"}, *good])
    with pytest.raises(ValueError, match="median_s"):
        cm.fit([{k: v for k, v in good[0].items() if k != "median_s"}, *good])
    with pytest.raises(ValueError, match="0 s"):
        cm.fit([{**good[0], "median_s": 0.0}, *good])
    with pytest.raises(ValueError, match=">= 0"):
        cm.fit([{**good[0], "median_s": -1e-3}, *good])
    with pytest.raises(ValueError, match="nbytes"):
        cm.fit([{**good[0], "bytes": -1}, *good])


# --------------------------------------------------------------------------- bad arguments


def test_bad_arguments():
    for bad_p in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="world_size"):
            cm.all_reduce_time("ring", bad_p, N, LINK)
    for bad_n in (-1, math.inf, math.nan, "8"):
        with pytest.raises(ValueError, match="nbytes"):
            cm.all_reduce_time("ring", 4, bad_n, LINK)
        with pytest.raises(ValueError, match="nbytes"):
            cm.ps_time(bad_n, 4, 2, LINK)
    for bad_algorithm in ("rings", "p2p", None):
        with pytest.raises(ValueError, match="unknown algorithm"):
            cm.all_reduce_time(bad_algorithm, 4, N, LINK)
    with pytest.raises(ValueError, match="unknown algorithm"):
        cm.terms("butterfly", 4, N)
    with pytest.raises(ValueError, match="workers"):
        cm.ps_time(N, 0, 1, LINK)
    with pytest.raises(ValueError, match="servers"):
        cm.ps_time(N, 4, 0, LINK)
    with pytest.raises(ValueError, match="Link"):
        cm.all_reduce_time("ring", 4, N, (1e-6, 1e-9))
    with pytest.raises(ValueError, match="alpha"):
        Link(-1e-6, 1e-9)
    with pytest.raises(ValueError, match="beta"):
        Link(1e-6, math.nan)
    with pytest.raises(ValueError, match="gbit_per_s"):
        Link.from_bandwidth(1e-6, 0)
    with pytest.raises(ValueError, match="size"):
        cm.ping_pong([0])  # checked before it touches a process group
    with pytest.raises(ValueError, match="world_size >= 2"):
        cm.ping_pong([1024])  # outside a process group: a world of one


# --------------------------------------------------------------------------- a real link


@pytest.mark.timeout(60)
def test_measured_point_to_point_link_is_physical():
    """Real ranks over gloo: a loose sanity check of the measurement, not a timing assertion."""
    sizes = [1 << 10, 1 << 16, 1 << 22, 1 << 25]  # 1 KiB, 64 KiB, 4 MiB, 32 MiB
    records, others = run(cm.ping_pong, 2, sizes, repeats=8)
    assert others == []  # rank 0 reports
    assert [r["bytes"] for r in records] == sizes
    times = [r["seconds"] for r in records]
    assert all(t > 0 for t in times)
    assert all(r["round_trip_s"] == pytest.approx(2 * r["seconds"]) for r in records)
    fastest = [r["fastest_round_trip_s"] for r in records]
    assert all(f > 0 for f in fastest)
    # Order by size on the fastest round trips: scheduling noise only lengthens a round trip, so
    # it can swap medians on a busy machine (CI saw a 1 KiB median of 3.6 ms above 4 MiB's 3.4)
    # but not floors that are 4,000x apart in bytes.
    assert fastest[-1] > max(fastest[:-1]) and fastest[2] > fastest[0]
    link = cm.fit_point_to_point(records)
    # alpha may fit to 0 when a loaded machine's scheduling noise swamps small messages
    assert link.alpha >= 0 and link.beta > 0
    assert 0.05 < link.bandwidth_GBps < 50, link
    assert cm.fit(records) == link  # the records are ready for fit() as they are
