"""The rank grid: one validated value with named axes, from which every process group, chapter
9's DP x TP mesh and the planner's dimensions are read (chapters 9 and 13).

Composing parallelisms starts with one question: which ranks talk to which? :class:`Layout` is
the answer as a validated value, in the manner of torchtitan's ``ParallelDims``: the degrees
``dp``, ``tp``, ``pp``, ``cp`` and ``ep``, checked once, with errors that name the dimension.
Chapter 9's DP x TP mesh is its two-dimensional case, ``Layout(dp=2, tp=2)``. The axes are
named once, in :class:`Axis`; every table, group and plan reads them from there.

The ranks form a grid of shape ``(pp, dp, cp, tp)`` (:data:`GRID_AXES`), the last axis fastest:
tensor-parallel groups are neighbouring ranks, the GPUs of one machine on a real cluster, because
TP talks in every layer; pipeline stages are the farthest apart, because they exchange only one
activation per micro-batch.

Expert parallelism does not add a dimension: it **borrows** the ``dp x cp`` ranks, which all hold
the same dense weights (torchtitan does the same). Number those ranks ``i = dp_index * cp +
cp_index``; the EP groups are ``ep`` consecutive ``i``, and the ranks with the same place in their
EP group hold the same experts and average their gradients: the *expert data-parallel* group
``edp``. So ``ep`` must divide ``dp * cp``.

``zigzag`` is not a degree: it says how context parallelism cuts the sequence (2 cp chunks, rank
r holding chunks r and 2 cp - 1 - r, when True; cp contiguous blocks when False). The layout
carries it so that every step that cuts the sequence (the batch, the position embedding, the
attention) reads it from one place.

Every group a training step needs, one per :class:`Axis`:

====== ============================================== =======================================
group  ranks that differ only in                       used for
====== ============================================== =======================================
pp     the PP coordinate                               activations and gradients between stages
dp     the DP coordinate                               chapter 9's gradients (13: batch rows)
cp     the CP coordinate                               ring attention
tp     the TP coordinate                               Megatron TP + SP collectives
dp_cp  DP and CP (same ``pp``, ``tp``)                 dense gradients, ZeRO-1 shards
ep     the EP place inside ``dp_cp``                    all-to-all dispatch and combine
edp    the EP group inside ``dp_cp``                    expert gradients, their ZeRO-1 shards
====== ============================================== =======================================

:meth:`Layout.group_ranks` is the pure table (testable without processes; chapter 9 shows its
grid part, :meth:`Layout.grid_groups`);
:class:`ProcessGroups` creates the groups this rank belongs to. Each is created with
``use_local_synchronization=True``, so only its members call ``dist.new_group``; every rank
walks the axes in the same order, so two ranks of a group always reach it, and a rank list
that two axes share (``dp_cp`` equals ``dp`` when ``cp == 1``) is one group, made once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

__all__ = ["DEGREE_AXES", "GRID_AXES", "Axis", "Layout", "ProcessGroups"]


class Axis(str, Enum):
    """The named axes of the rank grid and the groups built from them: each name is spelled here
    and nowhere else. An axis is its name (``Axis.tp == "tp"``), so tables keyed by axes read and
    print as plain names."""

    pp = "pp"  # pipeline stages (slowest: one activation per micro-batch crosses it)
    dp = "dp"  # data parallel: batch rows
    cp = "cp"  # context parallel: the sequence
    tp = "tp"  # tensor parallel (+ sequence parallel): fastest, neighbouring ranks
    dp_cp = "dp_cp"  # dp and cp together: the ranks that hold the same dense weights
    ep = "ep"  # expert parallel: ep consecutive ranks of dp_cp
    edp = "edp"  # expert data parallel: the ranks of dp_cp that hold the same experts

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)


GRID_AXES = (Axis.pp, Axis.dp, Axis.cp, Axis.tp)  # the rank grid's shape, slowest to fastest
DEGREE_AXES = (Axis.dp, Axis.tp, Axis.pp, Axis.cp, Axis.ep)  # Layout's degrees, in its order


@dataclass(frozen=True)
class Layout:
    """How many ways each dimension splits the work; their product (without ``ep``, which
    borrows the ``dp x cp`` ranks) is the world size."""

    dp: int = 1  # data parallel: batch rows (ZeRO-1: optimizer state sharded over dp x cp)
    tp: int = 1  # tensor parallel (+ sequence parallel between the TP regions)
    pp: int = 1  # pipeline stages (1F1B)
    cp: int = 1  # context parallel: the sequence (ring attention, zigzag chunks)
    ep: int = 1  # expert parallel: the experts, over ep of the dp x cp ranks
    zigzag: bool = True  # context parallel: 2 cp chunks, one from each end (False: cp blocks)

    def __post_init__(self) -> None:
        for name in DEGREE_AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.zigzag, bool):
            raise ValueError(f"Layout.zigzag must be True or False, got {self.zigzag!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp x cp = {self.dp} x {self.cp} = {self.dp * self.cp}: "
                "expert parallelism borrows the data- and context-parallel ranks"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The rank grid ``(pp, dp, cp, tp)``."""
        return self.pp, self.dp, self.cp, self.tp

    def __str__(self) -> str:
        return " x ".join(f"{n}{getattr(self, n)}" for n in DEGREE_AXES)  # the degrees only

    def validate_world(self, world_size: int) -> None:
        """A ValueError unless the degrees multiply to ``world_size``."""
        if self.world_size != world_size:
            raise ValueError(
                f"layout {self} needs pp x dp x cp x tp = {self.pp} x {self.dp} x {self.cp} x "
                f"{self.tp} = {self.world_size} ranks, but the world has {world_size}"
            )

    def validate_model(
        self,
        config,
        seq_len: int,
        batch: int,
        microbatches: int = 1,
        n_experts: int = 0,
    ) -> None:
        """A ValueError naming the dimension when the model or the batch does not split by this
        layout: heads, vocabulary and MLP width by ``tp``, the sequence by ``tp`` and ``cp`` (by
        ``2 cp`` for :attr:`zigzag` chunks), the experts by ``ep``, the layers by ``pp``, the
        batch by ``dp`` and the micro-batches. ``config``: the char-GPT's
        :class:`~dmlbook.models.GPTConfig`."""
        problems = []

        def need(ok: bool, what: str) -> None:
            if not ok:
                problems.append(what)

        t, c, zigzag = self.tp, self.cp, self.zigzag
        need(config.n_head % t == 0, f"tp: n_head={config.n_head} is not divisible by tp={t}")
        need(config.vocab_size % t == 0, f"tp: vocab_size={config.vocab_size} is not divisible "
             f"by tp={t} (pad it with tensor_parallel.padded_vocab_size)")  # fmt: skip
        chunks = 2 * c if zigzag else c
        need(
            seq_len % chunks == 0,
            f"cp: sequence length={seq_len} is not divisible by "
            f"{'2 x ' if zigzag else ''}cp={chunks} (the {'zigzag ' if zigzag else ''}chunks)",
        )
        need(seq_len % (c * t) == 0 and (seq_len // c) % t == 0, f"tp: each context-parallel "
             f"rank's sequence length={seq_len}/{c} is not divisible by tp={t} (sequence "
             "parallelism splits it)")  # fmt: skip
        need(seq_len <= config.block_size, f"cp: sequence length={seq_len} exceeds "
             f"block_size={config.block_size}")  # fmt: skip
        need(config.n_layer + 2 >= self.pp, f"pp: {config.n_layer} blocks + embedding + head "
             f"= {config.n_layer + 2} layers cannot fill pp={self.pp} stages")  # fmt: skip
        if n_experts:
            need(n_experts % self.ep == 0, f"ep: n_experts={n_experts} is not divisible by "
                 f"ep={self.ep}")  # fmt: skip
        elif self.ep > 1:
            problems.append(f"ep: ep={self.ep} needs a mixture-of-experts model (n_experts > 0)")
        need(batch % self.dp == 0, f"dp: batch={batch} is not divisible by dp={self.dp}")
        need(
            batch % (self.dp * microbatches) == 0,
            f"pp: each data-parallel rank's batch "
            f"{batch}/{self.dp} is not divisible into microbatches={microbatches}",
        )
        if config.dropout:
            problems.append(f"tp/cp: dropout={config.dropout}; composed training needs 0.0")
        if problems:
            raise ValueError(f"layout {self} does not fit: " + "; ".join(problems))

    # ----------------------------------------------------------------------- ranks and places

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """Where ``rank`` sits: its coordinate on each axis of :data:`GRID_AXES`, then ``ep`` (its
        place in its EP group, which decides its experts) and ``edp`` (which EP group of
        ``dp_cp`` it is in)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not a rank of layout {self} ({self.world_size})")
        place = torch.unravel_index(torch.tensor(rank), self.shape)  # row-major, tp fastest
        coords = {axis: int(i) for axis, i in zip(GRID_AXES, place, strict=True)}
        i = coords[Axis.dp] * self.cp + coords[Axis.cp]  # place among the dp x cp ranks
        edp, ep = divmod(i, self.ep)
        return {**coords, Axis.ep: ep, Axis.edp: edp}

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at a place of the grid (row-major, ``tp`` fastest)."""
        rank = 0
        for axis, value, size in zip(GRID_AXES, (pp, dp, cp, tp), self.shape, strict=True):
            if not 0 <= value < size:
                raise ValueError(f"{axis}={value} is outside 0..{size - 1} in layout {self}")
            rank = rank * size + value
        return rank

    def grid_groups(self) -> dict[Axis, list[list[int]]]:
        """For each axis of the grid (:data:`GRID_AXES`), every group's global ranks in
        group-rank order: the ranks whose coordinates differ only along that axis (a rank's
        index in its group is its coordinate there). ``Layout(dp=2, tp=2).grid_groups()["tp"]``
        is ``[[0, 1], [2, 3]]``: rank ``r`` sits at ``(r // 2, r % 2)``."""
        grid = torch.arange(self.world_size).reshape(self.shape)  # rank r at its place, tp fastest
        return {  # the axis moved last: each row along it is one group
            axis: grid.movedim(d, -1).flatten(0, -2).tolist() for d, axis in enumerate(GRID_AXES)
        }

    def group_ranks(self) -> dict[Axis, list[list[int]]]:
        """For every :class:`Axis`, every group's global ranks, in group-rank order: the grid's
        axes (:meth:`grid_groups`), then ``dp_cp`` (same ``pp`` and ``tp``), and ``ep`` and
        ``edp``, which cut each ``dp_cp`` group into EP groups of ``ep`` consecutive ranks."""
        pp, dp, cp, tp = self.shape
        by_ep = torch.arange(self.world_size).reshape(pp, dp * cp // self.ep, self.ep, tp)
        return {
            **self.grid_groups(),
            Axis.dp_cp: by_ep.flatten(1, 2).movedim(1, -1).flatten(0, -2).tolist(),
            Axis.ep: by_ep.movedim(2, -1).flatten(0, -2).tolist(),
            Axis.edp: by_ep.movedim(1, -1).flatten(0, -2).tolist(),
        }

    def groups_of(self, rank: int) -> dict[Axis, list[int]]:
        """The ranks of each of ``rank``'s groups."""
        return {a: next(g for g in gs if rank in g) for a, gs in self.group_ranks().items()}


class ProcessGroups:
    """This rank's process group along every :class:`Axis` of ``layout``.

    ``groups.tp`` is the TP group (a real group even of size 1, never ``None``, which torch
    reads as the whole world); ``groups.coords`` the rank's place; ``groups.ranks["tp"]`` the
    global ranks of its TP group. Call it on every rank. One process (no process group) gets
    ``None`` groups and the layout must be all ones.

    torch names a locally synchronised group after its ranks, so a rank list can be made only
    once per process: to build the groups of several layouts in one process, pass the same
    ``cache`` dict (rank tuple -> group) to each."""

    def __init__(self, layout: Layout, cache: dict | None = None) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        layout.validate_world(world)
        self.layout, self.rank = layout, rank
        self.coords = layout.coordinates(rank)
        self.ranks = layout.groups_of(rank)
        made: dict[tuple[int, ...], object] = {} if cache is None else cache
        for axis in Axis:  # the same order on every rank
            key = tuple(self.ranks[axis])
            if key not in made:
                made[key] = (
                    dist.new_group(list(key), use_local_synchronization=True)
                    if (world > 1)
                    else None
                )
            setattr(self, axis.value, made[key])

    def size(self, axis: str) -> int:
        """How many ranks this rank's group along ``axis`` has (a ValueError naming an axis
        that is not one)."""
        if axis not in set(Axis):
            raise ValueError(f"no axis {axis!r}; the axes are {[a.value for a in Axis]}")
        return len(self.ranks[axis])

    def __repr__(self) -> str:
        return f"ProcessGroups({self.layout}; rank {self.rank} at {self.coords})"
