"""One rank's snapshot as a typed record: its tensors and a versioned header.

Every part that makes, moves, stores or loads a snapshot passes a `Snapshot` (header
first, then tensors, in that order everywhere) or reads a `SnapshotHeader`; the header is
encoded to and decoded from JSON here and nowhere else (the slot file, `slots.py`, puts
those bytes at its fixed offset; a replica, a persisted record and a DCP base carry the
slot's bytes unchanged).

The rank that snapshots fills in who it is and what its state means (`rank`,
`world_size`, `numel`, `opt`: its layout's own description of its shard, `tracked`,
`python_random`); the snapshot thread adds the generation, and the slot writer adds the
step, where each tensor lies (`entries`), the data's size and their checksum.

Decoding is strict: a header that lacks a field, or whose field has the wrong type, is an
`IntegrityError` naming the field (a damaged or foreign file is never half-loaded), and a
header of a newer version than this phoenixft reads names the upgrade. Headers written
before the version field existed are version 1: they hold the same fields.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from phoenixft.checkpoint.integrity import IntegrityError

VERSION = 1  # bump when a field changes meaning; from_json refuses newer ones


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a slot's data region."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


# field -> the JSON types it may hold (checked on decode)
_TYPES: dict[str, tuple[type, ...]] = {
    "rank": (int,), "world_size": (int,), "numel": (int,), "generation": (int,),
    "step": (int,), "data_nbytes": (int,), "checksum": (str,), "opt": (dict,),
    "tracked": (dict,), "python_random": (list, type(None)), "entries": (list,),
}


@dataclass(frozen=True)
class SnapshotHeader:
    """What a snapshot's tensors are: whose (rank of world_size, generation), of which
    step, what the layout says of its shard (`opt`), the tracked objects' and Python
    RNG's state, and where each tensor lies with the data's checksum."""

    rank: int = 0
    world_size: int = 1
    numel: int = 0  # parameters of the whole model (a restore checks it matches)
    opt: dict[str, Any] = field(default_factory=dict)  # the layout's `unique_meta()`
    tracked: dict[str, Any] = field(default_factory=dict)
    python_random: list | None = None  # random.getstate(), JSON-shaped
    generation: int = -1  # set by the snapshot thread
    step: int = -1  # the rest is set by the slot writer
    entries: tuple[Entry, ...] = ()
    data_nbytes: int = 0
    checksum: str = ""
    version: int = VERSION

    def with_(self, **changes) -> SnapshotHeader:
        """A copy with some fields changed (the header is frozen: it is shared by views)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        d["entries"] = [dataclasses.asdict(e) for e in self.entries]
        return json.dumps(d).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: object) -> SnapshotHeader:
        try:
            d = json.loads(raw)
        except ValueError as exc:
            raise IntegrityError(f"{where}: unreadable header ({exc})") from None
        if not isinstance(d, dict):
            raise IntegrityError(f"{where}: the header is not a JSON object")
        version = d.pop("version", 1)  # (headers from before the field: version 1)
        if not isinstance(version, int) or version > VERSION:
            raise IntegrityError(f"{where}: snapshot header version {version!r}, this phoenixft "
                                 f"reads up to {VERSION}: upgrade phoenixft to read it")
        for name, types in _TYPES.items():
            if name not in d:
                raise IntegrityError(f"{where}: the header has no {name!r} (damaged, or not "
                                     "a phoenixft snapshot)")
            if not isinstance(d[name], types) or isinstance(d[name], bool):
                raise IntegrityError(f"{where}: the header's {name!r} is "
                                     f"{type(d[name]).__name__}, not {types[0].__name__}")
        try:
            entries = tuple(Entry(**e) for e in d.pop("entries"))
        except TypeError as exc:
            raise IntegrityError(f"{where}: a header entry is malformed ({exc})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}, entries=entries,
                   version=version)

    def dcp_placement(self) -> dict | None:
        """Where each of a sharded model's tensors lies in the whole one (DCP's sharding
        info, `Fsdp2Layout.unique_meta`), or None for a layout that has none."""
        return self.opt.get("dcp")


@dataclass
class Snapshot:
    """One rank's snapshot: its header, then its tensors (views or copies, as the
    function that returns it says)."""

    header: SnapshotHeader
    tensors: dict[str, torch.Tensor]
