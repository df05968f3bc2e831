"""Chapter 13's checkpoints across layouts: the composed model and its ZeRO-1 AdamW state saved
through torch.distributed.checkpoint at one layout, loaded at another (dp2 x tp2 -> tp4,
pp2 x dp2 -> dp4, and each back to one process), and training continues equal to the
one-process run that never stopped (every parameter of every rank, float64 to 1e-10, as
test_composed). Keys are the unmodified model's names; each loading rank's record of its reads
names the saved slices and the saving ranks' files (a slice straddling two saved ones, ZeRO-1's
optimizer state changing owner); a checkpoint of another model raises the same ValueError,
naming the key and both shapes, on every rank, with no hang. World 4, a tiny model: seven
world-4 launches in all."""

from __future__ import annotations

import functools

import pytest
import torch

from dmlbook.advanced.composition.checkpoint import (
    SavedSlice,
    load_and_train,
    load_composed,
    saved_slices,
    train_and_save,
)
from dmlbook.advanced.composition.compose import compose
from dmlbook.advanced.composition.layout import Layout, ProcessGroups
from dmlbook.advanced.composition.placements import pieces
from dmlbook.advanced.expert_parallel.moe import moe_char_gpt
from dmlbook.data_parallel.loop import train_reference
from dmlbook.launch import run
from dmlbook.models import char_gpt

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ, BATCH, MICRO = 16, 16, 8, 2
MODEL = dict(n_layer=2, n_head=4, n_embd=16, block_size=16)
BEFORE, AFTER = 2, 2  # steps before the checkpoint, steps after it
TOL = 1e-10  # float64: the sums run in other orders on other ranks, nothing else differs


def make_dense():
    return char_gpt(VOCAB, seed=0, **MODEL).double()


def make_moe():
    return moe_char_gpt(VOCAB, 0, n_experts=4, top_k=2, capacity_factor=None, **MODEL).double()


def make_wider():
    return char_gpt(VOCAB, seed=0, **{**MODEL, "n_embd": 32}).double()


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
         torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(BEFORE + AFTER)
    ]  # fmt: skip


@functools.cache
def reference_state(make=make_dense):
    """The one-process run that never stopped: AdamW on every whole batch."""
    return train_reference(make, batches(), optimizer=torch.optim.AdamW).model.state_dict()


def _move(make, before: Layout, after: Layout, directory: str):
    """Rank function: train at ``before``, save, then (same processes, new groups) a fresh model
    at ``after`` loads and trains on: the run's two halves, as a job resumed elsewhere."""
    cache: dict = {}
    train_and_save(make, batches()[:BEFORE], before, directory, MICRO, group_cache=cache)
    return load_and_train(make, batches()[BEFORE:], after, directory, MICRO,
                          reference_state=reference_state(make), group_cache=cache)  # fmt: skip


