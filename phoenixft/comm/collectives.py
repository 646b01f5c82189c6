"""Fault-tolerant waits: every collective and every blocking setup call has a deadline
and is abandoned as soon as the leader publishes a newer generation.

gloo raises at once when a peer process dies ("Connection closed by peer"), but a hung
peer (SIGSTOP, a deadlock) blocks its partners for gloo's own timeout (30 minutes by
default). So we never call ``work.wait()`` bare: we wait on the work's future *or* the
generation watcher, whichever fires first, bounded by a deadline we choose.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from phoenixft.comm.ledger import Ledger, allreduce_shape, succeeded
from phoenixft.torch_internals import all_gather_base

T = TypeVar("T")


class CommFailure(RuntimeError):
    """A collective failed or missed its deadline: a peer died, hung or left."""


class GenerationChanged(CommFailure):
    """The leader published a newer generation while we were waiting."""


class Interrupt:
    """Wakes every waiter of this process when the leader announces a generation newer
    than the one this process is in. Carrying the generation number (rather than a bare
    flag) means a late announcement of a generation we already joined wakes nobody."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.current = -1
        self.announced = -1

    def enter(self, generation: int) -> None:
        with self.cond:
            self.current = generation

    def announce(self, generation: int) -> None:
        with self.cond:
            self.announced = max(self.announced, generation)
            self.cond.notify_all()

    def is_set(self) -> bool:
        return self.announced > self.current

    def wait_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Block until done() is true; raise GenerationChanged or CommFailure otherwise."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not done():
                if self.is_set():
                    raise GenerationChanged(f"{what}: generation {self.announced} was published")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommFailure(f"{what}: no progress within {timeout_s:.1f}s deadline")
                self.cond.wait(left)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


def wait_work(work, interrupt: Interrupt, timeout_s: float, what: str = "collective",
              on_done: Callable[[], None] | None = None) -> None:
    """Wait for a c10d Work: returns when it completed, raises CommFailure otherwise.
    `on_done` is called once the work has succeeded, even after this wait gave up on it
    (a `Ledger` learns that an abandoned collective did finish).

    Collectives expose a future we can subscribe to; gloo's point-to-point works and its
    reduce-scatter do not ("getFuture not implemented"; the latter never reports
    `is_completed` either, and ignores a timeout given to `wait`), so those are waited on
    by a helper thread."""
    try:
        fut = work.get_future()
    except RuntimeError:
        def waited() -> None:
            work.wait()
            if on_done is not None:
                on_done()
        call_with_deadline(waited, interrupt, timeout_s, what)
        return

    def done(f) -> None:
        interrupt.notify()
        if on_done is not None and succeeded(f):
            on_done()
    fut.add_done_callback(done)
    interrupt.wait_until(fut.done, timeout_s, what)
    try:
        work.wait()
    except Exception as exc:  # gloo: "Connection closed by peer", "Read error", timeouts
        raise CommFailure(f"{what} failed: {exc}") from exc


class Pending:
    """A blocking call (process-group construction, say) running in a daemon thread; its
    result is waited for with `result`, which gives up on a newer generation or a deadline.
    An abandoned call is left to fail on its own timeout; its result is dropped."""

    def __init__(self, fn: Callable[[], T], interrupt: Interrupt, what: str) -> None:
        self._box: dict = {}
        self._interrupt, self.what = interrupt, what
        self._lock = threading.Lock()
        self._release: Callable[[T], None] | None = None  # set by `discard`
        self.took_s: float | None = None  # how long `fn` ran, once it returned
        t0 = time.monotonic()

        def run() -> None:
            try:
                value = fn()
                self.took_s = time.monotonic() - t0
                with self._lock:
                    release = self._release
                    if release is None:
                        self._box["value"] = value
                if release is not None:
                    release(value)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._box["error"] = exc
            finally:
                interrupt.notify()

        threading.Thread(target=run, name=f"phoenixft-{what}", daemon=True).start()

    def discard(self, release: Callable[[T], None]) -> None:
        """Nobody will take the result: `release(value)` it now if it came, or when it
        comes (a process group built for a generation that was superseded is aborted)."""
        with self._lock:
            self._release = release
            value = self._box.pop("value", None)
        if value is not None:
            release(value)

    def result(self, timeout_s: float):
        box = self._box
        self._interrupt.wait_until(lambda: "value" in box or "error" in box, timeout_s,
                                   self.what)
        if "error" in box:
            raise CommFailure(f"{self.what} failed: {box['error']}") from box["error"]
        return box["value"]


def call_with_deadline(fn: Callable[[], T], interrupt: Interrupt, timeout_s: float,
                       what: str) -> T:
    """Run a blocking call in a daemon thread (`Pending`) and wait for it."""
    return Pending(fn, interrupt, what).result(timeout_s)


class GroupOps:
    """A generation's process group whose every operation has a deadline and gives up
    when a newer generation is announced (raising `CommFailure` / `GenerationChanged`).

    The one way training and recovery code talks over a group, so no call can forget
    the deadline (a bare `work.wait()` on gloo waits 30 minutes for a hung peer).
    `ledger` keeps the group's account across the generations that use it."""

    def __init__(self, pg: dist.ProcessGroup, interrupt: Interrupt, timeout_s: float,
                 ledger: Ledger | None = None) -> None:
        self.pg = pg
        self.interrupt = interrupt
        self.timeout_s = timeout_s
        self.ledger = ledger or Ledger()

    def wait(self, work, what: str) -> None:
        try:
            wait_work(work, self.interrupt, self.timeout_s, what,
                      on_done=self.ledger.completed(work))
        except CommFailure as exc:
            self.ledger.failed(str(exc))
            raise

    def _issued(self, work, method: str = "collective", peer: int | None = None):
        self.ledger.issued(work, method, peer)
        return work

    def allreduce(self, t, what: str, op=None):
        self.allreduce_start(t, what, op)()
        return t

    def allreduce_start(self, t, what: str, op=None) -> Callable[[], None]:
        """`allreduce`, issued now; returns the wait (which raises as it would)."""
        op = op or dist.ReduceOp.SUM
        work = self.pg.allreduce([t], op=op)
        self.ledger.issued(work, shape=allreduce_shape(t, op))
        return lambda: self.wait(work, what)

    def all_gather_into(self, out, t, what: str):
        """`out` = the concatenation of every member's `t` (in rank order)."""
        self.all_gather_start(out, t, what)()
        return out

    def all_gather_start(self, out, t, what: str) -> Callable[[], None]:
        """`all_gather_into`, issued now; returns the wait (which raises as it would)."""
        if self.pg.size() == 1:  # gloo's all-gather of one member took 2.3 ms for 6.8 MB
            out.copy_(t.reshape(out.shape))  # here, against 0.25 ms for this copy
            return lambda: None
        work = self._issued(all_gather_base(self.pg, out, t.contiguous()))
        return lambda: self.wait(work, what)

    def broadcast(self, t, src: int, what: str):
        self.wait(self._issued(self.pg.broadcast(t, src)), what)
        return t

    def send(self, t, dst: int, tag: int, what: str) -> None:
        self.wait(self._issued(self.pg.send([t], dst, tag), "send", dst), what)

    def recv(self, t, src: int, tag: int, what: str):
        self.wait(self._issued(self.pg.recv([t], src, tag), "recv", src), what)
        return t

    def barrier(self, what: str) -> None:
        self.allreduce(torch.zeros(1), what)
