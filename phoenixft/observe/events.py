"""The run directory's event log and JSON files.

Every process of a job (agents, workers, the leader) appends to one ``events.jsonl``:
one JSON object per line with ``t`` (wall-clock seconds), ``event`` and its fields. Each
line is written with a single ``write`` on an ``O_APPEND`` descriptor, so lines from
different processes never interleave on a local file system. Readers must tolerate a
torn last line (a process killed mid-write).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EventLog:
    """Append-only JSON-lines log shared by every process of a run.

    A record the file system refuses (a full or read-only disk) is dropped and counted,
    never raised: the log is an account of the training, and a full run-directory disk
    must not stop the training it describes. `failing` holds the error while writes fail
    (the agent tells the console), `lost` counts the records dropped."""

    def __init__(self, path: str | os.PathLike | None, **common: Any) -> None:
        self.path = Path(path) if path else None
        self.common = common
        self._fd: int | None = None
        self.failing: OSError | None = None
        self.lost = 0
        self._torn = False  # the last write stopped mid-line: end that line first
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"t": round(time.time(), 6), "event": event, **self.common, **fields}
        if self._fd is not None:
            line = (json.dumps(record, default=str) + "\n").encode()
            if self._torn:  # else this record would join the torn one and be lost with it
                line = b"\n" + line
            try:
                n = os.write(self._fd, line)
                self._torn = (self._torn and n == 0) or 0 < n < len(line)
                if n != len(line):  # a short write: the disk filled
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.failing = None
            except OSError as exc:
                self.failing = exc
                self.lost += 1
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the complete records of an events.jsonl, skipping a torn final line."""
    p = Path(path)
    if not p.exists():
        return
    with p.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class EventFollower:
    """Follows an events.jsonl as it grows: each `poll()` returns only the records
    appended since the previous one, so following a long job costs what it logs from now
    on, not everything it logged (a view that re-read the whole log on every refresh
    parsed tens of MB a second on a job of 100k steps). A line not yet ended waits for its
    end. A log replaced or truncated (a new job in the same directory) is read from its
    start, and `restarted` says so until the next poll, so a view can drop what it kept.
    A replacement is told by the file's inode, its size, and its first bytes: a log
    rewritten in place (or a new file that got the old inode number back) that grew past
    the old position between two polls has the same inode and no smaller size, but not
    the same head (its first record names its job and time)."""

    READ_BYTES = 4 << 20  # read (and parse) at most this much at a time
    HEAD_BYTES = 256  # the log's first bytes, kept to tell a replaced log from a grown one

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.restarted = False
        self._pos = 0
        self._ino: int | None = None
        self._head = b""
        self._partial = b""

    def poll(self) -> list[dict]:
        self.restarted = False
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return []
        out: list[dict] = []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self._pos or \
                    f.read(len(self._head)) != self._head:
                self.restarted = self._ino is not None
                self._ino, self._pos, self._head, self._partial = st.st_ino, 0, b"", b""
            if len(self._head) < self.HEAD_BYTES:  # (before the records are read)
                f.seek(0)
                self._head = f.read(self.HEAD_BYTES)
            f.seek(self._pos)
            while data := f.read(self.READ_BYTES):
                self._pos += len(data)
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()
                for line in lines:
                    if line.strip():
                        try:
                            out.append(json.loads(line))
                        except ValueError:  # a torn line (its writer killed mid-write)
                            continue
        return out


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON so a reader sees the old or the new file, never half of one. The temporary
    file is per process *and thread*: two threads of one process (the serving front's
    failover and its standby watcher both rewrite status.json) must not share it, or one
    truncates what the other is about to rename and the second rename fails."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:  # a full disk: no half-written temporary file left behind
        tmp.unlink(missing_ok=True)
        raise
