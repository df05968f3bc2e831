"""Tests for dmlbook.viz.sharding (chapters 9 and 9b): each picture draws from its data: the
block's f and g solid where they all-reduce (g forward, f backward), attention's rows coloured by
the rank that holds them, the vocabulary's blocks, and ZeRO's step tables."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dmlbook import viz  # noqa: E402
from dmlbook.viz import sharding  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_tp_block_draws_forward_and_backward():
    ax = viz.tp_block()
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("all-reduce") == 4 and texts.count("identity") == 4  # 2 halves x 2 lanes
    circles = [p for p in ax.patches if isinstance(p, plt.Circle)]
    solid = [c for c in circles if c.get_alpha() == 1.0]
    assert len(circles) == 8 and len(solid) == 4
    assert any(t.startswith("backward") for t in texts)


def test_attention_heads_colours_each_rank_rows():
    rows = [
        torch.cat([torch.arange(0, 16), torch.arange(32, 48), torch.arange(64, 80)]),
        torch.cat([torch.arange(16, 32), torch.arange(48, 64), torch.arange(80, 96)]),
    ]
    ax = viz.attention_heads(rows, [(0, 16), (16, 32)], n_embd=32, n_head=4)
    cells = [p for p in ax.patches if isinstance(p, plt.Rectangle) and p.get_width() == 1]
    assert len(cells) == 96 + 32
    colours = plt.get_cmap("tab10")
    attn = sorted((p for p in cells if p.get_y() > 1), key=lambda p: p.get_x())
    owners = [0 if p.get_facecolor()[:3] == colours(0)[:3] else 1 for p in attn]
    assert owners == [int(i >= 16) for part in range(3) for i in range(32)]


def test_vocab_split_draws_each_rank_block():
    left, right = viz.vocab_split([(0, 52), (52, 104)], 104)
    assert [(p.get_y(), p.get_height()) for p in left.patches] == [(0, 52), (52, 52)]
    assert [(p.get_x(), p.get_width()) for p in right.patches] == [(0, 52), (52, 52)]


def test_zero_step_ops_communicate_where_each_stage_does():
    kinds = {stage: [k for _, k in sharding.zero_step_ops(stage, 2)] for stage in range(4)}
    assert "AR" in kinds[0] and "AG" not in kinds[0]
    assert kinds[2].count("RS") == 2 and kinds[3].count("AG") == 4
    with pytest.raises(ValueError):
        sharding.zero_step_ops(4)
