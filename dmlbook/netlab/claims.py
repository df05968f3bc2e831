"""Which run owns which lab: one record per lab, so that runs at once never break each other's.

Every lab has a name of its own, ``<prefix>-<8 hex digits>`` (chapter 13's ``ch13-3fa9c2d1``),
so two runs of a chapter at the same moment (a learner's and nbgrader's autograde, on one server)
make two labs. Before it creates a namespace, :meth:`Lab.up <dmlbook.netlab.lab.Lab.up>` writes
the lab's record, ``<folder>/<name>.json``: its prefix, hosts, namespaces and owner (the process,
as :class:`dmlbook.runtime.owners.Owner`: pid, start time, host). :func:`folder` is
``/run/dmlbook-netlab``, root's like the lab itself and emptied at boot like ``/run/netns``
(``$DMLBOOK_NETLAB_RECORDS`` moves it). A lab whose owner is dead is a crash's leftover, which
the next lab removes; a live owner's lab is never touched, whatever its name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dmlbook.runtime.owners import Owner

__all__ = ["Record", "claim", "folder", "records", "release"]

_TEMPORARY = re.compile(r"\..+\.(\d+-\d+@[A-Za-z0-9._-]+)\.tmp")


def folder() -> Path:
    """Where the records are: ``$DMLBOOK_NETLAB_RECORDS``, else ``/run/dmlbook-netlab``."""
    return Path(os.environ.get("DMLBOOK_NETLAB_RECORDS") or "/run/dmlbook-netlab")


@dataclass(frozen=True)
class Record:
    """One lab: its unique name, the prefix it was asked for, its hosts, namespaces and owner."""

    name: str
    prefix: str
    hosts: int
    namespaces: tuple[str, ...]
    owner: Owner

    @property
    def path(self) -> Path:
        return folder() / f"{self.name}.json"


def claim(record: Record) -> None:
    """Write ``record``, all or nothing; FileExistsError if a lab of that name is recorded."""
    folder().mkdir(mode=0o755, parents=True, exist_ok=True)
    data = dict(
        name=record.name,
        prefix=record.prefix,
        hosts=record.hosts,
        namespaces=list(record.namespaces),
        owner=record.owner.as_dict(),
    )
    # Written beside, then hard-linked into place: link() fails if the name exists, so two runs
    # can never both claim one name, and a reader never sees half a record.
    tmp = folder() / f".{record.name}.{Owner.me().token()}.tmp"
    tmp.write_text(json.dumps(data))
    try:
        os.link(tmp, record.path)
    finally:
        tmp.unlink()


def release(record: Record) -> None:
    """Forget ``record`` (after its namespaces are gone)."""
    record.path.unlink(missing_ok=True)


def records() -> list[Record]:
    """Every recorded lab, of any owner, live or dead. Removes half-written records of dead runs."""
    found = []
    if not folder().is_dir():
        return found
    for path in sorted(folder().iterdir()):
        if m := _TEMPORARY.fullmatch(path.name):
            writer = Owner.parse(m[1])
            if writer is not None and writer.is_dead():
                path.unlink(missing_ok=True)
            continue
        if path.suffix != ".json":
            continue
        try:
            data = json.loads(path.read_text())
            found.append(
                Record(
                    data["name"],
                    data["prefix"],
                    int(data["hosts"]),
                    tuple(data["namespaces"]),
                    Owner(**data["owner"]),
                )
            )
        except FileNotFoundError:  # released since we listed the folder
            continue
        except (ValueError, KeyError, TypeError):  # not ours to judge: never removed
            continue
    return found