MOVES = {
    "dp2 x tp2 -> tp4": (Layout(dp=2, tp=2), Layout(tp=4), make_dense),
    "pp2 x dp2 -> dp4": (Layout(pp=2, dp=2), Layout(dp=4), make_dense),
    # MoE: the experts move from 2 EP ranks to 4, through CP's wrapped attention and positions
    "dp2 x tp2, ep2 -> dp2 x cp2, ep4 (MoE)": (
        Layout(dp=2, tp=2, ep=2),
        Layout(dp=2, cp=2, ep=4),
        make_moe,
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MOVES))
def test_a_checkpoint_moves_between_layouts_and_training_continues_equal(name, tmp_path):
    before, after, make = MOVES[name]
    results = run(_move, 4, make, before, after, str(tmp_path / "ckpt"), timeout=120)
    for r in results:
        assert r.max_diff < TOL, (r.rank, r.coords, r.max_diff)
    # Each rank read its own slices, under the unmodified model's names.
    names = dict(make().named_parameters()).keys()
    assert all(r.slices.keys() <= names for r in results)
    assert {n for r in results for n in r.slices} == names  # together: every tensor
    if after.tp == 4:  # rank r: rows r/4 of a column-split weight; its heads of q, k and v
        for r in results:
            assert r.slices["blocks.0.mlp.c_fc.weight"] == ((16 * r.coords["tp"], 0), (16, 16))
            assert r.slices["blocks.0.attn.c_attn.weight"] == ((0, 4 * r.coords["tp"], 0),
                                                               (3, 4, 16))  # fmt: skip
            # the model: rank r's 16 rows from the tp2 block holding them (tp rank r // 2)
            read = [x for x in r.reads if x.key == "model.blocks.0.mlp.c_fc.weight"]
            assert [(x.saved, x.writer % 2) for x in read] == [((32 * (r.rank // 2), 0),
                                                                r.rank // 2)]  # fmt: skip
        # ZeRO-1 changes owners: at dp2 x tp2 one dp coordinate (ranks 0, 1 or ranks 2, 3)
        # owned and saved each parameter's moments; at tp4 (no dp) all four ranks read them.
        key = "optimizer.state.blocks.0.mlp.c_fc.weight.exp_avg"
        writers = {c.writer for c in saved_slices(tmp_path / "ckpt", key)}
        assert writers in ({0, 1}, {2, 3})
        readers = {r.rank: {x.writer for x in r.reads if x.key == key} for r in results}
        # every rank reads one saved block of them: two ranks that never held them now own them
        assert sorted(readers) == [0, 1, 2, 3]
        assert all(len(w) == 1 and w <= writers for w in readers.values()), readers
    if after.ep == 4:  # expert r on rank r, under its global number
        for r in results:
            assert f"blocks.1.mlp.experts.{r.rank}.c_fc.weight" in r.slices
    # The checkpoint holds each slice once, at its global offset: tp2's two blocks of rows.
    if before.tp == 2:
        chunks = saved_slices(tmp_path / "ckpt", "model.blocks.0.attn.c_proj.weight")
        assert [c[:2] for c in chunks] == [((0, 0), (16, 8)), ((0, 8), (16, 8))]
        assert [c.writer % 2 for c in chunks] == [0, 1]  # by a rank of tp 0, of tp 1 (rank % 2)
    # Nothing but the checkpoint at the final path (the temporary folder was renamed).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (tmp_path / "ckpt" / ".metadata").is_file()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MOVES)[:2])
def test_a_checkpoint_of_any_layout_loads_in_one_process(name, tmp_path):
    """Saved at four ranks, loaded by one process with no process group (Layout()): training
    continues equal to the run that never stopped."""
    before, _, _ = MOVES[name]
    directory = str(tmp_path / "ckpt")
    run(train_and_save, 4, make_dense, batches()[:BEFORE], before, directory, MICRO, timeout=120)
    result = load_and_train(make_dense, batches()[BEFORE:], Layout(), directory, MICRO,
                            reference_state=reference_state())  # fmt: skip
    assert result.max_diff < TOL
    assert set(result.slices) == set(dict(make_dense().named_parameters()))
    # One process holds every tensor whole: it reads each saved slice, from each saver's file.
    key = "model.blocks.0.mlp.c_fc.weight"
    saved = saved_slices(directory, key)
    read = [(x.saved, x.writer) for x in result.reads if x.key == key]
    assert sorted(read) == sorted((c.offsets, c.writer) for c in saved)
    if before.tp == 2:  # straddles: rows 0-31 from one rank's file, rows 32-63 from another's
        assert len(read) == 2 and len({w for _, w in read}) == 2, read


def test_the_keys_are_the_unmodified_models_names_in_one_process():
    """With no parallelism every piece is a parameter of the unmodified model, whole, under its
    own name; only the fused q|k|v is viewed with its 3 parts first."""
    composed = compose(make_dense(), ProcessGroups(Layout()), None, torch.optim.AdamW)
    held = {p.name: p for p in pieces(composed)}
    plain = dict(make_dense().named_parameters())
    assert held.keys() == plain.keys()
    assert all(p.dim is None for p in held.values())
    assert held["blocks.0.attn.c_attn.weight"].stored().shape == (3, 16, 16)
    assert (
        held["blocks.0.mlp.c_fc.weight"].stored().shape == plain["blocks.0.mlp.c_fc.weight"].shape
    )


# --------------------------------------------------------------------------- bad input, no hang


def _load_into(make, layout: Layout, directory: str) -> str:
    """Rank function: a model composed at ``layout`` loads ``directory``; the error's text."""
    try:
        load_and_train(make, batches()[BEFORE:], layout, directory, MICRO)
    except ValueError as error:
        return str(error)
    return "loaded"


@pytest.mark.timeout(180)
def test_a_checkpoint_of_another_model_raises_on_every_rank_naming_key_and_shapes(tmp_path):
    directory = str(tmp_path / "ckpt")
    run(train_and_save, 4, make_dense, batches()[:BEFORE], Layout(dp=2, tp=2), directory, MICRO,
        timeout=120)  # fmt: skip
    messages = run(_load_into, 4, make_wider, Layout(tp=4), directory, timeout=120)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert "does not fit this model" in messages[0]
    assert "model.wte.weight: saved (16, 16), this model (16, 32)" in messages[0]  # first
    assert (
        "model.blocks.0.attn.c_attn.weight: saved (3, 16, 16), this model (3, 32, 32)"
        in (messages[0])
    )
    with pytest.raises(ValueError, match=r"model.wte.weight: saved \(16, 16\), this model"):
        composed = compose(make_wider(), ProcessGroups(Layout()), None, torch.optim.AdamW)
        load_composed(composed, directory)  # one process: the same check


def test_a_missing_checkpoint_is_named(tmp_path):
    composed = compose(make_dense(), ProcessGroups(Layout()), None, torch.optim.AdamW)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_composed(composed, tmp_path / "never")


def test_the_picture_names_each_reading_rank_and_the_saved_slices_it_overlaps():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dmlbook.viz.layouts import checkpoint_reads

    saved = [((0, 0), (32, 16)), ((32, 0), (32, 16))]  # tp2: two blocks of rows
    reads = {r: ((16 * r, 0), (16, 16)) for r in range(4)}  # tp4: four
    ax = checkpoint_reads((64, 16), saved, reads, "c_fc.weight")
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("saved 0") == 1 and texts.count("saved 1") == 1
    assert "rank 1\nreads 0" in texts and "rank 2\nreads 1" in texts
    ax = checkpoint_reads((64, 16), saved, {0: ((16, 0), (32, 16))})  # across the boundary
    assert "rank 0\nreads 0, 1" in [t.get_text() for t in ax.texts]
    # Chunks that name their writer: named by it; copies reading the same slice share one box.
    chunks = [SavedSlice((0, 0), (32, 16), 2), SavedSlice((32, 0), (32, 16), 1)]
    ax = checkpoint_reads((64, 16), chunks, {0: ((0, 0), (64, 16)), 1: ((0, 0), (64, 16))})
    texts = [t.get_text() for t in ax.texts]
    assert "saved by\nrank 2" in texts and "saved by\nrank 1" in texts
    assert "ranks 0, 1\nreads saved by 2, 1" in texts
    plt.close("all")
