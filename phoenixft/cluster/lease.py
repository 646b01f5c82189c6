"""Who leads: a lease in the store, so that another agent can take over when the leader's
node dies (possible only when the store runs on its own, `phoenixft store`).

The record `Keys.LEADER` names the holder and its term. The holder bumps
`leader_beat/{term}` every tick; every other agent watches that counter in its own
monotonic clock (no clocks are compared across machines). When it has not moved for
`timeout_s`, each follower tries `compare_set` from the record it last saw to itself with
the next term: exactly one wins. A holder that finds the record changed (it was stalled,
say SIGSTOPped, and someone took over) stops leading at once.
"""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist

from phoenixft.cluster.keys import Keys


class LeaderLease:
    def __init__(self, store: dist.Store, node: int, timeout_s: float) -> None:
        self.store = store
        self.node = node
        self.timeout_s = timeout_s
        self.term = -1  # the term this agent holds, -1 when it does not lead
        self._seen = b""  # the record last read
        self._beats = -1
        self._moved = time.monotonic()
        self._last_watch = 0.0

    def _record(self, term: int) -> bytes:
        return json.dumps({"node": self.node, "term": term, "pid": os.getpid()}).encode()

    def _try(self, expected: bytes, term: int) -> bool:
        mine = self._record(term)
        got = self.store.compare_set(Keys.LEADER, expected, mine)
        if got == mine:
            self.term = term
            return True
        self._seen = got
        return False

    def claim_first(self) -> bool:
        """At start: lead if nobody does yet (term 0)."""
        return self._try(b"", 0)

    def holder(self) -> dict | None:
        if not self.store.check([Keys.LEADER]):
            return None
        return json.loads(self.store.get(Keys.LEADER))

    def beat(self) -> bool:
        """Holder, every tick: True while the lease is still ours."""
        if self.store.get(Keys.LEADER) != self._record(self.term):
            self.term = -1
            return False
        self.store.add(Keys.leader_beat(self.term), 1)
        return True

    def watch(self) -> bool:
        """Follower, every tick: True once this agent took the lead over from a holder
        whose beat stopped for `timeout_s`."""
        if not self.store.check([Keys.LEADER]):
            return False
        record = self.store.get(Keys.LEADER)
        if record != self._seen:  # a new holder: start timing it afresh
            self._seen, self._beats, self._moved = record, -1, time.monotonic()
        term = json.loads(record)["term"]
        beats = self.store.add(Keys.leader_beat(term), 0)
        now = time.monotonic()
        if self._last_watch and now - self._last_watch > self.timeout_s / 2:
            self._moved = now  # this agent itself did not run: that is no sign of the leader
        self._last_watch = now
        if beats != self._beats:
            self._beats, self._moved = beats, now
            return False
        if now - self._moved < self.timeout_s:
            return False
        return self._try(record, term + 1)
