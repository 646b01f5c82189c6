"""Heartbeats: the only way to see a hung (SIGSTOPped, deadlocked) or lost worker or node.

Two levels, so the job store carries one beat a node, not one a worker:
- a worker beats a counter in its node's shared memory (`HeartbeatSender`, a file of 8
  bytes under `hb_dir`); its agent reads them (`file_counters`) and reports a worker
  whose counter stood still for the heartbeat timeout (a hang report, `ReportKind.HANG`);
- each agent beats its node's add-counter in the store (`Keys.node_beat`); the leader
  reads them all in two requests (`store_counters`) and takes a silent node's workers for
  lost (its host died, or its agent hung).

A monitor remembers, in its own monotonic clock, when each counter last moved. No clocks
are compared across machines.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.cluster.protocol import file_report

Counters = Callable[[list[str]], dict[str, int]]  # ids -> the counters that exist now


def beats_dir(shm_dir: str | Path) -> Path:
    """Where a node's workers beat: under its shared-memory directory."""
    return Path(shm_dir) / "hb"


class _FileCounter:
    """An 8-byte counter in a file of the node's shared memory."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.n = 0

    def bump(self) -> None:
        self.n += 1
        os.pwrite(self.fd, self.n.to_bytes(8, "little"), 0)


class HeartbeatSender:
    """A daemon thread that bumps each worker's counter in `hb_dir` (the node's shared
    memory) every `interval_s`: one worker (a training process) or several (the control
    plane benchmark's hollow members)."""

    def __init__(self, hb_dir: str | Path, wid: str | list[str], interval_s: float) -> None:
        wids = [wid] if isinstance(wid, str) else list(wid)
        Path(hb_dir).mkdir(parents=True, exist_ok=True)
        self._counters = {w: _FileCounter(Path(hb_dir) / w) for w in wids}
        for c in self._counters.values():
            c.bump()  # it exists, and beats, from here on
        self._interval = interval_s
        self._stop = threading.Event()
        self.beats = 0  # bumps made, all workers together
        self._thread = threading.Thread(target=self._run, name=f"phoenixft-hb-{wids[0]}",
                                        daemon=True)

    def start(self) -> HeartbeatSender:
        self._thread.start()
        return self

    def silence(self, wid: str) -> None:
        """Stop beating for `wid` (a hung worker, as the benchmark makes one)."""
        self._counters.pop(wid, None)

    def _run(self) -> None:
        while not self._stop.is_set() and self.beat_once():
            self._stop.wait(self._interval)

    def beat_once(self) -> bool:
        """Bump every worker's counter once (what the thread does each interval; the
        benchmark's hollow processes call it for all their nodes from one thread). False
        once the node's shared memory is gone (the job is over)."""
        try:
            for c in list(self._counters.values()):
                c.bump()
                self.beats += 1
        except OSError:
            return False
        return True

    def stop(self, join_timeout_s: float = 0.0) -> None:
        self._stop.set()
        if join_timeout_s:
            self._thread.join(join_timeout_s)


def file_counters(hb_dir: str | Path) -> Counters:
    """Read workers' counters from `hb_dir` (the agent's side of `HeartbeatSender`)."""
    fds: dict[str, int] = {}

    def read(wids: list[str]) -> dict[str, int]:
        out = {}
        for w in wids:
            if w not in fds:
                try:
                    fds[w] = os.open(Path(hb_dir) / w, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # not started beating yet
            out[w] = int.from_bytes(os.pread(fds[w], 8, 0), "little")
        return out
    return read


def store_counters(store: dist.Store, key: Callable[[str], str]) -> Counters:
    """Read add-counters from the store: two requests however many (one check finds them
    all, since each is created when its writer registers; key by key only while one is
    missing), then one multi_get."""
    def read(ids: list[str]) -> dict[str, int]:
        keys = [key(i) for i in ids]
        present = ids if store.check(keys) else [i for i, k in zip(ids, keys)
                                                 if store.check([k])]
        if not present:
            return {}
        values = store.multi_get([key(i) for i in present])
        return {i: int(v.decode()) for i, v in zip(present, values)}
    return read


def node_counters(store: dist.Store) -> Counters:
    """The agents' node beats (`Keys.node_beat`), by node number as a string."""
    return store_counters(store, lambda k: Keys.node_beat(int(k)))


class HeartbeatMonitor:
    """Tracks when each watched counter last changed; reports the stale ones."""

    def __init__(self, read: Counters, stall_s: float = 1.0, every_s: float = 0.0) -> None:
        self._read = read
        self._last: dict[str, tuple[int, float]] = {}
        self._stall_s = stall_s
        self._every_s = every_s  # read the counters at most this often (a heartbeat period)
        self._last_poll = 0.0

    def watch(self, wid: str) -> None:
        self._last.setdefault(wid, (-1, time.monotonic()))

    def forget(self, wid: str) -> None:
        self._last.pop(wid, None)

    def watching(self, wid: str) -> bool:
        return wid in self._last

    def poll(self) -> None:
        """Read the counters. Time the monitor itself did not run (its process starved of
        CPU, or the store behind it stalled) is not counted as silence: on an overloaded
        machine that would declare healthy workers hung all at once."""
        now = time.monotonic()
        gap = now - self._last_poll if self._last_poll else 0.0
        if self._last_poll and gap < self._every_s:
            return  # a counter cannot have moved twice: the caller ticks faster than beats
        self._last_poll = now
        if gap > self._stall_s:
            self._last = {w: (n, t + gap) for w, (n, t) in self._last.items()}
        if not self._last:
            return
        for w, n in self._read(list(self._last)).items():
            if n != self._last[w][0]:
                self._last[w] = (n, now)

    def silent_for(self, wid: str) -> float:
        return time.monotonic() - self._last[wid][1]

    def last_beat_wall(self, wid: str) -> float:
        """Wall-clock estimate of the last beat (for detect_s of a hang)."""
        return time.time() - self.silent_for(wid)

    def stale(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        return [w for w, (_, t) in self._last.items() if now - t > timeout_s]


class NodeLiveness:
    """An agent's side of the heartbeats (`launch/agent.py`, and the control plane
    benchmark's hollow agents): every tick, beat the node's counter in the store once a
    heartbeat period, and report each of its workers whose own counter (in the node's
    shared memory) stood still for the heartbeat timeout (`ReportKind.HANG`: the leader
    fences and replaces it). A worker is watched from its first beat on (its imports may
    take longer than the timeout), and reported once."""

    def __init__(self, node: int, shm_dir: str | Path, timeouts) -> None:
        self.node = node
        self.beats = beats_dir(shm_dir)
        self.timeouts = timeouts
        self.monitor = HeartbeatMonitor(file_counters(self.beats),
                                        every_s=timeouts.heartbeat_interval_s)
        self._beat_t = 0.0
        self.due = False  # this tick beat: the agent's other store reads are due too
        self._hung: set[str] = set()

    def tick(self, store: dist.Store, live: list[str]) -> list[str]:
        """`live`: the node's workers that have not exited. Returns those reported hung."""
        t = self.timeouts
        self.due = time.monotonic() - self._beat_t >= t.heartbeat_interval_s
        if self.due:
            store.add(Keys.node_beat(self.node), 1)
            self._beat_t = time.monotonic()
        for w in live:
            if not self.monitor.watching(w) and w not in self._hung \
                    and (self.beats / w).exists():
                self.monitor.watch(w)
        self.monitor.poll()
        hung = self.monitor.stale(t.heartbeat_timeout_s)
        for w in hung:
            self._hung.add(w)
            file_report(store, {"kind": ReportKind.HANG, "wid": w,
                                "t": self.monitor.last_beat_wall(w),
                                "detail": "heartbeat silent (hung)"})
            self.monitor.forget(w)
        return hung

    def forget(self, wid: str) -> None:
        """`wid` exited (its exit is reported instead)."""
        self.monitor.forget(wid)
