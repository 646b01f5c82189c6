"""Finding stragglers: a rank that computes persistently slower than the others.

Every rank writes its compute time of the step (from the step's start to ready to reduce,
the part a slow GPU or a noisy neighbour stretches) into its own slot of the step's one
all-reduce (`ReduceLayout.times`), so every rank sees every rank's time at no extra
collective. `StragglerWatch` keeps, per rank, its time over the median of the other
ranks' times, and flags a rank once the lower quartile of that ratio over the last
`window` steps reaches `ratio`: the rank was that much slower on three steps in four or
more. A slow rank is slow on every step; a rank the machine slowed (a page fault, a
neighbour's burst, the scheduler taking its core for a few steps) is not. The median,
used before, named a rank slowed on half its window or more: twice in CI, on a 2-core machine
running the test suite beside it (ratios 2.018 and 2.036 at window 6, nobody slowed).
A flagged rank is reported once; it is reported again only after its median has been back
below the ratio (slower on fewer than half its steps). One watch lives as long as a
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
    ranks that do the same work each step; default all of them: data parallelism)."""

    def __init__(self, world_size: int, window: int, ratio: float,
                 classes: list[list[int]] | None = None) -> None:
        self.window, self.ratio = window, ratio
        self._ratios = [deque(maxlen=window) for _ in range(world_size)]
        self.classes = classes if classes is not None else [list(range(world_size))]
        self.flagged: set[int] = set()

    def observe(self, times: list[float]) -> list[tuple[int, float]]:
        """One step's compute time per rank; returns the ranks newly found slow, each
        with the median ratio that flagged it."""
        if len(times) < 2 or len(times) != len(self._ratios):
            return []
        for ranks in self.classes:
            if len(ranks) < 2:
                continue  # nobody to compare it with
            # once per class and step: each rank's "others" is it less one value
            order = sorted(times[r] for r in ranks)
            for r in ranks:
                others = _median_without(order, bisect.bisect_left(order, times[r]))
                if others > 0:
                    self._ratios[r].append(times[r] / others)
        found = []
        for r, hist in enumerate(self._ratios):
            if len(hist) < self.window:
                continue
            m = lower_quartile(hist)
            if m >= self.ratio and r not in self.flagged:
                self.flagged.add(r)
                found.append((r, m))
            elif r in self.flagged and statistics.median(hist) < self.ratio:
                # back below on half its steps: the quartile alone would let a straggler
                # whose every fourth step the machine evened out be named again and again
                self.flagged.discard(r)
        return found


class StragglerReporter:
    """The session's side: times this rank's compute of a step (`start` as the loop body
    begins, `compute_s` when the step is ready to reduce), slows it down when an injected
    `slow` fault fired on this worker, and on rank 0 reports the ranks `StragglerWatch`
    finds (`observe`, with every rank's time from the all-reduce)."""

    def __init__(self, cfg: Stragglers, events: EventLog) -> None:
        self.cfg, self.events = cfg, events
        self._t0 = time.perf_counter()
        self._watch: StragglerWatch | None = None
        self._gen = -1
        self.last_times: list[float] = []  # every rank's compute seconds, the last step
        # `rebalance`: the generation's per-rank weights once a straggler was found (every
        # rank computes them alike, from the same all-reduced times)
        self.weights: list[float] | None = None

    def weights_for(self, generation: int) -> list[float] | None:
        """`rebalance`'s weights if they were found in this generation (a new membership
        starts unweighted: its ranks are renumbered)."""
        return self.weights if generation == self._gen else None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def compute_s(self, slow_factor: float = 1.0, blocked_s: float = 0.0) -> float:
        """Seconds since `start`, less `blocked_s` spent waiting on other ranks inside the
        step (a pipeline stage on its neighbours)."""
        t = max(0.0, time.perf_counter() - self._t0 - blocked_s)
        if slow_factor > 1:  # an injected slow device: the same work, `factor` times longer
            time.sleep((slow_factor - 1) * t)
        return max(0.0, time.perf_counter() - self._t0 - blocked_s)

    def observe(self, *, rank: int, generation: int, members: dict[int, str], step: int,
                times: list[float], classes: list[list[int]] | None = None,
                where: Callable[[int], str | None] | None = None) -> StragglerReport | None:
        """Rank 0: report the stragglers found now; returns the first of them as a swap
        request (`--straggler swap`), else None. `classes`: `StragglerWatch`'s; `where(r)`
        names rank r's place in the event (a pipeline's stage)."""
        self.last_times = times
        if self.cfg.action is StragglerAction.OFF or (
                rank != 0 and self.cfg.action is not StragglerAction.REBALANCE):
            return None
        if generation != self._gen:
            self._watch, self._gen = StragglerWatch(len(times), self.cfg.window,
                                                    self.cfg.ratio, classes), generation
            self.weights = None
        swap = None
        for r, ratio in self._watch.observe(times):
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
                             action=self.cfg.action.value, **({"where": place} if place else {}))
            if self.cfg.action is StragglerAction.SWAP and swap is None:
                swap = found
        return swap
