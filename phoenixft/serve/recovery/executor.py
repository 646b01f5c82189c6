"""The recovery log's executor: always on, it takes the decode loop's tasks from the ring
(`ring.py`), captures the KV slots they name, and appends the epoch's records to the log
(`log.py`) with one system call; it publishes its progress in the ring's control words.

It runs as a process of its own (`python -m phoenixft.serve.recovery.executor`, started when the
engine is loaded) reading the KV cache from shared memory: it never takes the engine's GIL,
so logging costs the decode loop only its enqueue. A cache on an accelerator, or a CPU
without total store order, runs it as a thread of the engine instead (`KVRegion` reads the
cache). It dies with the engine (parent-death signal); the log's writer lock makes a
successor wait until it has.

Tasks: START {first_seq} (opens the log: takes the writer lock, starts a segment), EPOCH
(flags, KV ranges, live adapters, request-state delta), ADAPTER (an adapter version's
record payload, kept for the checkpoints that follow), STOP.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from . import ring as R
from .log import ADAPTER, COMMIT, FULL, KV, STATE, LogWriter, lock_log
from .ring import Ring

TASK_EPOCH, TASK_ADAPTER, TASK_START, TASK_STOP = 1, 2, 3, 4
TASK = struct.Struct("<III")  # flags, number of KV ranges, bytes of the live-adapters list
KV_REGION, STATE_REGION, ADAPTER_REGION = 1, 2, 3


def epoch_task(full: bool, ranges: np.ndarray, adapters: list, state: bytes) -> bytes:
    live = json.dumps(adapters).encode() if full else b""
    return (TASK.pack(FULL if full else 0, len(ranges), len(live))
            + ranges.astype("<i8").tobytes() + live + state)


class LogExecutor:
    """Consumes the ring; `kv` captures slot ranges (`kv_slots.HostKV` or `KVRegion`)."""

    def __init__(self, ring: Ring, log_dir: str | Path, kv) -> None:
        self.ring, self.dir, self.kv = ring, Path(log_dir), kv
        self.c = ring.control
        self.writer: LogWriter | None = None
        self.compact_bytes = 256 << 20
        self.adapters: dict[tuple[str, int], bytes] = {}  # record payloads, by version
        self._since_checkpoint = 0
        self._lock_fd: int | None = None

    def run(self, wake_fd: int) -> None:
        try:
            while True:
                task = self.ring.pop()
                if task is None:
                    os.eventfd_read(wake_fd)  # blocks until the decode loop pushes again
                    continue
                kind, epoch, payload = task
                if kind == TASK_STOP:
                    return
                self._handle(kind, epoch, payload)
        except Exception as exc:  # noqa: BLE001 - told to the decode loop, never silent
            self.ring.set_error(f"{type(exc).__name__}: {exc}")
        finally:
            if self.writer is not None:
                self.writer.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)

    def _handle(self, kind: int, epoch: int, payload: bytes) -> None:
        if kind == TASK_START:
            start = json.loads(payload)
            self.compact_bytes = start["compact_bytes"]
            self._lock_fd = lock_log(self.dir)
            self.writer = LogWriter(self.dir, first_seq=start["first_seq"])
            self.c[R.STARTED] = 1
        elif kind == TASK_ADAPTER:
            (n,) = struct.unpack_from("<I", payload, 0)
            meta = json.loads(payload[4:4 + n])
            self.adapters[meta["name"], meta["version"]] = payload
            self._append([self.writer.record(ADAPTER, epoch, [payload], region=ADAPTER_REGION)])
        else:
            self._epoch(epoch, payload)

    def _append(self, records: list) -> int:
        before = self.writer.bytes_written
        self.writer.write([b for r in records for b in r])  # one system call
        written = self.writer.bytes_written - before
        self.c[R.LOG_BYTES] += written
        return written

    def _epoch(self, epoch: int, payload: bytes) -> None:
        t0 = time.perf_counter_ns()
        flags, n, n_live = TASK.unpack_from(payload, 0)
        off = TASK.size
        ranges = np.frombuffer(payload, dtype="<i8", count=3 * n, offset=off).reshape(n, 3)
        off += ranges.nbytes
        full = bool(flags & FULL)
        w, records = self.writer, []
        if full:  # a checkpoint starts a segment that stands alone, adapters included
            segment = w.rotate()
            live = {tuple(k) for k in json.loads(payload[off:off + n_live])}
            self.adapters = {k: p for k, p in self.adapters.items() if k in live}
            records += [w.record(ADAPTER, epoch, [p], region=ADAPTER_REGION)
                        for p in self.adapters.values()]
        if n:
            records.append(w.record(KV, epoch, self.kv.capture(ranges), region=KV_REGION))
            self.c[R.KV_SLOTS] += int((ranges[:, 2] - ranges[:, 1]).sum())
        records.append(w.record(STATE, epoch, [payload[off + n_live:]], region=STATE_REGION,
                                flags=FULL if full else 0))
        records.append(w.record(COMMIT, epoch))  # last: the epoch is in once this is
        written = self._append(records)
        if full:
            self.c[R.CHECKPOINTS] += 1
            self.c[R.FREED] += w.drop_before(segment)
            self._since_checkpoint = 0
            self.c[R.WANT_FULL] = 0
        else:
            self._since_checkpoint += written
            if self._since_checkpoint > self.compact_bytes:
                self.c[R.WANT_FULL] = 1
        self.c[R.EPOCHS] += 1
        self.c[R.EXEC_NS] += time.perf_counter_ns() - t0
        self.c[R.PROCESSED] = epoch


# -- where it runs -----------------------------------------------------------------------------
class ExecutorProcess:
    """The executor in a process of its own, reading the engine's KV cache from the memfd
    `ModelRunner.share_kv` put it in. Start it when the engine is loaded (a warm standby
    too): it costs an interpreter start, which a takeover should not wait for."""

    def __init__(self, runner, log_dir: str | Path, ring_bytes: int = 16 << 20) -> None:
        kv_fd = runner.share_kv()
        self.ring = Ring(ring_bytes)
        self.wake_fd = os.eventfd(0)
        layers, blocks, bs, heads, dim = runner.k_cache.shape
        cmd = [sys.executable, "-m", "phoenixft.serve.recovery.executor", "--log-dir", str(log_dir),
               "--ring-fd", str(self.ring.fd), "--kv-fd", str(kv_fd), "--wake-fd",
               str(self.wake_fd), "--shape", f"{layers},{blocks * bs},{heads * dim}",
               "--block-size", str(bs), "--itemsize", str(runner.k_cache.element_size()),
               "--parent", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, pass_fds=(self.ring.fd, kv_fd, self.wake_fd))
        self.pid = self.proc.pid

    def wake(self) -> None:
        os.eventfd_write(self.wake_fd, 1)

    def dead(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"the log executor process exited with code {code}"

    def stop(self, timeout_s: float = 10.0) -> None:
        _push_stop(self)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.wake_fd)
        self.ring.close()


class ExecutorThread:
    """The executor as a thread of the engine (a cache on an accelerator: `KVRegion` reads
    it, on a side stream where there is one)."""

    def __init__(self, runner, log_dir: str | Path, ring_bytes: int = 16 << 20) -> None:
        from .regions import KVRegion

        self.ring = Ring(ring_bytes)
        self.wake_fd = os.eventfd(0)
        self.pid = os.getpid()
        self._core = LogExecutor(self.ring, log_dir, KVRegion(runner.k_cache, runner.v_cache))
        self._thread = threading.Thread(target=self._core.run, args=(self.wake_fd,),
                                        name="phoenixft-log-executor", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        os.eventfd_write(self.wake_fd, 1)

    def dead(self) -> str | None:
        return None if self._thread.is_alive() else "the log executor thread ended"

    def stop(self, timeout_s: float = 10.0) -> None:
        _push_stop(self)
        self._thread.join(timeout_s)
        self._core = None  # it holds views of the ring's memory
        os.close(self.wake_fd)
        self.ring.close()


def _push_stop(ex) -> None:
    deadline = time.monotonic() + 5.0
    while not ex.ring.push(TASK_STOP, 0, b"") and ex.dead() is None:
        if time.monotonic() > deadline:
            break  # a stalled executor: the caller's wait times out and kills it
        time.sleep(0.005)  # the executor is making room in the ring
    ex.wake()


def start_executor(runner, log_dir: str | Path, ring_bytes: int = 16 << 20,
                   mode: str = "auto"):
    """`mode`: "process", "thread", or "auto" (a process for a host cache on x86-64)."""
    import platform

    if mode == "auto":
        host = runner.k_cache.device.type == "cpu"
        mode = "process" if host and platform.machine() in ("x86_64", "AMD64") else "thread"
    if mode not in ("process", "thread"):
        raise ValueError(f"log executor mode {mode!r}: use process, thread or auto")
    cls = ExecutorProcess if mode == "process" else ExecutorThread
    return cls(runner, log_dir, ring_bytes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="phoenixft's recovery-log executor (started by "
                                 "the serving engine, not by hand)")
    for name in ("--ring-fd", "--kv-fd", "--wake-fd", "--block-size", "--itemsize", "--parent"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--shape", required=True, help="layers,slots,elements per slot")
    args = ap.parse_args(argv)
    from phoenixft.platform import die_with_parent

    from .kv_slots import HostKV

    die_with_parent(args.parent)
    layers, nslots, per = (int(x) for x in args.shape.split(","))
    raw = np.memmap(f"/proc/self/fd/{args.kv_fd}", dtype=f"<u{args.itemsize}", mode="r+",
                    shape=(2, layers, nslots, per))
    ring = Ring.attach(args.ring_fd)
    LogExecutor(ring, args.log_dir, HostKV(raw[0], raw[1], args.block_size)).run(args.wake_fd)


if __name__ == "__main__":
    main()
