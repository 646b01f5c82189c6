"""Time a worker's whole process stood still: SIGSTOP, a frozen container or VM, a swap
storm, a stop-the-world pause. A compute timer only sees such a freeze when it falls in
the step's compute; frozen while the step's all-reduce waits on it, a rank holds every
other rank up and its own compute time looks normal (a rank stopped for 150 ms of every
250 ms cut a job to a third of its speed and was never named).

`StallClock` runs one daemon thread that wakes every `tick_s` (25 ms) and records each gap
between two wake-ups longer than `gap_s` as a stall (its length less one tick). The
thread cannot run while its process is stopped, so a freeze of any length above `gap_s`
is seen (less up to one tick), wherever in the step it falls. Gaps shorter than `gap_s` (75 ms: the
scheduler giving the core to a neighbour, the GIL held a few ms) are not stalls. What every rank
saw at once (a pause of the whole machine) is discounted by the straggler watch, which
compares each rank's stalls with the other ranks'.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# the thread's wake-ups: 40 a second, about 4.5 ms of CPU a second (0.45% of a core) on this
# machine, where a thread's wake-up from time.sleep costs about 60 us (from Event.wait
# 110 us: a 10 ms tick on an Event cost 1.3% of a core)
TICK_S = 0.025
GAP_S = 0.075  # a gap longer than this between two wake-ups is a stall


class StallClock:
    def __init__(self, tick_s: float = TICK_S, gap_s: float = GAP_S) -> None:
        if not 0 < tick_s < gap_s:
            raise ValueError(f"StallClock needs 0 < tick_s < gap_s, got {tick_s}, {gap_s}")
        self.tick_s, self.gap_s = tick_s, gap_s
        self._stalls: deque[tuple[float, float]] = deque(maxlen=1024)  # (from, to), perf_counter
        self._lock = threading.Lock()
        self._last = time.perf_counter()  # the thread's last wake-up
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="phoenixft-stall-clock",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped:
            time.sleep(self.tick_s)
            now = time.perf_counter()
            with self._lock:
                if now - self._last > self.gap_s:
                    self._stalls.append((self._last + self.tick_s, now))
                self._last = now

    def stalled_s(self, start: float, end: float) -> float:
        """Seconds of stalls between `start` and `end` (perf_counter times), the one the
        thread has not woken from yet included (the process was just continued: the
        caller often runs before the thread)."""
        with self._lock:
            spans = list(self._stalls)
            if end - self._last > self.gap_s:
                spans.append((self._last + self.tick_s, end))
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)

    def stop(self, join_timeout_s: float = 1.0) -> None:
        self._stopped = True
        self._thread.join(join_timeout_s)
