"""Tiers: the places a rank's snapshot is kept, behind one small interface.

A snapshot travels as a *blob*: its slot bytes (header JSON + aligned tensor bytes, see
`slots.py`), self-describing and checksummed. Every tier keeps blobs by (step, rank):

- `ShmTier("snap")`, local memory: the rank's own slots in its node's shared memory;
- `ShmTier("rep")`, peer memory: the replica slots a holder keeps for a peer;
- `FsspecTier(url)`, persistent storage through fsspec: a local directory or
  ``s3://bucket/prefix`` (s3fs). It stores *base* records (the whole blob,
  zstd-compressed when a sample of it shrinks by 15% or more, raw otherwise) and *delta*
  records against a base (`delta.py`), and the manifests that commit a step. A sharded
  model's bases are safetensors files with torch.distributed.checkpoint's sharding
  information instead (`dcp_base.py`: one `.shards` file per rank, beside its records).

Guarantees of every tier: `get` returns only bytes whose checksum matches what `put`
stored, else raises `IntegrityError` naming the file or key (a torn write, a flipped
byte, a truncated file); a record that is not there is `KeyError` (on storage a
`MissingRecord`, naming the file). `put` of a record is atomic: a reader sees the whole
record or none (temp file + fsync + rename on a filesystem; one PUT on an object store).
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import zstandard

from phoenixft.checkpoint import dcp_base
from phoenixft.checkpoint.delta import CHUNK, apply_delta, encode_delta
from phoenixft.checkpoint.integrity import IntegrityError, checksum
from phoenixft.checkpoint.slots import HEADER_BYTES, SlotFile, SlotKind, blob_header, slot_path

SAMPLE_BYTES = 1 << 20  # a base's codec is chosen from this many bytes of its tensors
MIN_SAVING = 0.15  # compress a base only if the sample shrinks by at least this much


@dataclass(frozen=True)
class RecordInfo:
    step: int
    rank: int
    kind: str  # "slot" (memory tiers), "base" or "delta" (persistent)
    checksum: str  # of the whole blob the record restores
    nbytes: int  # bytes stored
    base_step: int | None = None  # a delta's base
    codec: str | None = None  # a base's: "zstd", "raw", or "dcp" (dcp_base.py)


class Tier(Protocol):
    """One place snapshot blobs are kept (see the module doc for the guarantees)."""

    name: str

    def put(self, step: int, rank: int, blob, *, base: tuple[int, bytes] | None = None) -> RecordInfo:
        """Keep `blob` as (step, rank). A tier that stores deltas may be given the base
        (its step and blob) to store only the difference."""
        ...

    def get(self, step: int, rank: int) -> bytes: ...
    def list(self) -> list[RecordInfo]: ...
    def delete(self, step: int, rank: int) -> None: ...


class ShmTier:
    """Slot files in one node's shared memory ("snap": own snapshots, local memory;
    "rep": replicas held for peers, peer memory). Two slots per rank (step % 2)."""

    def __init__(self, shm_dir: str | Path, kind: SlotKind | str = SlotKind.SNAP) -> None:
        self.shm_dir, self.kind = Path(shm_dir), SlotKind(kind)
        self.name = "local_memory" if self.kind is SlotKind.SNAP else "peer_memory"

    def put(self, step: int, rank: int, blob, *, base=None) -> RecordInfo:
        data = memoryview(blob)
        f = SlotFile(slot_path(self.shm_dir, self.kind, rank, step))
        f.put_image(np.frombuffer(data, dtype=np.uint8), step)  # incomplete until verified
        return RecordInfo(step, rank, "slot", checksum(data), len(data))

    def open(self, step: int, rank: int) -> tuple[SlotFile, dict]:
        """The slot holding rank's snapshot of `step`, verified, and its header: what the
        restore planner reads (`restore.ShmSource`) and `get` returns the bytes of.
        KeyError: not here (no slot, or it moved on to another step); IntegrityError:
        here, but damaged."""
        p = slot_path(self.shm_dir, self.kind, rank, step)
        if not p.exists():
            raise KeyError((step, rank))
        f = SlotFile(p)
        if f.peek()[1] not in (step, -1):  # the slot moved on to another step: not here
            raise KeyError((step, rank))
        return f, f.verify(step)

    def get(self, step: int, rank: int) -> bytes:
        f, _ = self.open(step, rank)
        return bytes(f.np[:f.used_nbytes()])

    def list(self) -> list[RecordInfo]:
        out = []
        for p in sorted(self.shm_dir.glob(f"{self.kind}.r*.s*")):
            f = SlotFile(p)
            complete, step = f.peek()
            if complete:
                rank = int(p.name.split(".")[1][1:])
                out.append(RecordInfo(step, rank, "slot", "", f.used_nbytes()))
        return out

    def delete(self, step: int, rank: int) -> None:
        p = slot_path(self.shm_dir, self.kind, rank, step)
        if p.exists() and SlotFile(p).peek() == (True, step):
            p.unlink()


_RECORD = b"PHXREC1\0"
_LEN = struct.Struct("<Q")
_NAME = re.compile(r"s(\d+)\.(base|delta|shards)$")
_DCP_NAME = re.compile(r"s(\d+)/r(\d+)\.safetensors$")  # (bases before 0.2: see `legacy_dcp_path`)


class FsspecTier:
    """Persistent records and manifests under one fsspec URL (a directory or s3://...).

    Layout: ``r{rank}/s{step:010d}.{base|delta}`` (a JSON header, then the blob, raw or
    zstd-compressed as its header's ``codec`` says, or the delta),
    ``r{rank}/s{step:010d}.shards`` (a sharded model's base: safetensors with DCP's
    sharding information, `dcp_base.py`), ``manifests/{step:010d}.json``, and
    ``checkpoint/step-{step}/`` (a whole checkpoint in DCP's default format,
    `dcp_export.py`). No directory holds one rank's part of a step under a name a DCP
    reader takes for a checkpoint: `.shards` files are not `*.safetensors`, and a DCP
    directory's `.metadata` is written last."""

    name = "persistent"

    # zstd level 1 for the bases that compress (`_base_codec`) and the codec sample: level
    # 3 saved no more on fp32 state and took 2.3x the CPU (61 ms against 27 ms for 20 MB)
    def __init__(self, url: str, *, level: int = 1) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                                else (self.fs.protocol,))
        self.level = level

    # -- raw objects --------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def write_atomic(self, path: str, data: bytes) -> None:
        """The whole object or nothing: temp + fsync + rename on a filesystem; on an
        object store a PUT is already all-or-nothing."""
        if not self.local:
            with self.fs.open(path, "wb") as f:
                f.write(data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)  # a full disk must not fill up with our half-written temps
            except OSError:
                pass
            raise
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself is durable
        finally:
            os.close(fd)

    def write_object(self, rel: str, data: bytes) -> None:
        """An object at `rel` under the URL (atomic, see write_atomic)."""
        self.write_atomic(self._path(rel), data)

    def read_object(self, rel: str) -> bytes:
        return self.read(self._path(rel))

    def read(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise MissingRecord(f"{self._url_of(path)}: missing") from None

    # -- records ------------------------------------------------------------------------
    def record_path(self, step: int, rank: int, kind: str) -> str:
        return self._path(f"r{rank}", f"s{step:010d}.{kind}")

    def shards_path(self, step: int, rank: int) -> str:
        """A sharded model's base (`dcp_base.py`)."""
        return self.record_path(step, rank, "shards")

    def legacy_dcp_path(self, step: int, rank: int) -> str:
        """Where phoenixft before 0.2 wrote a sharded base: read, never written (its
        directory looked like a DCP checkpoint while other ranks' files were missing)."""
        return self._path("dcp", f"s{step:010d}", f"r{rank:05d}.safetensors")

    def locate(self, step: int, rank: int, kind: str) -> str:
        """Where (step, rank)'s record of `kind` is: a sharded model's base when there is
        one, else the record file (which may not exist)."""
        if kind == "base":
            for path in (self.shards_path(step, rank), self.legacy_dcp_path(step, rank)):
                if self.fs.exists(path):
                    return path
        return self.record_path(step, rank, kind)

    def put(self, step: int, rank: int, blob, *, base: tuple[int, bytes] | None = None,
            chunk: int = CHUNK, base_hashes=None, base_checksum: str | None = None
            ) -> RecordInfo:
        """Write (step, rank)'s record: a delta against `base` (step, blob) when given and
        of the same size, else a base. A caller that keeps the base across deltas passes
        what it already knows of it (its chunk hashes, its checksum: the base record's
        `RecordInfo.checksum`) so that no delta hashes the whole base blob again."""
        blob = memoryview(blob)
        full = checksum(blob)
        if base is not None and len(base[1]) == len(blob):
            kind = "delta"
            payload = encode_delta(base[1], blob, chunk=chunk, base_hashes=base_hashes)
            meta = {"base_step": base[0],
                    "base_checksum": base_checksum or checksum(base[1])}
        else:
            kind = "base"
            hdr = blob_header(blob)
            if hdr.dcp_placement() is not None:  # a sharded model: DCP's sharding info
                data = dcp_base.encode(blob, hdr, step, rank, full)
                self.write_atomic(self.shards_path(step, rank), data)
                return RecordInfo(step, rank, kind, full, len(data), codec="dcp")
            codec = self._base_codec(blob)
            meta = {"codec": codec}
            payload = (zstandard.ZstdCompressor(level=self.level).compress(blob)
                       if codec == "zstd" else blob)
        header = json.dumps({"step": step, "rank": rank, "kind": kind, "blob_nbytes": len(blob),
                             "checksum": full, "payload_checksum": checksum(payload), **meta}).encode()
        data = _RECORD + _LEN.pack(len(header)) + header + payload
        self.write_atomic(self.record_path(step, rank, kind), data)
        return RecordInfo(step, rank, kind, full, len(data), meta.get("base_step"),
                          meta.get("codec"))

    def _base_codec(self, blob: memoryview) -> str:
        """zstd, or raw when a sample of the tensor bytes shrinks by less than
        `MIN_SAVING`: fp32 weights and optimizer state shrink by about 8%, which cost 27 ms
        of CPU per 20 MB base at level 1 here (the persister's CPU share then persists
        fewer steps); bf16 state, or a model with many zeros, compresses further."""
        sample = blob[HEADER_BYTES:HEADER_BYTES + SAMPLE_BYTES]
        if len(sample) < SAMPLE_BYTES // 4:
            return "zstd"  # a small blob: its compression costs nothing worth saving
        size = len(zstandard.ZstdCompressor(level=self.level).compress(sample))
        return "zstd" if size <= (1 - MIN_SAVING) * len(sample) else "raw"

    def _read_record(self, path: str) -> tuple[dict, memoryview]:
        data = memoryview(self.read(path))
        if len(data) < len(_RECORD) + 8 or bytes(data[:len(_RECORD)]) != _RECORD:
            raise IntegrityError(f"{self._url_of(path)}: not a phoenixft record (truncated or "
                                 "overwritten)")
        (n,) = _LEN.unpack_from(data, len(_RECORD))
        start = len(_RECORD) + 8
        try:
            header = json.loads(bytes(data[start:start + n]))
        except ValueError:
            raise IntegrityError(f"{self._url_of(path)}: unreadable record header") from None
        payload = data[start + n:]
        if checksum(payload) != header["payload_checksum"]:
            raise IntegrityError(f"{self._url_of(path)}: checksum mismatch ({len(payload)} "
                                 "payload bytes: corrupt or truncated record)")
        return header, payload

    def _url_of(self, path: str) -> str:
        return f"{self.url}/{path[len(self.root):].lstrip('/')}"

    def get(self, step: int, rank: int, manifest: dict | None = None) -> bytes:
        """The verified blob of (step, rank). With the step's `manifest`, exactly the record
        it committed (its kind and checksum): a second record of the same step, of the
        other kind, is never read in its place (a step persisted twice, as a delta and
        then as a base, left both files, and a damaged base went unnoticed)."""
        committed = None
        if manifest is not None:
            committed = next((r for r in manifest["records"] if r["rank"] == rank), None)
            if committed is None:
                raise MissingRecord(f"{self._url_of(self.manifest_path(step))}: commits no "
                                    f"record of rank {rank}")
        blob, path, full = self._read(step, rank, (committed["kind"],) if committed
                                      else ("delta", "base"))
        if committed is not None and committed.get("checksum") not in (None, full):
            raise IntegrityError(f"{self._url_of(path)}: not the record step {step} was "
                                 f"committed with (another write of the same step)")
        return bytes(blob)

    def _read(self, step: int, rank: int, kinds: tuple[str, ...]) -> tuple[bytes, str, str]:
        """The first of `kinds` stored for (step, rank), restored and verified: (blob, its
        path, the blob's checksum as its header records it)."""
        for kind in kinds:
            path = self.locate(step, rank, kind)
            if self.fs.exists(path):
                break
        else:
            names = " or ".join(f"s{step:010d}.{k}" for k in kinds)
            raise MissingRecord(f"{self._url_of(self._path(f'r{rank}'))}/{names}: missing "
                                f"(no record of step {step}, rank {rank})")
        if path.endswith((".shards", ".safetensors")):
            return self._read_dcp(path, step, rank)
        header, payload = self._read_record(path)
        if header["kind"] == "base":  # (records from before the codec field: zstd)
            codec = header.get("codec", "zstd")
            if codec not in ("zstd", "raw"):
                raise IntegrityError(f"{self._url_of(path)}: unknown base codec {codec!r} "
                                     "(written by a newer phoenixft?)")
            blob = (zstandard.ZstdDecompressor().decompress(payload) if codec == "zstd"
                    else payload)
        else:
            try:
                base, _, base_sum = self._read(header["base_step"], rank, ("base",))
            except MissingRecord as exc:
                raise IntegrityError(f"{self._url_of(path)}: its base is gone ({exc})") from None
            if base_sum != header["base_checksum"]:  # (base_sum was checked against the bytes)
                raise IntegrityError(f"{self._url_of(path)}: its base (step "
                                     f"{header['base_step']}) is not the one it was made against")
            blob = apply_delta(base, payload)
        if len(blob) != header["blob_nbytes"] or checksum(blob) != header["checksum"]:
            raise IntegrityError(f"{self._url_of(path)}: restored blob fails its checksum")
        return blob, path, header["checksum"]

    def _read_dcp(self, path: str, step: int, rank: int) -> tuple[bytes, str, str]:
        where = self._url_of(path)
        info, blob = dcp_base.decode(self.read(path), where)
        if (info["step"], info["rank"]) != (step, rank):
            raise IntegrityError(f"{where}: holds step {info['step']} of rank {info['rank']} "
                                 f"(renamed?)")
        if len(blob) != info["blob_nbytes"] or checksum(blob) != info["checksum"]:
            raise IntegrityError(f"{where}: restored blob fails its checksum (a damaged shard)")
        return blob, path, info["checksum"]

    def list(self) -> list[RecordInfo]:
        out = []
        for path in self.fs.glob(self._path("dcp", "s*", "r*.safetensors")):
            m = _DCP_NAME.search(path)
            if m:
                out.append(RecordInfo(int(m.group(1)), int(m.group(2)), "base", "", 0))
        for rank_dir in self.fs.glob(self._path("r*")):
            rank = int(rank_dir.rstrip("/").rsplit("/r", 1)[1])
            for path in self.fs.ls(rank_dir, detail=False):
                m = _NAME.search(path)
                if m:
                    kind = "base" if m.group(2) == "shards" else m.group(2)
                    out.append(RecordInfo(int(m.group(1)), rank, kind, "", 0))
        return sorted(out, key=lambda r: (r.step, r.rank))

    def delete(self, step: int, rank: int) -> None:
        for kind in ("delta", "base", "shards"):
            path = self.record_path(step, rank, kind)
            if self.fs.exists(path):
                self.fs.rm(path)
        path = self.legacy_dcp_path(step, rank)
        if self.fs.exists(path):
            self.fs.rm(path)
            where = path.rsplit("/", 1)[0]
            if not self.fs.glob(f"{where}/*.safetensors"):
                self.fs.rm(where, recursive=True)  # (its COMMITTED mark too)

    # -- manifests ----------------------------------------------------------------------
    def manifest_path(self, step: int) -> str:
        return self._path("manifests", f"{step:010d}.json")

    def write_manifest(self, step: int, manifest: dict) -> None:
        body = {k: v for k, v in manifest.items() if k != "checksum"}
        body["checksum"] = _manifest_checksum(body)
        self.write_atomic(self.manifest_path(step), json.dumps(body, indent=1).encode())

    def manifests(self) -> list[int]:
        """Committed steps, oldest first (only whole manifests exist: see write_atomic; a
        file there not named like one, an editor's backup say, is not a step)."""
        paths = self.fs.glob(self._path("manifests", "*.json"))
        names = (p.rsplit("/", 1)[1][:-5] for p in paths)
        return sorted(int(n) for n in names if n.isdigit())

    def read_manifest(self, step: int) -> dict:
        """The manifest of `step`, checked: IntegrityError names the file and what is wrong
        with it (unreadable, not JSON, damaged, not this step's), MissingRecord when absent."""
        path = self.manifest_path(step)
        where = self._url_of(path)
        try:
            m = json.loads(self.read(path))
        except ValueError:
            raise IntegrityError(f"{where}: unreadable manifest (not JSON: truncated or "
                                 "overwritten)") from None
        except OSError as exc:
            raise IntegrityError(f"{where}: unreadable manifest ({exc})") from None
        lacks = [k for k in _MANIFEST_KEYS if not isinstance(m, dict) or k not in m]
        if lacks:
            raise IntegrityError(f"{where}: not a phoenixft manifest (no {', '.join(lacks)})")
        if "checksum" in m and _manifest_checksum(m) != m["checksum"]:
            raise IntegrityError(f"{where}: manifest fails its checksum (damaged)")
        if m["step"] != step:
            raise IntegrityError(f"{where}: holds step {m['step']}, not {step} (renamed?)")
        return m

    def delete_manifest(self, step: int) -> None:
        path = self.manifest_path(step)
        if self.fs.exists(path):
            self.fs.rm(path)

    def record_infos(self, manifest: dict) -> list[RecordInfo]:
        return [RecordInfo(**r) for r in manifest["records"]]


class MissingRecord(KeyError):
    """A record or object that is not there; its message names the file."""

    def __str__(self) -> str:  # KeyError's would print the message quoted, as a key
        return str(self.args[0]) if self.args else "missing"


_MANIFEST_KEYS = ("step", "job_id", "generation", "world_size", "time", "records")


def _manifest_checksum(manifest: dict) -> str:
    """Of a manifest without its own checksum field (manifests from before it have none
    and are read as they are)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return checksum(json.dumps(body, sort_keys=True).encode())


def info_dict(info: RecordInfo) -> dict:
    return asdict(info)
