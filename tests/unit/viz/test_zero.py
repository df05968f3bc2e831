"""Chapter 9b's flat-buffer picture draws one box per element and one shard per rank."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from dmlbook.viz import zero as viz_zero  # noqa: E402


def test_flat_buffer_draws_every_element_the_padding_and_each_rank_s_shard():
    ax = viz_zero.draw_flat_buffer({"weight": 6, "bias": 2}, world_size=3)
    texts = [t.get_text() for t in ax.texts]
    assert [str(i) for i in range(9)] == [t for t in texts if t.isdigit()]
    assert "padding (1)" in texts
    assert [t for t in texts if t.startswith("rank")] == [
        "rank 0: [0, 3)",
        "rank 1: [3, 6)",
        "rank 2: [6, 9)",
    ]
    plt.close("all")
