"""A bounded single-producer single-consumer ring of variable-size task records in shared
memory (a memfd): the decode loop (producer) hands the log executor (consumer) one task per
step; the executor may be a thread of the engine or a process of its own.

Layout of the shared memory::

    [0:8) head (bytes consumed, monotonic)  [8:16) tail (bytes produced, monotonic)
    [64:64+8*16) control words (int64), written by the executor: progress and counters
    [1024:4096) the executor's error message (u32 length, utf-8)
    [4096:4096+capacity) data: records of  kind u32 | length u32 | epoch u64 | payload
    (padded to 8 bytes); a record that would cross the end starts at 0 after a WRAP marker

The producer writes a record, then publishes the new tail; the consumer reads it, then
publishes the new head. Each index has one writer, so no lock is needed: between threads
the GIL orders the stores; between processes, x86-64's total store order keeps the payload
ahead of the index that publishes it (elsewhere the recorder runs its executor as a thread).

Back-pressure: `push` never blocks and never grows memory: it returns False when the
record does not fit, and the producer keeps the work for the next attempt (the recorder
merges that step into the next one: nothing is dropped, the epochs just get coarser).
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

_HEAD = struct.Struct("<IIQ")  # kind, length, epoch
WRAP = 0xFFFFFFFF
_CONTROL, _ERROR, _DATA = 64, 1024, 4096

# control words (the executor writes them, the decode loop reads them)
PROCESSED, EPOCHS, LOG_BYTES, KV_SLOTS, CHECKPOINTS, FREED, EXEC_NS, WANT_FULL, FAILED, \
    STARTED = range(10)


RECORD_OVERHEAD = _HEAD.size + 7  # a record's header and its worst-case padding


def _pad(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """`Ring(capacity)` creates one; `Ring.attach(fd)` maps an existing one (the executor
    process, given the fd)."""

    def __init__(self, capacity: int = 8 << 20, *, fd: int | None = None) -> None:
        if fd is None:
            self.capacity = _pad(capacity)
            fd = os.memfd_create("phoenixft-log-ring", 0)
            os.ftruncate(fd, _DATA + self.capacity)
            fresh = True
        else:
            self.capacity = os.fstat(fd).st_size - _DATA
            fresh = False
        self.fd = fd
        self._mm = mmap.mmap(fd, _DATA + self.capacity)
        self._idx = np.frombuffer(self._mm, dtype=np.uint64, count=2)  # head, tail
        self.control = np.frombuffer(self._mm, dtype=np.int64, count=16, offset=_CONTROL)
        if fresh:
            self._idx[:] = 0
            self.control[:] = 0
            self.control[PROCESSED] = -1
        self.pushed = 0
        self.full = 0  # pushes refused for lack of room

    @classmethod
    def attach(cls, fd: int) -> Ring:
        return cls(fd=fd)

    @property
    def used(self) -> int:
        return int(self._idx[1] - self._idx[0])

    @property
    def max_payload(self) -> int:
        """The largest payload `push` can ever take (into an empty ring)."""
        return self.capacity - _HEAD.size

    @property
    def shared_bytes(self) -> int:
        return _DATA + self.capacity

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

    # -- the executor's error message ------------------------------------------------------
    def set_error(self, msg: str) -> None:
        data = msg.encode()[:_DATA - _ERROR - 4]
        struct.pack_into("<I", self._mm, _ERROR, len(data))
        self._mm[_ERROR + 4:_ERROR + 4 + len(data)] = data
        self.control[FAILED] = 1

    def error(self) -> str | None:
        if not self.control[FAILED]:
            return None
        (n,) = struct.unpack_from("<I", self._mm, _ERROR)
        return bytes(self._mm[_ERROR + 4:_ERROR + 4 + n]).decode(errors="replace")

    def close(self) -> None:
        del self._idx, self.control
        self._mm.close()
        os.close(self.fd)
