"""Finding stragglers: a rank that makes the others wait, step after step.

Every rank writes two figures of the step into its own slots of the step's one all-reduce
(`ReduceLayout.times` and `.stalls`), so every rank sees every rank's at no extra
collective: its time (from the step's start to ready to reduce, the part a slow GPU or a
noisy neighbour stretches, plus any freeze of its process since it was last ready: frozen
inside the previous step's all-reduce it held everyone up there) and its stalls (seconds
its whole process stood still in the step, `stall_clock.py`). `StragglerWatch` keeps,
per rank, its time over the median of the other ranks' times, and its stalls less the
others' median stall; both discount what every rank saw at once (the machine slowing or
pausing them all). A rank is flagged when, over the last `window` steps:

- slower: the lower quartile of its ratio reaches `ratio` (it was that much slower on
  three steps in four or more). A slow rank is slow on every step; a rank the machine
  slowed (a page fault, a neighbour's burst, the scheduler taking its core for a few
  steps) is not. The median, used before, named a rank slowed on half its window or
  more: twice in CI, on a 2-core machine running the test suite beside it (ratios 2.018
  and 2.036 at window 6, nobody slowed).
- stalled: its own freezes, on two steps or more, add up to `ratio - 1` times the
  others' time over the window (the job ran `ratio` times slower for them), wherever in
  the step they fell: a rank stopped for 150 ms of every 250 ms, frozen mostly while the
  others waited in the all-reduce, was never named by its compute time.

A flagged rank is reported once; it is reported again only after both have fallen back
(its median ratio below `ratio`: slower on fewer than half its steps; its stalls under
half the bar: steps `1 + (ratio - 1) / 2` times as long). One watch lives as long as a
generation: a new membership renumbers the ranks.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable

from phoenixft.cluster.policy import StragglerReport
from phoenixft.config import StragglerAction, Stragglers
from phoenixft.observe.events import EventLog
from phoenixft.train.stall_clock import StallClock


def _median_without(order: list[float], i: int) -> float:
    """The median of sorted `order` with its element `i` left out (O(1): every step
    computes one per rank, and a job may have thousands of ranks)."""
    m = len(order) - 1

    def at(k: int) -> float:
        return order[k] if k < i else order[k + 1]
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def lower_quartile(xs) -> float:
    """The value that a quarter of `xs` (rounded down) lie below: the 2nd smallest of 6,
    the 3rd of 10, the 6th of 20, the smallest of 3 or fewer."""
    return sorted(xs)[len(xs) // 4]


class StragglerWatch:
    """Per rank, its time over the median of the other ranks of its class (`classes`: the
    ranks that do the same work each step; default all of them: data parallelism), and
    its stalls beyond theirs."""

    def __init__(self, world_size: int, window: int, ratio: float,
                 classes: list[list[int]] | None = None) -> None:
        self.window, self.ratio = window, ratio
        self._ratios = [deque(maxlen=window) for _ in range(world_size)]
        # per step: (this rank's stall beyond the others' median, the others' median time)
        self._stalls = [deque(maxlen=window) for _ in range(world_size)]
        self.classes = classes if classes is not None else [list(range(world_size))]
        self.flagged: set[int] = set()
        self.why: dict[int, str] = {}  # a flagged rank: "slower" or "stalled"

    def observe(self, times: list[float], stalls: list[float] | None = None
                ) -> list[tuple[int, float]]:
        """One step's time per rank (and seconds each rank's process stood still, or
        None); returns the ranks newly found slow, each with the ratio that flagged it
        (`why` says which rule)."""
        if len(times) < 2 or len(times) != len(self._ratios):
            return []
        stalls = stalls if stalls is not None and len(stalls) == len(times) else [0.0] * len(times)
        for ranks in self.classes:
            if len(ranks) < 2:
                continue  # nobody to compare it with
            # once per class and step: each rank's "others" is it less one value
            order = sorted(times[r] for r in ranks)
            held = sorted(stalls[r] for r in ranks)
            for r in ranks:
                others = _median_without(order, bisect.bisect_left(order, times[r]))
                if others > 0:
                    self._ratios[r].append(times[r] / others)
                    froze = stalls[r] - _median_without(held, bisect.bisect_left(held, stalls[r]))
                    self._stalls[r].append((max(0.0, froze), others))
        found = []
        for r, hist in enumerate(self._ratios):
            if len(hist) < self.window:
                continue
            slower = lower_quartile(hist)
            stalled = self._stall_ratio(r)
            if r not in self.flagged and max(slower, stalled) >= self.ratio:
                self.flagged.add(r)
                self.why[r] = "slower" if slower >= self.ratio else "stalled"
                found.append((r, slower if slower >= self.ratio else stalled))
            elif r in self.flagged and statistics.median(hist) < self.ratio \
                    and stalled < 1 + (self.ratio - 1) / 2:
                # back below on half its steps, and its stalls under half the bar: the
                # quartile alone let a straggler whose every fourth step the machine evened
                # out be named again and again, and the bar alone a rank frozen on and off
                # (named at steps 14 and 16 of bench consensus's freeze mode)
                self.flagged.discard(r)
        return found

    def _stall_ratio(self, r: int) -> float:
        """How many times longer the window's steps took for rank `r`'s own freezes:
        (the others' time + its stalls) / the others' time; 1.0 unless it stalled on two
        steps or more (one freeze, a page-in or a pause, is not a straggler)."""
        hist = self._stalls[r]
        if sum(1 for froze, _ in hist if froze > 0) < 2:
            return 1.0
        base = sum(t for _, t in hist)
        return (base + sum(f for f, _ in hist)) / base if base > 0 else 1.0


class StragglerReporter:
    """The session's side: times this rank's compute of a step (`start` as the loop body
    begins, `compute_s` when the step is ready to reduce), slows it down when an injected
    `slow` fault fired on this worker, and on rank 0 reports the ranks `StragglerWatch`
    finds (`observe`, with every rank's time from the all-reduce)."""

    def __init__(self, cfg: Stragglers, events: EventLog) -> None:
        self.cfg, self.events = cfg, events
        self._t0 = time.perf_counter()
        self._ready: float | None = None  # when this rank was last ready to reduce
        self._ready_gen = -1  # in which generation
        self._carried = 0.0  # its stalls from then to this step's start
        self.stall_s = 0.0  # its stalls from then to ready to reduce now
        # (no thread when nothing is watched)
        self._clock = StallClock() if cfg.action is not StragglerAction.OFF else None
        self._watch: StragglerWatch | None = None
        self._gen = -1
        self.last_times: list[float] = []  # every rank's step time, the last step
        self.last_stalls: list[float] = []  # and its stalls
        # `rebalance`: the generation's per-rank weights once a straggler was found (every
        # rank computes them alike, from the same all-reduced times)
        self.weights: list[float] | None = None

    def weights_for(self, generation: int) -> list[float] | None:
        """`rebalance`'s weights if they were found in this generation (a new membership
        starts unweighted: its ranks are renumbered)."""
        return self.weights if generation == self._gen else None

    def start(self, generation: int = 0) -> None:
        """The loop body of a step of `generation` begins (a new generation forgets when
        this rank was last ready: what its recovery took is not a stall of a step)."""
        self._t0 = time.perf_counter()
        if generation != self._ready_gen:
            self._ready, self._ready_gen = None, generation
        self._carried = (self._clock.stalled_s(self._ready, self._t0)
                         if self._clock is not None and self._ready is not None else 0.0)

    def compute_s(self, slow_factor: float = 1.0, blocked_s: float = 0.0) -> float:
        """The step's time: seconds since `start`, less `blocked_s` spent waiting on other
        ranks inside the step (a pipeline stage on its neighbours), plus the seconds this
        process stood still since it was last ready to reduce (frozen in the last step's
        collectives it held the others up, not itself). Sets `stall_s`."""
        t = max(0.0, time.perf_counter() - self._t0 - blocked_s)
        if slow_factor > 1:  # an injected slow device: the same work, `factor` times longer
            time.sleep((slow_factor - 1) * t)
        now = time.perf_counter()
        if self._clock is not None:
            self.stall_s = self._clock.stalled_s(
                self._t0 if self._ready is None else self._ready, now)
        self._ready = now
        return max(0.0, now - self._t0 - blocked_s) + self._carried

    def stop(self) -> None:
        if self._clock is not None:
            self._clock.stop()

    def observe(self, *, rank: int, generation: int, members: dict[int, str], step: int,
                times: list[float], stalls: list[float] | None = None,
                classes: list[list[int]] | None = None,
                where: Callable[[int], str | None] | None = None) -> StragglerReport | None:
        """Rank 0: report the stragglers found now; returns the first of them as a swap
        request (`--straggler swap`), else None. `classes`: `StragglerWatch`'s; `where(r)`
        names rank r's place in the event (a pipeline's stage)."""
        self.last_times, self.last_stalls = times, stalls or []
        if self.cfg.action is StragglerAction.OFF or (
                rank != 0 and self.cfg.action is not StragglerAction.REBALANCE):
            return None
        if generation != self._gen:
            self._watch, self._gen = StragglerWatch(len(times), self.cfg.window,
                                                    self.cfg.ratio, classes), generation
            self.weights = None
        swap = None
        for r, ratio in self._watch.observe(times, stalls):
            if self.cfg.action is StragglerAction.REBALANCE and self.weights is None:
                # its microbatches take `ratio` times the others': it gets 1/ratio the share
                self.weights = [1.0] * len(times)
                self.weights[r] = 1.0 / ratio
            if rank != 0:
                continue
            found = StragglerReport(rank=r, wid=members[r], gen=generation, step=step,
                                    ratio=round(ratio, 3), window=self.cfg.window)
            place = where(r) if where is not None else None
            self.events.emit("straggler", **found.to_dict(), threshold=self.cfg.ratio,
                             why=self._watch.why[r],
                             action=self.cfg.action.value, **({"where": place} if place else {}))
            if self.cfg.action is StragglerAction.SWAP and swap is None:
                swap = found
        return swap
