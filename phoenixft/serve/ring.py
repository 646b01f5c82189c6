"""A bounded single-producer single-consumer ring of variable-size task records in shared
memory: the decode loop (producer) hands the log executor (consumer) one task per step.

Layout of the mapped file::

    [0:8) head (bytes consumed, monotonic)  [8:16) tail (bytes produced, monotonic)
    [64:64+capacity) data: records of  kind u32 | length u32 | epoch u64 | payload
    (padded to 8 bytes); a record that would cross the end starts at 0 after a WRAP marker

The producer writes a record, then publishes the new tail; the consumer reads it, then
publishes the new head. Each index has one writer, so no lock is needed; under CPython the
two sides are threads and the GIL orders the stores, and the same layout works between
processes.

Back-pressure: `push` never blocks and never grows memory: it returns False when the
record does not fit, and the producer keeps the work for the next attempt (the recorder
merges that step into the next one: nothing is dropped, the epochs just get coarser).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

_HEAD = struct.Struct("<IIQ")  # kind, length, epoch
WRAP = 0xFFFFFFFF
_DATA = 64


def _pad(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    def __init__(self, path: str | Path, capacity: int = 8 << 20) -> None:
        self.path = Path(path)
        self.capacity = _pad(capacity)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _DATA + self.capacity)
            self._mm = mmap.mmap(fd, _DATA + self.capacity)
        finally:
            os.close(fd)
        self._idx = np.frombuffer(self._mm, dtype=np.uint64, count=2)  # head, tail
        self._idx[:] = 0
        self.pushed = 0
        self.full = 0  # pushes refused for lack of room

    @property
    def used(self) -> int:
        return int(self._idx[1] - self._idx[0])

    def push(self, kind: int, epoch: int, payload: bytes) -> bool:
        need = _pad(_HEAD.size + len(payload))
        if need > self.capacity:
            raise ValueError(f"a task of {len(payload)} bytes cannot fit a ring of "
                             f"{self.capacity} bytes")
        head, tail = int(self._idx[0]), int(self._idx[1])
        pos = tail % self.capacity
        wrap = self.capacity - pos if pos + need > self.capacity else 0
        if tail + wrap + need - head > self.capacity:
            self.full += 1
            return False
        if wrap:
            if wrap >= _HEAD.size:
                _HEAD.pack_into(self._mm, _DATA + pos, WRAP, 0, 0)
            tail += wrap
            pos = 0
        _HEAD.pack_into(self._mm, _DATA + pos, kind, len(payload), epoch)
        self._mm[_DATA + pos + _HEAD.size:_DATA + pos + _HEAD.size + len(payload)] = payload
        self._idx[1] = tail + need  # publish last
        self.pushed += 1
        return True

    def pop(self) -> tuple[int, int, bytes] | None:
        head, tail = int(self._idx[0]), int(self._idx[1])
        if head == tail:
            return None
        pos = head % self.capacity
        if self.capacity - pos < _HEAD.size:  # too little room at the end for a header
            head += self.capacity - pos
            pos = 0
        else:
            kind, length, epoch = _HEAD.unpack_from(self._mm, _DATA + pos)
            if kind == WRAP:
                head += self.capacity - pos
                pos = 0
        kind, length, epoch = _HEAD.unpack_from(self._mm, _DATA + pos)
        payload = bytes(self._mm[_DATA + pos + _HEAD.size:_DATA + pos + _HEAD.size + length])
        self._idx[0] = head + _pad(_HEAD.size + length)
        return kind, epoch, payload

    def close(self) -> None:
        del self._idx
        self._mm.close()
