"""The serving engine's recovery log: append-only, checksummed records in segment files
that live outside the engine process (host shared memory, /dev/shm, by default), so a
crashed engine's successor can rebuild its state.

A record::

    magic b"PHXR" | kind u8 | region u8 | flags u16 | length u32 | epoch u64 | seq u64
    | checksum u64 (xxh3-64 of the 32 header bytes before it and the payload) | payload

Kinds: KV (a region's changed KV slots), STATE (request state), ADAPTER (an adapter's
weights), COMMIT (closes an epoch: every record of that epoch is in). A segment starts with
a segment header; the writer starts a new segment when it compacts (a full checkpoint of
the live state), and deletes the older ones only once that checkpoint is committed.

Replay reads the segments in order and stops at the first record that is torn (cut short)
or damaged (checksum): everything after it is dropped and reported, and only records up
to the last COMMIT before it are applied. `seq` numbers every record of a writer in order;
a gap is damage too.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

SEGMENT_MAGIC = b"PHXLOG1\0"
RECORD_MAGIC = b"PHXR"
_SEG = struct.Struct("<8sQ")  # magic, segment number
_REC = struct.Struct("<4sBBHIQQ")  # magic, kind, region, flags, length, epoch, seq
_SUM = struct.Struct("<Q")

KV, STATE, ADAPTER, COMMIT = 1, 2, 3, 4
KIND_NAMES = {KV: "kv", STATE: "state", ADAPTER: "adapter", COMMIT: "commit"}
FULL = 1  # flags: a STATE record that replaces the whole table (a checkpoint), not a delta


@dataclass(frozen=True, slots=True)
class Record:
    kind: int
    region: int
    flags: int
    epoch: int
    seq: int
    payload: bytes


def _checksum(head: bytes, payload) -> int:
    h = xxhash.xxh3_64(head)
    h.update(payload)
    return h.intdigest()


def segment_path(log_dir: Path, n: int) -> Path:
    return Path(log_dir) / f"seg-{n:06d}.log"


LOCK_NAME = "writer.lock"


class LogBusy(RuntimeError):
    pass


def lock_log(log_dir: str | Path, wait_s: float = 0.0) -> int:
    """Take the log's writer lock (an flock the kernel drops when its holder dies); returns
    the fd that holds it. A log has one writer: a successor takes the lock before it
    replays, so the crashed engine's executor can no longer be appending. Waits up to
    `wait_s` (a dying executor process is being reaped), then raises `LogBusy`."""
    import fcntl
    import time

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(log_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise LogBusy(f"the recovery log in {log_dir} is held by another writer (a "
                              "live engine's log executor); one log serves one engine at a "
                              "time: give this server its own --log-dir") from None
            time.sleep(0.01)  # the holder is exiting; the kernel frees the lock when it has


def segments(log_dir: str | Path) -> list[Path]:
    return sorted(Path(log_dir).glob("seg-*.log"))


class LogWriter:
    """Appends records to the newest segment of `log_dir` (one writer at a time: the active
    engine's executor thread)."""

    def __init__(self, log_dir: str | Path, *, first_seq: int = 0) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = segments(self.dir)
        self.segment = int(existing[-1].stem.split("-")[1]) if existing else -1
        self.seq = first_seq
        self.bytes_written = 0
        self._f = None
        self.rotate()

    def rotate(self) -> int:
        """Start a new segment; returns its number."""
        if self._f is not None:
            self._f.close()
        self.segment += 1
        self._f = open(segment_path(self.dir, self.segment), "ab", buffering=0)  # noqa: SIM115
        self._f.write(_SEG.pack(SEGMENT_MAGIC, self.segment))
        return self.segment

    def record(self, kind: int, epoch: int, parts=(), *, region: int = 0,
               flags: int = 0) -> list:
        """One record as buffers to write (header with checksum, then the payload's parts,
        not copied); numbers it. Write an epoch's records together with `write`."""
        views = [memoryview(p).cast("B") for p in parts]
        head = _REC.pack(RECORD_MAGIC, kind, region, flags, sum(len(v) for v in views), epoch,
                         self.seq)
        h = xxhash.xxh3_64(head)
        for v in views:
            h.update(v)
        self.seq += 1
        return [head + _SUM.pack(h.intdigest()), *views]

    def write(self, buffers: list) -> None:
        """Append buffers in one system call (few calls: the executor shares the GIL with
        the decode loop, and every call that releases it costs the decode loop a hand-off)."""
        fd = self._f.fileno()
        total = sum(len(b) for b in buffers)
        done = os.writev(fd, buffers)
        if done < total:  # a short write (a nearly full disk): finish it, or os.write raises
            rest = memoryview(b"".join(buffers))[done:]
            while rest:
                rest = rest[os.write(fd, rest):]
        self.bytes_written += total

    def append(self, kind: int, epoch: int, payload=b"", *, region: int = 0, flags: int = 0) -> None:
        self.write(self.record(kind, epoch, [payload] if len(payload) else [], region=region,
                              flags=flags))

    def drop_before(self, segment: int) -> int:
        """Delete the segments older than `segment` (once a checkpoint in it is committed).
        Returns the bytes freed."""
        freed = 0
        for p in segments(self.dir):
            if int(p.stem.split("-")[1]) < segment:
                freed += p.stat().st_size
                p.unlink()
        return freed

    def size(self) -> int:
        return sum(p.stat().st_size for p in segments(self.dir))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass
class Replay:
    """What a log holds: the records up to its last commit, and what was dropped."""

    records: list[Record] = field(default_factory=list)  # up to and including the last commit
    last_commit: int = -1
    next_seq: int = 0
    dropped_records: int = 0  # valid records after the last commit (an unfinished epoch)
    damage: list[str] = field(default_factory=list)  # torn or corrupt records, where
    commit_end: tuple[str, int] | None = None  # segment and offset just after the last commit


def _scan(path: Path) -> Iterator[tuple[Record, int] | str]:
    """The records of one segment, then a description of the damage if it ends badly."""
    data = path.read_bytes()
    if len(data) < _SEG.size or data[:8] != SEGMENT_MAGIC:
        yield f"{path.name}: not a log segment (bad header)"
        return
    off = _SEG.size
    while off < len(data):
        if len(data) - off < _REC.size + _SUM.size:
            yield f"{path.name} @ {off}: torn record header ({len(data) - off} bytes)"
            return
        head = data[off:off + _REC.size]
        magic, kind, region, flags, length, epoch, seq = _REC.unpack(head)
        (want,) = _SUM.unpack_from(data, off + _REC.size)
        start = off + _REC.size + _SUM.size
        if magic != RECORD_MAGIC or kind not in KIND_NAMES:
            yield f"{path.name} @ {off}: not a record (bad magic or kind)"
            return
        if len(data) - start < length:
            yield f"{path.name} @ {off}: torn record (payload cut short)"
            return
        payload = data[start:start + length]
        if _checksum(head, payload) != want:
            yield f"{path.name} @ {off}: checksum mismatch (a damaged {KIND_NAMES[kind]} record " \
                  f"of epoch {epoch})"
            off = start + length  # its header looks whole: look on, to report what follows
            continue
        off = start + length
        yield Record(kind, region, flags, epoch, seq, payload), off


def replay(log_dir: str | Path) -> Replay:
    out = Replay()
    pending: list[Record] = []
    expect = None
    damaged = False
    for path in segments(log_dir):
        for item in _scan(path):
            if isinstance(item, str):
                out.damage.append(item)
                damaged = True
                continue
            if damaged:  # after damage nothing is applied; scanning on only reports more
                out.dropped_records += 1
                continue
            rec, end = item
            if expect is not None and rec.seq != expect:
                out.damage.append(f"{path.name}: record {expect} missing (found {rec.seq})")
                damaged = True
                continue
            expect = rec.seq + 1
            pending.append(rec)
            if rec.kind == COMMIT:
                out.records += pending
                out.last_commit, out.next_seq = rec.epoch, rec.seq + 1
                out.commit_end = (str(path), end)
                pending = []
    out.dropped_records += len(pending)
    return out


def cut_after_commit(log_dir: str | Path, rep: Replay) -> None:
    """Make the log end at its last valid commit: truncate that segment there and delete
    any later one (a torn or uncommitted tail must not sit before the next writer's
    records, or a later replay would stop at it)."""
    if rep.commit_end is None:
        for p in segments(log_dir):
            p.unlink()
        return
    path, end = rep.commit_end
    os.truncate(path, end)
    for p in segments(log_dir):
        if p.name > Path(path).name:
            p.unlink()


def dir_bytes(log_dir: str | Path) -> int:
    return sum(os.path.getsize(p) for p in segments(log_dir))
