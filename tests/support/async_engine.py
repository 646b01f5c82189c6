"""Test helper: runs an ``LLMEngine`` in one background thread and feeds asyncio consumers.

It was the server's engine loop before the engine moved into processes of its own
(`phoenixft.serve.server.engine_proc`, which applies the same failure rules); nothing in
phoenixft uses it now, and the tests use it to drive an in-process engine concurrently.

Why a thread: the engine is single-threaded and steps continuously while requests come
and go; HTTP handlers only tokenize/validate (``make_sequence``) and hand the sequence
over through a queue. Each request gets an ``asyncio.Queue`` of ``RequestOutput``s.

Failure rules (never silent):
- a step that raises is computed again one request at a time; a request that raises
  alone gets `RequestFailed` (its handler answers 500), the failure is logged and counted
  (`on_step_failure`), and the engine goes on serving every other request: one bad
  request never kills serving;
- `max_consecutive_failures` steps in a row that raise (the engine itself is broken, not
  one request), or an error outside a step, stop the thread: every pending request gets
  `EngineDead`, ``error`` is set and ``/health`` reports it with status 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from phoenixft.serve.engine.llm_engine import LLMEngine, RequestOutput
from phoenixft.serve.engine.sequence import Sequence
from phoenixft.serve.server.errors import EngineDead, RequestFailed

log = logging.getLogger("phoenixft.serve")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Any = None, on_step_failure: Any = None,
                 max_consecutive_failures: int = 3) -> None:
        self.engine = engine
        self.on_step = on_step  # called in the engine thread after each step (metrics)
        self.on_step_failure = on_step_failure  # (exception, failed request ids)
        self.max_consecutive_failures = max_consecutive_failures
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="phoenixft-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of ``seq`` until it finishes; aborts it if the consumer stops
        early (client disconnect, cancellation)."""
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._commands.put(("add", seq, (asyncio.get_running_loop(), q)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, (ValueError, RequestFailed)):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine failed: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(seq.seq_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def _deliver(self, request_id: str, item: Any) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            loop, q = sink
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody is waiting any more
                self._sinks.pop(request_id, None)
                self.engine.abort(request_id)

    def _drain_commands(self) -> None:
        while True:
            try:
                op, arg, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._sinks[arg.seq_id] = sink
                try:
                    self.engine.add_sequence(arg)
                except ValueError as exc:
                    self._deliver(arg.seq_id, exc)
                    self._sinks.pop(arg.seq_id, None)
            else:
                self.engine.abort(arg)
                self._sinks.pop(arg, None)

    def _step(self) -> None:
        """One engine step; a failure fails only the requests of that step."""
        try:
            outs = self.engine.step()
            self._consecutive_failures = 0
        except Exception as exc:
            self._consecutive_failures += 1
            if self._consecutive_failures >= self.max_consecutive_failures:
                raise
            outs, ids = self.engine.isolate_failed_step()
            log.exception("engine step failed; %d request(s) failed alone and were dropped, "
                          "serving goes on", len(ids))
            for rid in ids:
                self._deliver(rid, RequestFailed(f"the engine failed on this request: {exc!r}"))
                self._sinks.pop(rid, None)
            if self.on_step_failure is not None:
                self.on_step_failure(exc, ids)
        for out in outs:
            self._deliver(out.request_id, out)
            if out.finished:
                self._sinks.pop(out.request_id, None)

    def _run(self) -> None:
        self._consecutive_failures = 0
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._step()
                if self.on_step is not None:
                    self.on_step(self.engine)
        except BaseException as exc:  # surfaced to every waiter and to /health
            self.error = exc
            log.exception("engine thread failed; serving stops")
            for rid in list(self._sinks):
                self._deliver(rid, exc)
            self._sinks.clear()
