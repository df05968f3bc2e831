"""Ranks that live across notebook cells (chapters 2 and 9): :class:`Ranks`, which
:mod:`dmlbook.runtime.session` defines; kept at this name so that ``dmlbook.ranks`` imports keep
working. ``dmlbook.launch.Ranks`` is the same class; ``%load_ext dmlbook`` puts it behind
``%ranks`` and ``%%ranks``."""

from dmlbook.runtime.errors import RanksClosedError
from dmlbook.runtime.session import Ranks, RankStatus

__all__ = ["Ranks", "RankStatus", "RanksClosedError"]
