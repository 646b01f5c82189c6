"""A base record in torch.distributed.checkpoint's format: one rank's snapshot blob as a
safetensors file that `torch.distributed.checkpoint.load` reads with its
`HuggingFaceStorageReader`, and that gives the exact blob back.

A sharded model's snapshot (`Fsdp2Layout`) says in its header where each of its tensors
lies in the whole one (`meta["opt"]["dcp"]`: global size and offsets, per parameter).
Every rank writes its file into the step's directory, ``dcp/s{step:010d}/``; each file
carries DCP's sharding info (``DCP_SHARDING_INFO``: the saved offsets of each tensor), so
the directory is one DCP checkpoint of the whole model, loadable onto any mesh:

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

A directory is a whole checkpoint only when every rank of the step wrote a base there:
rank 0 then writes ``COMMITTED`` into it, after the step's manifest (`persist.py`).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.slots import HEADER_BYTES

OPT_PREFIX = "optimizer.state."
LOCAL_PREFIX = "phoenixft.rank"
COMMITTED = "COMMITTED"


def dcp_map(header: dict) -> dict | None:
    """The blob's placement map (param name -> [global size, offsets]), if it has one."""
    return (header.get("opt") or {}).get("dcp")


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


def encode(blob, header: dict, step: int, rank: int, checksum: str) -> bytes:
    """The safetensors file of a verified blob whose header has a placement map."""
    from safetensors.torch import save

    placement = dcp_map(header)
    raw = np.frombuffer(blob, dtype=np.uint8)
    local = f"{LOCAL_PREFIX}{rank}."
    tensors: dict[str, torch.Tensor] = {local + "header": torch.from_numpy(raw[:HEADER_BYTES].copy())}
    sharding: dict[str, dict] = {local + "header": {"saved_offsets": [0]}}
    names, gaps, pos = {}, [], HEADER_BYTES
    for e in header["entries"]:
        start = HEADER_BYTES + e["offset"]
        gaps.append(raw[pos:start])
        pos = start + e["nbytes"]
        t = (torch.from_numpy(raw[start:pos].copy()).view(getattr(torch, e["dtype"]))
             .view(e["shape"]))
        public = public_name(e["name"], e["shape"], rank, placement)
        key, offsets = public if public else (local + e["name"], [0] * len(e["shape"]))
        tensors[key], names[key] = t, e["name"]
        sharding[key] = {"saved_offsets": offsets}
    gaps.append(raw[pos:HEADER_BYTES + header["data_nbytes"]])
    tensors[local + "gaps"] = torch.from_numpy(np.concatenate(gaps).copy())
    sharding[local + "gaps"] = {"saved_offsets": [0]}
    info = {"step": step, "rank": rank, "blob_nbytes": len(raw), "checksum": checksum,
            "names": names}
    return save(tensors, metadata={"DCP_SHARDING_INFO": json.dumps(sharding),
                                   "DCP_VERSION": "1.0", "format": "pt",
                                   "phoenixft": json.dumps(info)})


def info_of(data: bytes, where: str) -> dict:
    """The `phoenixft` metadata of a base file (IntegrityError if unreadable)."""
    try:
        n = int.from_bytes(data[:8], "little")
        head = json.loads(data[8:8 + n])
        return json.loads(head["__metadata__"]["phoenixft"])
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"{where}: not a phoenixft DCP base (unreadable safetensors "
                             "header: truncated or overwritten)") from None


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
        head = json.loads(bytes(raw[64:64 + int.from_bytes(raw[24:32], "little")]))
        by_entry = {entry: key for key, entry in info["names"].items()}
        gaps, g, pos = tensors[local + "gaps"].numpy(), 0, HEADER_BYTES
        for e in head["entries"]:
            start = HEADER_BYTES + e["offset"]
            raw[pos:start] = gaps[g:g + start - pos]
            g += start - pos
            pos = start + e["nbytes"]
            raw[start:pos] = tensors[by_entry[e["name"]]].reshape(-1).view(torch.uint8).numpy()
        raw[pos:] = gaps[g:g + len(raw) - pos]
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise IntegrityError(f"{where}: its tensors do not make a snapshot blob ({exc!r}): "
                             "damaged or not written by phoenixft") from None
    return info, out
