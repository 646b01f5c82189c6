"""A process group's `Ledger`: what it carried over its whole life, so that a later
generation can tell whether the group may be kept as it is (`train/kept_groups.py`).

gloo and NCCL match operations by their order on a group, so a group is reusable only
when every member issued the same collectives and every send met its receive. A
collective that every member issued finishes, even when its waiters gave up on it (a
new plan interrupted them): the ledger learns it from the work itself (`watch_work`).
A member that left *before* issuing a collective its peers issued can still make the
group whole: it issues the missing ones (`drain`), with the same shapes, as recorded in
its peers' ledgers; their values are never read (the generation that issued them was
abandoned). Only `GroupOps` all-reduces record what they were; a group whose missing
collective was anything else is rebuilt.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist


class Waiter(Protocol):
    """What `Ledger.settle` waits with (`collectives.Interrupt`, which imports this module)."""

    def notify(self) -> None: ...

    def wait_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> None: ...


TAIL = 4  # the last collectives whose shapes a ledger keeps (how far a member may lag)
# works a ledger holds, at most, while their waits have not said they succeeded: past it
# the oldest are let go (their tensors with them) and the group can no longer be kept
MAX_OPEN = 4096


def succeeded(fut) -> bool:
    """Whether a finished future holds a value rather than an error."""
    try:
        fut.value()
        return True
    except Exception:
        return False


def watch_work(work, on_done: Callable[[], None]) -> None:
    """Call `on_done` once `work` has succeeded, without waiting for it here (a work its
    waiter no longer waits for: the generation was left)."""
    try:
        fut = work.get_future()
    except RuntimeError:  # gloo's point-to-point and reduce-scatter works
        def waited() -> None:
            try:
                work.wait()
            except Exception:
                return
            on_done()
        threading.Thread(target=waited, name="phoenixft-watch-work", daemon=True).start()
        return
    fut.add_done_callback(lambda f: on_done() if succeeded(f) else None)


def allreduce_shape(t: torch.Tensor, op) -> list:
    """What an all-reduce was, enough to issue a matching one: ["allreduce", numel,
    dtype, device type, op]."""
    return ["allreduce", t.numel(), str(t.dtype).removeprefix("torch."), t.device.type, str(op)]


class Ledger:
    """One process group's account (the module docstring). Counts are cumulative (the
    backend's sequence is); thread-safe."""

    def __init__(self) -> None:
        self.collectives = 0
        self.sent: dict[int, int] = {}  # group rank of the peer -> sends issued to it
        self.received: dict[int, int] = {}
        self.spoiled: str | None = None  # why the group can no longer be trusted
        self._open: dict[int, object] = {}  # the works not known to have succeeded, by id
        self._tail: deque = deque(maxlen=TAIL)  # (index, shape or None) of the last ones
        self.last_error = ""  # the last failed wait's error (why a work stays open)
        self._cond = threading.Condition()

    def issued(self, work, method: str = "collective", peer: int | None = None,
               shape: list | None = None) -> None:
        """`work` was issued (`shape`: what it was, when it can be issued again)."""
        with self._cond:
            if method == "send":
                self.sent[peer] = self.sent.get(peer, 0) + 1
            elif method == "recv":
                self.received[peer] = self.received.get(peer, 0) + 1
            else:
                self.collectives += 1
                self._tail.append((self.collectives, shape))
            self._open[id(work)] = work
            if len(self._open) > MAX_OPEN:  # works issued and never waited for
                self._open.pop(next(iter(self._open)))
                self.spoil(f"more than {MAX_OPEN} operations never waited for")

    def completed(self, work) -> Callable[[], None]:
        """The callback that marks `work` succeeded (`wait_work`'s `on_done`: the only
        proof; gloo's reduce-scatter never reports `is_completed`, a failed work does)."""
        key = id(work)

        def done() -> None:
            with self._cond:
                self._open.pop(key, None)
                self._cond.notify_all()
        return done

    def failed(self, why: str) -> None:
        """A wait gave up (the work stays open unless it succeeds later)."""
        self.last_error = why[:200]

    def spoil(self, why: str) -> None:
        """An operation failed as it was issued: the group cannot be trusted again."""
        if self.spoiled is None:
            self.spoiled = why[:200]

    def settle(self, interrupt: Waiter, timeout_s: float, what: str) -> None:
        """Wait for the works still open to finish; raises as a wait does
        (`Interrupt.wait_until`)."""
        with self._cond:
            pending = list(self._open.values())
        for w in pending:  # (wake the interrupt's waiter as each finishes)
            watch_work(w, lambda: interrupt.notify())
        interrupt.wait_until(lambda: not self._open, timeout_s, what)

    def summary(self) -> dict:
        """This member's account: `clean` when nothing failed and nothing is in flight;
        `tail`: the last collectives, [index, shape or None]."""
        with self._cond:
            clean = self.spoiled is None and not self._open
            return {"clean": clean, "spoiled": self.spoiled is not None,
                    "open": len(self._open), "collectives": self.collectives,
                    "tail": [list(x) for x in self._tail],
                    "sent": {str(k): v for k, v in self.sent.items()},
                    "received": {str(k): v for k, v in self.received.items()}}

    def why_not(self) -> str:
        """Why the group is not clean ("" when it is)."""
        s = self.summary()
        if s["clean"]:
            return ""
        return self.spoiled or (f"{s['open']} operation(s) never completed"
                                + (f" ({self.last_error})" if self.last_error else ""))


def agreement(summaries: list[dict]) -> dict[int, list[list]] | None:
    """Whether the members' ledgers (`Ledger.summary`, in group-rank order) can agree:
    None when not (one spoiled, a send its receiver never posted, a member further behind
    than the others' tails reach, or behind on a collective that cannot be issued
    again); otherwise the collectives each member behind must issue (`drain`), by group
    rank ({} when none is behind). Then every collective still open was issued by
    every member, so it finishes (`Ledger.settle`)."""
    if not summaries or any(s["spoiled"] for s in summaries):
        return None
    for a, s in enumerate(summaries):
        for b in range(len(summaries)):
            if s["sent"].get(str(b), 0) != summaries[b]["received"].get(str(a), 0):
                return None
    lo = min(s["collectives"] for s in summaries)
    top = max(s["collectives"] for s in summaries)
    shapes: dict[int, list] = {}
    for i in range(lo + 1, top + 1):  # the collectives some members have not issued
        told = [shape for s in summaries for index, shape in s["tail"] if index == i]
        if not told or told[0] is None or any(t != told[0] for t in told):
            return None  # beyond every tail, not issuable again, or told two ways
        shapes[i] = told[0]
    return {rank: [shapes[i] for i in range(s["collectives"] + 1, top + 1)]
            for rank, s in enumerate(summaries) if s["collectives"] < top}


def drain(pg: dist.ProcessGroup, ledger: Ledger, shapes: list[list]) -> None:
    """Issue the collectives `shapes` (`agreement`'s) on `pg`, of zeros: the peers' open
    ones meet them and finish. The caller waits (`Ledger.settle`)."""
    for kind, numel, dtype, device, op in shapes:
        assert kind == "allreduce", kind
        dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else \
            torch.device(device)
        t = torch.zeros(numel, dtype=getattr(torch, dtype), device=dev)
        red = next(o for o in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
                               dist.ReduceOp.PRODUCT) if str(o) == op)
        work = pg.allreduce([t], op=red)
        ledger.issued(work, shape=[kind, numel, dtype, device, op])
        watch_work(work, ledger.completed(work))
