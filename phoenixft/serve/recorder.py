"""The engine's recovery log, engine side: the decode loop enqueues, the executor writes.

After every engine step, `end_step()` (the decode loop, cheap and never blocking) builds
the epoch's task: the KV slots written since their last record (the block manager's dirty
map) and the request-state delta (`regions.StateRegion`), and pushes it on the ring. The
executor thread, always on, pops tasks in order, captures the KV slots (`KVRegion`),
appends the KV, STATE and COMMIT records to the log (`log.py`), and publishes the epoch it
processed; blocks freed by then leave the block manager's quarantine.

Policies:
- ring full: the step is merged into the next one (its dirty slots and state delta stay
  pending; nothing is dropped, memory stays bounded by the ring and the live state);
- compaction: once `compact_bytes` have been logged since the last checkpoint, the next
  task is a full checkpoint (every live request's computed slots and whole state) written
  to a new segment; the older segments are deleted once it is committed;
- a failing log (a full disk, say) stops recording, says so (`on_error`), frees the
  quarantined blocks and lets serving go on: recovery is then off, never silently wrong.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .log import ADAPTER, COMMIT, FULL, KV, STATE, LogWriter
from .regions import KVRegion, StateRegion, dirty_ranges
from .ring import Ring

_TASK = struct.Struct("<II")  # flags, number of KV ranges
TASK_EPOCH, TASK_ADAPTER = 1, 2
ADAPTER_REGION = 3


@dataclass
class RecorderStats:
    epochs: int = 0
    coalesced: int = 0  # steps merged into the next because the ring was full
    checkpoints: int = 0
    log_bytes: int = 0
    kv_slots: int = 0
    freed_bytes: int = 0
    executor_s: float = 0.0
    lag_max: int = 0  # most epochs the executor was behind
    errors: list[str] = field(default_factory=list)


class Recorder:
    def __init__(self, engine, log_dir: str | Path, *, first_epoch: int = 0, first_seq: int = 0,
                 ring_bytes: int = 16 << 20, compact_bytes: int = 256 << 20,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kv = KVRegion(engine.runner.k_cache, engine.runner.v_cache)
        self.state = StateRegion()
        self.ring = Ring(self.dir / "ring", ring_bytes)
        self.writer = LogWriter(self.dir, first_seq=first_seq)
        self.compact_bytes = compact_bytes
        self.on_error = on_error or (lambda msg: None)
        self.stats = RecorderStats()
        self.epoch = first_epoch  # the next epoch to enqueue
        self.processed = first_epoch - 1  # the newest epoch in the log (committed)
        self.failed: str | None = None
        self._since_checkpoint = 0
        self._want_full = True  # the first epoch of a writer is a full checkpoint
        self._adapters_pending: list[tuple[str, int]] = []  # loaded, not yet on the ring
        self._wake = threading.Event()
        self._stop = threading.Event()
        engine.block_manager.hold_epoch = self.epoch
        self._thread = threading.Thread(target=self._run, name="phoenixft-log-executor",
                                        daemon=True)
        self._thread.start()

    # -- the decode loop's side ------------------------------------------------------------
    def log_adapter(self, adapter) -> None:
        """An adapter version was loaded: it is logged before any epoch that uses it (its
        tensors are read by the executor: a version never changes once loaded)."""
        self._adapters_pending.append((adapter.name, adapter.version))
        self._push_adapters()

    def _push_adapters(self) -> bool:
        while self._adapters_pending:
            name, version = self._adapters_pending[0]
            if not self.ring.push(TASK_ADAPTER, self.epoch, json.dumps([name, version]).encode()):
                return False
            self._adapters_pending.pop(0)
            self._wake.set()
        return True

    def end_step(self) -> None:
        eng, bm = self.engine, self.engine.block_manager
        if self.failed is not None:
            return
        bm.release(self.processed)
        if not self._push_adapters():  # an epoch may use them: it waits for them
            self.stats.coalesced += 1
            return
        full = self._want_full
        waiting = [s.seq_id for s in eng.scheduler.waiting]
        running = [s.seq_id for s in eng.scheduler.running]
        if full:
            ranges = _live_ranges(eng.seqs.values(), bm.block_size)
            state = self.state.full(eng.seqs, waiting, running)
        else:
            ranges = dirty_ranges(bm.dirty)
            state = self.state.delta(eng.seqs, waiting, running)
        payload = (_TASK.pack(FULL if full else 0, len(ranges)) + ranges.astype("<i8").tobytes()
                   + StateRegion.encode(state))
        if not self.ring.push(TASK_EPOCH, self.epoch, payload):
            self.stats.coalesced += 1  # kept for the next step: nothing is lost
            return
        bm.take_dirty()
        self.state.recorded(eng.seqs, full=full)
        self._want_full = False
        self.epoch += 1
        bm.hold_epoch = self.epoch
        self.stats.lag_max = max(self.stats.lag_max, self.epoch - 1 - self.processed)
        self._wake.set()

    # -- the executor ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            task = self.ring.pop()
            if task is None:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self._write(*task)
            except Exception as exc:  # noqa: BLE001 - surfaced through on_error, never silent
                self._fail(f"{type(exc).__name__}: {exc}")
                return

    def _write_adapter(self, epoch: int, adapter) -> None:
        meta = json.dumps({"name": adapter.name, "version": adapter.version,
                           "scale": adapter.scale}).encode()
        self.writer.append(ADAPTER, epoch, struct.pack("<I", len(meta)) + meta + adapter.to_bytes(),
                           region=ADAPTER_REGION)

    def _write(self, kind: int, epoch: int, payload: bytes) -> None:
        if kind == TASK_ADAPTER:
            name, version = json.loads(payload)
            self._write_adapter(epoch, self.engine.adapters.get(name, version))
            return
        t0 = time.perf_counter()
        flags, n = _TASK.unpack_from(payload, 0)
        ranges = np.frombuffer(payload, dtype="<i8", count=3 * n, offset=_TASK.size).reshape(n, 3)
        state = payload[_TASK.size + ranges.nbytes:]
        full = bool(flags & FULL)
        if full:
            segment = self.writer.rotate()
            for adapter in list(self.engine.adapters.versions.values()):
                self._write_adapter(epoch, adapter)  # the new segment stands alone
        before = self.writer.bytes_written
        if n:
            self.writer.append(KV, epoch, self.kv.capture(ranges), region=KVRegion.region_id)
            self.stats.kv_slots += int((ranges[:, 2] - ranges[:, 1]).sum())
        self.writer.append(STATE, epoch, state, region=StateRegion.region_id,
                           flags=FULL if full else 0)
        self.writer.append(COMMIT, epoch)
        written = self.writer.bytes_written - before
        self.stats.log_bytes += written
        self.stats.epochs += 1
        if full:
            self.stats.checkpoints += 1
            self.stats.freed_bytes += self.writer.drop_before(segment)
            self._since_checkpoint = 0
        else:
            self._since_checkpoint += written
            if self._since_checkpoint > self.compact_bytes:
                self._want_full = True
        self.processed = epoch
        self.stats.executor_s += time.perf_counter() - t0

    def _fail(self, msg: str) -> None:
        self.failed = msg
        self.stats.errors.append(msg)
        bm = self.engine.block_manager
        bm.hold_epoch = None
        bm.release(1 << 62)
        self.on_error(msg)

    # -- lifecycle -------------------------------------------------------------------------
    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued epoch is in the log (tests, clean shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.processed < self.epoch - 1 and self.failed is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)  # polling the executor's progress, bounded
        return self.failed is None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        self.writer.close()
        self.ring.close()

    def summary(self) -> dict:
        s = self.stats
        return {"epochs": s.epochs, "coalesced": s.coalesced, "checkpoints": s.checkpoints,
                "log_bytes": s.log_bytes, "kv_slots": s.kv_slots, "freed_bytes": s.freed_bytes,
                "executor_s": round(s.executor_s, 4), "lag_max": s.lag_max,
                "processed_epoch": self.processed, "failed": self.failed}


def _live_ranges(seqs, block_size: int) -> np.ndarray:
    """Every computed slot of every live request (a full checkpoint)."""
    ranges: dict[int, tuple[int, int]] = {}
    for s in seqs:
        for i, b in enumerate(s.block_table):
            hi = min(block_size, s.num_computed_tokens - i * block_size)
            if hi > 0:
                ranges[b] = (0, max(hi, ranges.get(b, (0, 0))[1]))
    if not ranges:
        return np.zeros((0, 3), dtype=np.int64)
    return np.array([(b, lo, hi) for b, (lo, hi) in ranges.items()], dtype=np.int64)


def describe(payload: bytes) -> dict:
    """A task's header, for debugging."""
    flags, n = _TASK.unpack_from(payload, 0)
    return {"full": bool(flags & FULL), "ranges": n,
            "state": json.loads(payload[_TASK.size + 24 * n:])}
