"""Heartbeats: the only way to see a hung (SIGSTOPped, deadlocked) or lost worker.

Senders bump an add-counter; the monitor remembers, in its own monotonic clock, when
each counter last moved. No clocks are compared across machines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from phoenixft.cluster.keys import Keys


class HeartbeatSender:
    """A daemon thread that bumps ``hb/{wid}`` every `interval_s` on its own connection,
    for one worker (a training process) or several (the control-plane benchmark's hollow
    members: one add per worker still, as from separate processes)."""

    def __init__(self, connect: Callable[[], dist.Store], wid: str | list[str],
                 interval_s: float) -> None:
        self._connect = connect
        wids = [wid] if isinstance(wid, str) else list(wid)
        self._keys = {w: Keys.heartbeat(w) for w in wids}
        self._interval = interval_s
        self._stop = threading.Event()
        self.beats = 0  # adds made, all workers together
        self._thread = threading.Thread(target=self._run, name=f"phoenixft-hb-{wids[0]}",
                                        daemon=True)

    def start(self) -> HeartbeatSender:
        self._thread.start()
        return self

    def silence(self, wid: str) -> None:
        """Stop beating for `wid` (a hung worker, as the benchmark makes one)."""
        self._keys.pop(wid, None)

    def _run(self) -> None:
        store = self._connect()
        while not self._stop.is_set():
            try:
                for key in list(self._keys.values()):
                    store.add(key, 1)
                    self.beats += 1
            except Exception:  # the store is gone: the job is over, the agent will reap us
                return
            self._stop.wait(self._interval)

    def stop(self, join_timeout_s: float = 0.0) -> None:
        self._stop.set()
        if join_timeout_s:
            self._thread.join(join_timeout_s)


class HeartbeatMonitor:
    """Tracks when each watched counter last changed; reports the stale ones."""

    def __init__(self, store: dist.Store, stall_s: float = 1.0, every_s: float = 0.0) -> None:
        self._store = store
        self._last: dict[str, tuple[int, float]] = {}
        self._stall_s = stall_s
        self._every_s = every_s  # read the counters at most this often (a heartbeat period)
        self._last_poll = 0.0

    def watch(self, wid: str) -> None:
        self._last.setdefault(wid, (-1, time.monotonic()))

    def forget(self, wid: str) -> None:
        self._last.pop(wid, None)

    def poll(self) -> None:
        """Read the counters. Time the monitor itself did not run (its process starved of
        CPU, or the store behind it stalled) is not counted as silence: on an overloaded
        machine that would declare healthy workers hung all at once."""
        now = time.monotonic()
        gap = now - self._last_poll if self._last_poll else 0.0
        if self._last_poll and gap < self._every_s:
            return  # a counter cannot have moved twice: the leader ticks faster than beats
        self._last_poll = now
        if gap > self._stall_s:
            self._last = {w: (n, t + gap) for w, (n, t) in self._last.items()}
        if not self._last:
            return
        wids = list(self._last)
        keys = [Keys.heartbeat(w) for w in wids]
        # Two requests whatever the job's size: every counter exists from its worker's
        # registration on (`protocol.register_worker`), so one check finds them all; key
        # by key (a request each) only while one does not (a worker of an older version)
        present = (wids if self._store.check(keys)
                   else [w for w, k in zip(wids, keys) if self._store.check([k])])
        if not present:
            return
        values = self._store.multi_get([Keys.heartbeat(w) for w in present])
        for w, v in zip(present, values):
            n = int(v.decode())
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
