"""Snapshot slot files: one snapshot of one rank, memory-mapped from shared memory.

A slot is a file (in /dev/shm, owned by the node's agent, so it outlives the worker
that wrote it) laid out as::

    [0:8)   magic b"PHXSLOT1"
    [8:16)  state: 0 = being written, 1 = complete, 2 = rejected (it failed its check as
            it was written: a damaged transfer or copy; kept only to be passed over)
    [16:24) step
    [24:32) header JSON length
    [64:HEADER_BYTES)  header JSON: a `SnapshotHeader` (record.py: who, which step, where
                       each tensor lies, the data's size and checksum)
    [HEADER_BYTES:)    tensor bytes, each entry 64-byte aligned

Writers mark the slot incomplete, write data, checksum, header, then mark it complete;
readers accept a slot only when it is complete, for the step they want, and its checksum
matches. A torn or corrupt slot is reported, never loaded.

Writers hash the data as they copy it, one cache-sized chunk at a time (`write_data`,
`put_image`): copying a snapshot and then hashing the whole slot read every byte from
memory twice, and a snapshot is far larger than the cache.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from phoenixft.checkpoint.integrity import IntegrityError, checksum, hasher
from phoenixft.checkpoint.record import Entry, Snapshot, SnapshotHeader

MAGIC = b"PHXSLOT1"
REJECTED = 2  # the state word of a copy that failed its check when it was written
HEADER_BYTES = 64 * 1024
_ALIGN = 64
CHUNK = 256 << 10  # copied, then hashed while it is still in the core's cache (1 MiB L2)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Layout:
    entries: list[Entry] = field(default_factory=list)
    data_nbytes: int = 0

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Layout:
        lay = cls()
        off = 0
        for name, t in tensors.items():
            nb = t.numel() * t.element_size()
            lay.entries.append(Entry(name, str(t.dtype).removeprefix("torch."), list(t.shape),
                                     off, nb))
            off = _align(off + nb)
        lay.data_nbytes = off
        return lay

    def signature(self) -> list:
        return [(e.name, e.dtype, e.shape) for e in self.entries]


class SlotFile:
    """A memory-mapped slot file. `ensure(nbytes)` grows it (re-mapping)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self.capacity, self._inode = 0, -1
        if self.path.exists() and self.path.stat().st_size >= HEADER_BYTES:
            self._map(self.path.stat().st_size)

    def _map(self, size: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.capacity, self._inode = size, st.st_ino
        self.np = np.frombuffer(self._mm, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.np)

    def is_mapped(self) -> bool:
        """Whether the file existed, with room for a header, when it was opened."""
        return self._mm is not None

    def is_current(self) -> bool:
        """Whether this mapping still shows the whole file at the path: a reader keeping a
        peer's slot mapped from step to step remaps it when its writer grew it or made a
        new file (raises OSError when the file is gone)."""
        st = os.stat(self.path)
        return self._mm is not None and st.st_ino == self._inode and st.st_size == self.capacity

    def ensure(self, total_nbytes: int) -> None:
        """Make room for a write of `total_nbytes`. If the file was deleted under us (shared
        memory removed by hand mid-run), map a new one at the path: writing into the old
        mapping would protect nothing, since no reader can open it any more."""
        if self._mm is None or not self.path.exists():
            self.capacity = 0
        if total_nbytes > self.capacity:
            self._map(max(total_nbytes, HEADER_BYTES))

    # -- writing -------------------------------------------------------------------
    def begin_write(self, step: int) -> None:
        self.np[0:8] = np.frombuffer(MAGIC, dtype=np.uint8)
        self.np[8:24] = np.frombuffer(struct.pack("<qq", 0, step), dtype=np.uint8)

    def view(self, e: Entry) -> torch.Tensor:
        start = HEADER_BYTES + e.offset
        raw = self.tensor[start:start + e.nbytes]
        return raw.view(getattr(torch, e.dtype)).view(e.shape)

    def write_data(self, layout: Layout, tensors: dict[str, torch.Tensor],
                   halfway: Callable[[], None] | None = None) -> str:
        """Copy host tensors into their entries and return the data region's checksum,
        hashing each chunk right after copying it (alignment padding is hashed too, in
        place, so the digest is `checksum` of the whole region). `halfway` runs before the
        middle entry is copied (a fault-injection point)."""
        h, pos = hasher(), HEADER_BYTES
        for i, e in enumerate(layout.entries):
            if halfway is not None and i == len(layout.entries) // 2:
                halfway()
            start = HEADER_BYTES + e.offset
            h.update(self.np[pos:start])
            src = tensors[e.name].detach().reshape(-1).view(torch.uint8).numpy()
            for off in range(0, e.nbytes, CHUNK):
                dst = self.np[start + off:start + min(off + CHUNK, e.nbytes)]
                np.copyto(dst, src[off:off + CHUNK])
                h.update(dst)
            pos = start + e.nbytes
        h.update(self.np[pos:HEADER_BYTES + layout.data_nbytes])
        return h.hexdigest()

    def put_image(self, image: np.ndarray, step: int) -> SnapshotHeader:
        """Write a whole slot image (another slot's bytes, a received blob) and verify it
        in the same pass; returns its header. The data go first, then the header, and the
        image's own state word last, so the slot never looks complete before it is; a copy
        that does not verify (incomplete, another step, a checksum mismatch) is marked
        rejected and raises `IntegrityError`."""
        n = len(image)
        if n < HEADER_BYTES:
            raise IntegrityError(f"{self.path}: a slot image of {n} bytes has no header")
        self.ensure(n)
        self.begin_write(step)
        h = hasher()
        for off in range(HEADER_BYTES, n, CHUNK):
            dst = self.np[off:min(off + CHUNK, n)]
            np.copyto(dst, image[off:off + CHUNK])
            h.update(dst)
        self.np[16:HEADER_BYTES] = image[16:HEADER_BYTES]
        self.np[0:16] = image[0:16]
        try:
            return _verify(self.np, step, self.path, digest=h.hexdigest(), end=n)
        except IntegrityError:
            self.reject()
            raise

    def reject(self) -> None:
        """Mark a copy that failed its check as rejected: never loaded, and a restore
        that passes over it says why."""
        self.np[8:16] = np.frombuffer(struct.pack("<q", REJECTED), dtype=np.uint8)

    def finish_write(self, step: int, layout: Layout, header: SnapshotHeader,
                     digest: str | None = None) -> str:
        """Write the header (the writer's, completed with the step, the layout and the
        checksum) and mark the slot complete; `digest` is the data's checksum when the
        writer computed it while copying (`write_data`)."""
        if digest is None:
            digest = checksum(self.np[HEADER_BYTES:HEADER_BYTES + layout.data_nbytes])
        blob = header.with_(step=step, data_nbytes=layout.data_nbytes, checksum=digest,
                            entries=tuple(layout.entries)).to_json()
        if 64 + len(blob) > HEADER_BYTES:
            raise ValueError(f"snapshot header of {len(blob)} bytes exceeds {HEADER_BYTES}; "
                             "keep tracked metadata small (large state belongs in tensors)")
        self.np[64:64 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        self.np[24:32] = np.frombuffer(struct.pack("<q", len(blob)), dtype=np.uint8)
        self.np[8:16] = np.frombuffer(struct.pack("<q", 1), dtype=np.uint8)
        return digest

    # -- reading -------------------------------------------------------------------
    def peek(self) -> tuple[bool, int]:
        """(complete, step) from the fixed header, without verifying data."""
        if self._mm is None:
            return False, -1
        return _peek(self.np)

    def header(self) -> SnapshotHeader:
        if self._mm is None:
            raise IntegrityError(f"{self.path}: no snapshot (missing or empty file)")
        return _header(self.np, self.path)

    def used_nbytes(self) -> int:
        return HEADER_BYTES + self.header().data_nbytes

    def verify(self, step: int) -> SnapshotHeader:
        """Return the header of a complete, uncorrupted snapshot of `step`, or raise."""
        if self._mm is None:
            raise IntegrityError(f"{self.path}: no snapshot (missing or empty file)")
        return _verify(self.np, step, self.path)

    def tensors(self, hdr: SnapshotHeader) -> dict[str, torch.Tensor]:
        """Views (no copy) of the entries; copy them before the slot is rewritten."""
        return {e.name: self.view(e) for e in hdr.entries}

    def snapshot(self, step: int) -> Snapshot:
        """The verified snapshot of `step` in this slot, as views (no copy): copy them
        before the slot is rewritten; IntegrityError when it holds another step or is
        damaged."""
        hdr = self.verify(step)
        return Snapshot(hdr, self.tensors(hdr))


def _peek(buf: np.ndarray) -> tuple[bool, int]:
    state, step = _state(buf)
    return state == 1, step


def _state(buf: np.ndarray) -> tuple[int, int]:
    if len(buf) < 32 or bytes(buf[0:8]) != MAGIC:
        return 0, -1
    state, step = struct.unpack("<qq", bytes(buf[8:24]))
    return state, step


def _header(buf: np.ndarray, where) -> SnapshotHeader:
    (n,) = struct.unpack("<q", bytes(buf[24:32]))
    if not 0 < n <= HEADER_BYTES - 64 or len(buf) < 64 + n:
        raise IntegrityError(f"{where}: bad header length {n}")
    return SnapshotHeader.from_json(bytes(buf[64:64 + n]), where)


def _verify(buf: np.ndarray, step: int, where, digest: str | None = None,
            end: int | None = None) -> SnapshotHeader:
    """The header of a complete snapshot of `step` whose data match its checksum; `digest`
    is the checksum of buf[HEADER_BYTES:end) when the caller hashed the data as it wrote
    them (`end` must then be where the header says the data end)."""
    state, got = _state(buf)
    if state == REJECTED:
        raise IntegrityError(f"{where}: the copy of step {got} failed its check when it was "
                             "written or received (a damaged transfer or copy), and was "
                             "marked rejected")
    if state != 1:
        raise IntegrityError(f"{where}: snapshot incomplete (writer died mid-copy?)")
    if got != step:
        raise IntegrityError(f"{where}: holds step {got}, wanted step {step}")
    hdr = _header(buf, where)
    want_end = HEADER_BYTES + hdr.data_nbytes
    if digest is None:
        end = want_end
        if len(buf) >= end:
            digest = checksum(buf[HEADER_BYTES:end])
    if len(buf) < want_end or end != want_end or digest != hdr.checksum:
        raise IntegrityError(f"{where}: checksum mismatch for step {step} "
                             "(corrupt snapshot; falling back to another copy)")
    return hdr


def verify_blob(blob, step: int, where: str = "snapshot blob") -> SnapshotHeader:
    """The header of a slot's bytes held elsewhere (a copy, a persisted record), checked
    exactly as a slot file is: complete, for `step`, checksum matching."""
    return _verify(np.frombuffer(blob, dtype=np.uint8), step, where)


def blob_header(blob, where: str = "snapshot blob") -> SnapshotHeader:
    """The header of a slot's bytes, unverified (its data are not hashed)."""
    return _header(np.frombuffer(blob, dtype=np.uint8), where)


def blob_snapshot(blob, step: int, where: str = "snapshot blob") -> Snapshot:
    """The verified snapshot (tensors are copies) of a slot's bytes held elsewhere."""
    hdr = verify_blob(blob, step, where)
    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = {}
    for e in hdr.entries:
        start = HEADER_BYTES + e.offset
        out[e.name] = raw[start:start + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
    return Snapshot(hdr, out)


class SlotKind(str, enum.Enum):
    """Whose copy a slot file holds (the first word of its name)."""

    SNAP = "snap"  # a rank's own snapshot
    REP = "rep"  # a replica held for that rank
    DISK = "disk"  # a persisted record staged for a restore
    XFER = "xfer"  # an old rank's snapshot received for a reshard

    __format__ = str.__format__  # f"{kind}" is the value on every Python

    def __str__(self) -> str:
        return self.value


def slot_path(shm_dir: str | os.PathLike, kind: SlotKind | str, rank: int, step: int) -> Path:
    """The slot file of (kind, rank) that step `step` uses (two per rank: step % 2)."""
    return Path(shm_dir) / f"{SlotKind(kind)}.r{rank}.s{step % 2}"
