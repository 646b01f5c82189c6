"""A sharded model's base record: one rank's snapshot blob as a safetensors file with
torch.distributed.checkpoint's sharding information, that gives the exact blob back.

A sharded model's snapshot (`Fsdp2Layout`) says in its header where each of its tensors
lies in the whole one (`header.dcp_placement()`: global size and offsets, per parameter).
Each rank writes its file as ``r{rank}/s{step:010d}.shards`` (`tiers.py`); each file
carries DCP's sharding info (``DCP_SHARDING_INFO``: the saved offsets of each tensor), in
the names DCP's `HuggingFaceStorageReader` reads:

- a parameter's local shard under its fully qualified name (``layers.0.attn.q.weight``),
- its optimizer state under ``optimizer.state.<fqn>.<key>`` (as `get_optimizer_state_dict`
  names it, flattened the way DCP flattens a nested state dict); a scalar (Adam's
  ``step``) once, from rank 0;
- everything else the blob holds (RNG states, data position, the slot header, the
  alignment padding) under ``phoenixft.rank<r>.*``: DCP ignores names nobody asks for.

No pickle anywhere: safetensors headers are JSON, its data raw. The file's own metadata
(``phoenixft``) names the step, the rank, the blob's size and checksum: `decode` rebuilds
the blob byte for byte (padding included) and the caller verifies that checksum, so a
damaged file is found and named like any other record.

A base is one rank's part of a step, so it is never left where a DCP reader would take
it for a checkpoint: not named ``*.safetensors``, not in a directory of its own. (Before
0.2 the ranks' files of a step shared ``dcp/s{step}/``, which DCP's reader loaded without
complaint while some ranks' files were missing, leaving holes.) A whole step in DCP's
default format is `dcp_export.py`'s. `decode` checks the file's sharding info against
the blob's own placement, so an edited one is named (`ckpt verify`).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.record import SnapshotHeader
from phoenixft.checkpoint.slots import HEADER_BYTES, blob_header

OPT_PREFIX = "optimizer.state."
LOCAL_PREFIX = "phoenixft.rank"


def public_name(entry: str, shape: list[int], rank: int, placement: dict) -> tuple[str, list[int]] | None:
    """The DCP name and saved offsets of a blob entry, or None for rank-local state."""
    if entry.startswith("p."):
        name, key = entry[2:], None
    elif entry.startswith("o."):
        name, _, key = entry[2:].rpartition(".")
    else:
        return None
    where = placement.get(name)
    if where is None:
        return None
    size, offsets = where
    fqn = name if key is None else f"{OPT_PREFIX}{name}.{key}"
    if not shape:  # a scalar every rank holds alike (Adam's step): written once
        return (fqn, []) if rank == 0 else None
    if len(shape) != len(size) or any(s == 0 for s in shape):
        return None  # an empty shard (FSDP2's last ranks of a short tensor): nothing to say
    return fqn, list(offsets)


def encode(blob, header: SnapshotHeader, step: int, rank: int, checksum: str) -> bytes:
    """The safetensors file of a verified blob whose header has a placement map."""
    from safetensors.torch import save

    raw = np.frombuffer(blob, dtype=np.uint8)
    local = f"{LOCAL_PREFIX}{rank}."
    tensors: dict[str, torch.Tensor] = {local + "header": torch.from_numpy(raw[:HEADER_BYTES].copy())}
    keys, sharding = _keys(header, rank)
    names, gaps, pos = {}, [], HEADER_BYTES
    for e, key in zip(header.entries, keys):
        start = HEADER_BYTES + e.offset
        gaps.append(raw[pos:start])
        pos = start + e.nbytes
        t = torch.from_numpy(raw[start:pos].copy()).view(getattr(torch, e.dtype)).view(e.shape)
        tensors[key], names[key] = t, e.name
    gaps.append(raw[pos:HEADER_BYTES + header.data_nbytes])
    tensors[local + "gaps"] = torch.from_numpy(np.concatenate(gaps).copy())
    info = {"step": step, "rank": rank, "blob_nbytes": len(raw), "checksum": checksum,
            "names": names}
    return save(tensors, metadata={"DCP_SHARDING_INFO": json.dumps(sharding),
                                   "DCP_VERSION": "1.0", "format": "pt",
                                   "phoenixft": json.dumps(info)})


def _keys(header: SnapshotHeader, rank: int) -> tuple[list[str], dict[str, dict]]:
    """Each blob entry's key in the file, and the file's DCP sharding info."""
    placement = header.dcp_placement()
    local = f"{LOCAL_PREFIX}{rank}."
    keys, sharding = [], {local + "header": {"saved_offsets": [0]}}
    for e in header.entries:
        public = public_name(e.name, e.shape, rank, placement)
        key, offsets = public if public else (local + e.name, [0] * len(e.shape))
        keys.append(key)
        sharding[key] = {"saved_offsets": offsets}
    sharding[local + "gaps"] = {"saved_offsets": [0]}
    return keys, sharding


def _file_meta(data: bytes, where: str) -> dict:
    try:
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8:8 + n])["__metadata__"]
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"{where}: not a phoenixft DCP base (unreadable safetensors "
                             "header: truncated or overwritten)") from None


def info_of(data: bytes, where: str) -> dict:
    """The `phoenixft` metadata of a base file (IntegrityError if unreadable)."""
    try:
        return json.loads(_file_meta(data, where)["phoenixft"])
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"{where}: not a phoenixft DCP base (no phoenixft metadata in "
                             "its safetensors header)") from None


def decode(data: bytes, where: str) -> tuple[dict, bytearray]:
    """(its phoenixft metadata, the blob) of a base file; the caller checks the blob's
    checksum against the metadata's (and the manifest's)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    info = info_of(data, where)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise IntegrityError(f"{where}: unreadable safetensors data ({exc})") from None
    local = f"{LOCAL_PREFIX}{info['rank']}."
    try:
        out = bytearray(info["blob_nbytes"])
        raw = np.frombuffer(out, dtype=np.uint8)
        raw[:HEADER_BYTES] = tensors[local + "header"].numpy()
        head = blob_header(raw, where)
        by_entry = {entry: key for key, entry in info["names"].items()}
        gaps, g, pos = tensors[local + "gaps"].numpy(), 0, HEADER_BYTES
        for e in head.entries:
            start = HEADER_BYTES + e.offset
            raw[pos:start] = gaps[g:g + start - pos]
            g += start - pos
            pos = start + e.nbytes
            raw[start:pos] = tensors[by_entry[e.name]].reshape(-1).view(torch.uint8).numpy()
        raw[pos:] = gaps[g:g + len(raw) - pos]
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise IntegrityError(f"{where}: its tensors do not make a snapshot blob ({exc!r}): "
                             "damaged or not written by phoenixft") from None
    try:
        said = json.loads(_file_meta(data, where)["DCP_SHARDING_INFO"])
    except (ValueError, KeyError, TypeError):
        said = None
    if said != _keys(head, info["rank"])[1]:
        raise IntegrityError(f"{where}: its DCP sharding metadata (DCP_SHARDING_INFO) does not "
                             "say where its shards lie (edited or damaged): a DCP reader would "
                             "put them in the wrong place")
    return info, out
