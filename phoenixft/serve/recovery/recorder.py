"""The engine's recovery log, decode-loop side: each step enqueues one task, the executor
(`executor.py`, a process of its own by default) writes it.

After every engine step, `end_step()` (cheap and never blocking) builds the epoch's task:
the KV slots written since their last record (the block manager's dirty map) and the
request-state delta (`regions.StateRegion`), and pushes it on the ring. The executor
captures those slots, appends the KV, STATE and COMMIT records to the log (`log.py`), and
publishes the epoch it processed; blocks freed by then leave the block manager's
quarantine.

Policies:
- steps that only decoded (no request came, went, was admitted or preempted since the last
  epoch) are merged into the next epoch until `epoch_interval_s` has passed since the last
  one: building and pushing an epoch costs the decode loop about 0.3 ms of Python, 5% of a
  6 ms decode step of a small model, and waking the executor as often costs it more. A
  step that admitted (prefilled), computed a chunk of a prompt, finished or preempted a
  request is recorded at once, so a crash never costs a prompt (nor a finished chunk of
  one); it may cost up to that interval of decoded tokens, which
  the successor decodes again (the same tokens: sampling is seeded per request, and the
  front sends each token index once). 0 records every step;
- ring full: the step is merged into the next one (its dirty slots and state delta stay
  pending; nothing is dropped, memory stays bounded by the ring and the live state);
- compaction: once `compact_bytes` have been logged since the last checkpoint, the next
  task is a full checkpoint (every live request's computed slots and whole state) written
  to a new segment; the older segments are deleted once it is committed;
- a failing log (a full disk, a dead executor) stops recording, says so (`on_error`),
  frees the quarantined blocks and lets serving go on: recovery is then off, never
  silently wrong.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from phoenixft.serve.engine.step_recorder import StepRecorder

from . import ring as R
from .executor import TASK_ADAPTER, TASK_EPOCH, TASK_START, epoch_task, start_executor
from .regions import StateRegion, dirty_ranges


@dataclass
class RecorderStats:
    epochs: int = 0
    coalesced: int = 0  # steps merged into the next because the ring was full
    merged: int = 0  # decode-only steps merged into the next within epoch_interval_s
    checkpoints: int = 0
    log_bytes: int = 0
    kv_slots: int = 0
    freed_bytes: int = 0
    executor_s: float = 0.0
    lag_max: int = 0  # most epochs the executor was behind
    errors: list[str] = field(default_factory=list)


MAX_RESTARTS = 3  # executors that may die before the log is given up (`_restart`)


class Recorder(StepRecorder):
    """The engine's `StepRecorder` (its guarantees are that class's docstring).

    `executor`: one started beforehand (`executor.start_executor`, when the engine is
    loaded), else one is started now, in `mode` ("auto", "process" or "thread")."""

    def __init__(self, engine, log_dir: str | Path, *, first_epoch: int = 0, first_seq: int = 0,
                 ring_bytes: int = 16 << 20, compact_bytes: int = 256 << 20,
                 on_error: Callable[[str], None] | None = None, executor=None,
                 mode: str = "auto", epoch_interval_s: float = 0.02,
                 on_restart: Callable[[str, int], None] | None = None) -> None:
        if not 0 <= epoch_interval_s <= 1:  # NaN fails too
            raise ValueError(f"epoch_interval_s={epoch_interval_s}: give 0 (an epoch every "
                             f"step) to 1 s")
        self.engine = engine
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.executor = executor or start_executor(engine.runner, self.dir, ring_bytes, mode)
        self.ring = self.executor.ring
        self.state = StateRegion()
        self.on_error = on_error or (lambda msg: None)
        # the executor died and a new one took the log over: (why, its pid)
        self.on_restart = on_restart or (lambda why, pid: None)
        self._mode, self._compact_bytes = mode, compact_bytes
        self.restarts = 0
        self.epoch = first_epoch  # the next epoch to enqueue
        self.failed: str | None = None
        self._coalesced = 0
        self._unpushed = False  # a step's work waits for room in the ring
        self._interval = epoch_interval_s
        self._merged = 0
        self._merge_pending = False  # merged steps not in an epoch yet
        self._last_epoch_t = 0.0  # monotonic time the last epoch was pushed
        self._shape: tuple | None = None  # which requests there were, then (`_decode_only`)
        self._lag_max = 0
        self._errors: list[str] = []
        self._want_full = True  # the first epoch of a writer is a full checkpoint
        self._adapters_pending: list[bytes] = []  # loaded, not yet on the ring
        engine.block_manager.hold_epoch = self.epoch
        start = json.dumps({"first_seq": first_seq, "compact_bytes": compact_bytes}).encode()
        if not self.ring.push(TASK_START, first_epoch, start):
            raise RuntimeError("the log executor's ring is not empty at start")
        self.executor.wake()

    @property
    def processed(self) -> int:
        """The newest epoch in the log (committed)."""
        return int(self.ring.control[R.PROCESSED])

    @property
    def stats(self) -> RecorderStats:
        c = self.ring.control
        return RecorderStats(int(c[R.EPOCHS]), self._coalesced, self._merged, int(c[R.CHECKPOINTS]),
                             int(c[R.LOG_BYTES]), int(c[R.KV_SLOTS]), int(c[R.FREED]),
                             int(c[R.EXEC_NS]) / 1e9, self._lag_max, list(self._errors))

    # -- the decode loop's side ------------------------------------------------------------
    def adapter_payload(self, adapter) -> bytes:
        """The log record of an adapter version, or ValueError when the ring could never
        carry it to the executor: such an adapter would be served but not logged, every
        later step would fail to push it, and a successor would come up without it. So
        it is refused before it is installed, naming its size and the limit."""
        meta = json.dumps({"name": adapter.name, "version": adapter.version,
                           "scale": adapter.scale}).encode()
        payload = len(meta).to_bytes(4, "little") + meta + adapter.to_bytes()
        limit = self.ring.max_payload
        if len(payload) > limit:
            raise ValueError(
                f"adapter {adapter.name!r} is {len(payload)} bytes ({len(payload) / 2**20:.1f} "
                f"MiB) as a log record, over the {limit} bytes ({limit / 2**20:.1f} MiB) the "
                "recovery log's ring can carry, so a crash could not restore it: start the "
                f"server with --recovery-ring-bytes {_mib_above(len(payload))} or more, or "
                "load an adapter of lower rank")
        return payload

    def log_adapter(self, payload: bytes) -> None:
        """An adapter version was loaded (`adapter_payload`): it is logged before any
        epoch that uses it."""
        self._adapters_pending.append(payload)
        self._push_adapters()

    def _push_adapters(self) -> bool:
        while self._adapters_pending:
            payload = self._adapters_pending[0]
            if not self.ring.push(TASK_ADAPTER, self.epoch, payload):
                return False
            self._adapters_pending.pop(0)
            self.executor.wake()
        return True

    def _check_executor(self, alive: bool = True) -> bool:
        """The executor's own error (in shared memory), and if `alive`, whether its process
        or thread still lives (a system call: asked before each epoch is pushed, not on the
        steps merged into one)."""
        msg = self.ring.error()
        if msg is None and alive:
            dead = self.executor.dead()
            if dead is not None:
                if self.restarts < MAX_RESTARTS and self._restart(dead):
                    return True
                msg = dead
        if msg is not None:
            self._fail(msg)
        return msg is None

    def check(self) -> None:
        """Between steps, while the engine idles: a dead executor is found (and replaced)
        now, not when the next request comes."""
        if self.failed is None:
            self._check_executor()

    def _restart(self, why: str) -> bool:
        """The executor died (a SIGKILL, the OOM killer) while the log itself is sound: a
        new executor takes it over, from its last commit (a torn tail cut off), numbering
        its records on from there; the next epoch is a full checkpoint (the epochs the dead
        one had not committed are in it) with the live adapters logged again. Said through
        `on_restart`. False when no executor could be started (then the log has failed)."""
        from .executor import start_executor
        from .log import cut_after_commit, replay

        try:
            self.executor.stop(timeout_s=1.0)
        except Exception:  # noqa: BLE001 - what is left of a dead executor
            pass
        try:
            rep = replay(self.dir)
            cut_after_commit(self.dir, rep)
            self.executor = start_executor(self.engine.runner, self.dir, self.ring.capacity,
                                           self._mode)
        except Exception as exc:  # noqa: BLE001 - then the log fails, and says why
            self._errors.append(f"restarting the log executor failed: {exc!r}")
            return False
        self.restarts += 1
        self.ring = self.executor.ring
        self.ring.control[R.PROCESSED] = rep.last_commit
        start = json.dumps({"first_seq": rep.next_seq,
                            "compact_bytes": self._compact_bytes}).encode()
        self.ring.push(TASK_START, self.epoch, start)
        self._want_full, self._unpushed = True, True
        # (the new executor holds no adapter's record: the checkpoint needs every version kept)
        self._adapters_pending = [self.adapter_payload(a)
                                  for a in self.engine.adapters.versions.values()]
        self.executor.wake()
        self.on_restart(f"{why}; a new one (pid {self.executor.pid}) took the log over from "
                        f"its last commit (epoch {rep.last_commit}), a full checkpoint next",
                        self.executor.pid)
        return True

    def _requests_shape(self) -> tuple:
        sch = self.engine.scheduler
        return tuple(self.engine.seqs), len(sch.waiting), sch.num_preemptions

    def _decode_only(self) -> bool:
        """Whether this step may be merged into the next epoch: nothing but decoding since
        the last epoch (the same requests, none admitted or preempted, no chunk of a
        prompt computed: a crash mid-prompt resumes at its last chunk), that epoch younger
        than the interval, nothing else waiting to be logged, requests still running."""
        return (self._interval > 0 and not self._unpushed and not self._want_full
                and not self.engine.step_prompt_tokens
                and not self._adapters_pending
                and time.monotonic() - self._last_epoch_t < self._interval
                and self._requests_shape() == self._shape
                and not self.ring.control[R.WANT_FULL] and self.engine.has_unfinished())

    def end_step(self, force: bool = False) -> None:
        eng, bm = self.engine, self.engine.block_manager
        if self.failed is not None or not self._check_executor(alive=False):
            return
        bm.release(self.processed)
        if not force and self._decode_only():
            self._merged += 1
            self._merge_pending = True  # this step's slots and tokens go with the next epoch
            return
        if not self._check_executor():
            return
        if not self._push_adapters():  # an epoch may use them: it waits for them
            self._coalesced += 1
            self._unpushed = True
            return
        full = self._want_full or bool(self.ring.control[R.WANT_FULL])
        waiting = [s.seq_id for s in eng.scheduler.waiting]
        running = [s.seq_id for s in eng.scheduler.running]
        if full:
            ranges = _live_ranges(eng.seqs.values(), bm.block_size)
            state = self.state.full(eng.seqs, waiting, running)
        else:
            ranges = dirty_ranges(bm.dirty)
            state = self.state.delta(eng.seqs, waiting, running)
        live = sorted({(s.adapter, s.adapter_version) for s in eng.seqs.values() if s.adapter}
                      | set(eng.adapters.current.items())) if full else []
        if not self.ring.push(TASK_EPOCH, self.epoch,
                              epoch_task(full, ranges, live, StateRegion.encode(state))):
            self._coalesced += 1  # kept for the next step: nothing is lost
            self._unpushed = True
            return
        self._unpushed = self._merge_pending = False
        self._last_epoch_t, self._shape = time.monotonic(), self._requests_shape()
        bm.take_dirty()
        self.state.recorded(eng.seqs, full=full)
        self._want_full = False
        self.epoch += 1
        bm.hold_epoch = self.epoch
        self._lag_max = max(self._lag_max, self.epoch - 1 - self.processed)
        self.executor.wake()

    def _fail(self, msg: str) -> None:
        self.failed = msg
        self._errors.append(msg)
        bm = self.engine.block_manager
        bm.hold_epoch = None
        bm.release(1 << 62)
        self.on_error(msg)

    # -- lifecycle -------------------------------------------------------------------------
    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every step so far is in the log (tests, clean shutdown): the
        enqueued epochs, and a step merged into a next one that never came (its push was
        refused by a full ring) is pushed once there is room."""
        deadline = time.monotonic() + timeout_s
        while ((self._unpushed or self._merge_pending or self.processed < self.epoch - 1)
               and self.failed is None and self._check_executor()):
            if self._unpushed or self._merge_pending:
                self.end_step(force=True)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)  # polling the executor's progress, bounded
        return self.failed is None

    def close(self) -> None:
        self.executor.stop()

    def summary(self) -> dict:
        s = self.stats
        return {"epochs": s.epochs, "coalesced": s.coalesced, "merged": s.merged,
                "checkpoints": s.checkpoints,
                "log_bytes": s.log_bytes, "kv_slots": s.kv_slots, "freed_bytes": s.freed_bytes,
                "executor_s": round(s.executor_s, 4), "lag_max": s.lag_max,
                "processed_epoch": self.processed, "failed": self.failed,
                "executor_pid": self.executor.pid}


def _mib_above(nbytes: int) -> str:
    """A ring size (for the flag) that holds a record of `nbytes`, in whole MiB."""
    return f"{(nbytes + R.RECORD_OVERHEAD) // 2**20 + 1}MiB"


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
