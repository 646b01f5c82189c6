"""The front's view of its engine processes: the request table that lets a stream go on
across an engine crash, and across a restart of the whole server.

Every accepted request is kept here until it finishes: its validated sequence (prompt
ids, sampling parameters, the resolved seed), how many completion tokens its client has
been sent (`delivered`), and every output so far (`history`, for clients that reconnect).
Outputs carry their token index, so after a crash the front passes on only what its
client has not seen: the new engine regenerates the tokens after its last committed epoch
(sampling is a pure function of the seed, the index and the logits, so they are the same
tokens) and those already sent are dropped, with no gap and no duplicate.

When an engine becomes ready (at start or after a failover) it lists the requests it
resumed from the log; every other unfinished request (it arrived after the last commit)
is submitted to it again from scratch. With a run directory, each request is also written
there when accepted (`requests/<id>.json`) and its result when done, so that after the
whole server died a new front resubmits what no log holds, lets a client reconnect to a
stream by request id (`Last-Event-ID`), and answers a retried request with the same
`Idempotency-Key` from its stored result.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from phoenixft.serve.engine.config import SamplingParams
from phoenixft.serve.engine.llm_engine import RequestOutput
from phoenixft.serve.engine.sequence import Sequence
from phoenixft.serve.engine.spec import EngineSpec

from .errors import EngineDead, RequestFailed
from .messages import (
    Abort,
    AdapterLoaded,
    AdapterRefused,
    Add,
    Failed,
    Fatal,
    LoadAdapter,
    LogFailed,
    LogRestarted,
    Message,
    Outputs,
    Ready,
    Resumed,
)
from .store import RequestStore, key_id


@dataclass
class Pending:
    seq: Sequence
    endpoint: str = "completions"
    key: str | None = None
    body_sha: str | None = None  # what the key was used for (a retry must repeat it)
    delivered: int = 0  # completion tokens passed on to the client
    history: list[RequestOutput] = field(default_factory=list)
    finished: bool = False
    error: BaseException | None = None
    sent_pid: int | None = None  # the engine process it was last submitted to
    prompt_computed: dict[int, int] = field(default_factory=dict)  # engine pid -> tokens
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=list)


def _check_end(last: RequestOutput, after: int) -> None:
    """A stream that ended at `after` has nothing more to send; one that ended before it
    cannot continue after it (ValueError, the client's: it sent a wrong Last-Event-ID)."""
    if last.num_completion_tokens < after:
        raise ValueError(f"Last-Event-ID {after} is past the end of the stream: it ended "
                         f"after {last.num_completion_tokens} tokens")


class RemoteEngine:
    """What the HTTP handlers talk to: the request table in front of the engine processes."""

    def __init__(self, spec: EngineSpec, run_dir: str | Path | None,
                 store: RequestStore | None = None) -> None:
        self.spec = spec
        self.supervisor = None  # set by the app once started
        self.store = store or RequestStore(run_dir)
        self.pending: dict[str, Pending] = {}
        self.results: dict[str, dict] = {}  # finished requests' results, by id
        # idempotency key digest -> (request id, digest of the body it was sent with)
        self.keys: dict[str, tuple[str, str | None]] = {}
        self.stats: dict = {}
        self.recomputed_prompt_tokens = 0
        self.log_errors: list[str] = []  # the active engine's recovery log stopped working
        self.log_restarts: list[str] = []  # its executor died and a new one took over
        self.on_event: Callable[..., None] = lambda name, **fields: None
        self.adapters: dict[str, int] = {}  # name -> current version
        # load_adapter's token -> where its AdapterLoaded/AdapterRefused goes
        self._replies: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._restore_from_store()

    # -- state of the engine ------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.supervisor is not None and self.supervisor.error is None

    @property
    def error(self) -> str | None:
        return None if self.supervisor is None else self.supervisor.error

    def start(self) -> None:  # the supervisor runs on its own threads
        pass

    def shutdown(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()

    # -- requests ---------------------------------------------------------------------------
    def _submit(self, p: Pending) -> None:
        s = p.seq
        sup = self.supervisor
        p.sent_pid = sup.active.pid if sup is not None and sup.active is not None else None
        if sup is not None:
            sup.send(Add(s.seq_id, s.prompt_token_ids, s.params, s.seed, s.adapter,
                         s.adapter_version))

    def admit(self, seq: Sequence, endpoint: str, key: str | None = None,
              body_sha: str | None = None) -> Pending:
        p = Pending(seq, endpoint, key, body_sha)
        with self._lock:
            self.pending[seq.seq_id] = p
            if key is not None:
                self.keys[key_id(key)] = (seq.seq_id, body_sha)
        self.store.accepted(p)
        self._submit(p)
        return p

    async def load_adapter(self, name: str, path: str, replace: bool = False,
                           timeout_s: float = 120.0) -> int:
        """Ask the active engine to load (or, `replace`, replace) an adapter; its new
        version."""
        token = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._replies[token] = (loop, fut)
        try:
            if not self.supervisor.send(LoadAdapter(name, path, replace, token)):
                raise EngineDead("no engine is running")
            msg: AdapterLoaded | AdapterRefused = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(token, None)
        if isinstance(msg, AdapterRefused):
            raise ValueError(msg.error)
        self.adapters[name] = msg.version
        return msg.version

    def find(self, rid: str) -> Pending | None:
        return self.pending.get(rid)

    def by_key(self, key: str) -> tuple[str, str | None] | None:
        """The request an Idempotency-Key was used for, and the digest of its body."""
        return self.keys.get(key_id(key))

    async def generate(self, seq: Sequence, endpoint: str = "completions",
                       key: str | None = None,
                       body_sha: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error}")
        p = self.admit(seq, endpoint, key, body_sha)
        async for out in self.follow(p.seq.seq_id, 0):
            yield out

    async def follow(self, rid: str, after: int) -> AsyncIterator[RequestOutput]:
        """The outputs of `rid` with an index above `after`: the history first, then live
        ones as they come. Aborts the request if the consumer stops early. A stream that
        ends at or before `after` (the client claims more than it has) ends here too: at
        once if it ends at `after`, with a ValueError naming both if before."""
        p = self.pending.get(rid)
        if p is None:
            raise KeyError(rid)
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            backlog = [o for o in p.history if o.num_completion_tokens > after]
            ended = p.history[-1] if p.finished and p.history and not backlog else None
            p.waiters.append((loop, q))
        done = False
        try:
            for out in backlog:
                yield out
                if out.finished:
                    done = True
                    return
            while True:
                item = ended or await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.num_completion_tokens <= after:
                    if item.finished:
                        done = True
                        _check_end(item, after)
                        return
                    continue
                after = item.num_completion_tokens
                yield item
                if item.finished:
                    done = True
                    return
        finally:
            with self._lock:
                if (loop, q) in p.waiters:
                    p.waiters.remove((loop, q))
            if not done and not p.waiters and not p.finished:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        with self._lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            self._forget(p)
            if self.supervisor is not None:
                self.supervisor.send(Abort(rid))

    def _forget(self, p: Pending) -> None:
        """A request that ends without a result: its record and its key go (a retry with
        that key is a new request; a restarted server does not resubmit it)."""
        self.store.discard(p.seq.seq_id)
        if p.key is not None and self.keys.get(key_id(p.key), (None,))[0] == p.seq.seq_id:
            del self.keys[key_id(p.key)]

    # -- from the engine processes (supervisor threads) -------------------------------------
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, Outputs):
            if msg.stats is not None:
                self.stats = msg.stats
            for out in msg.outs:
                self._deliver(out.request_id, out)
        elif isinstance(msg, Failed):
            err = (ValueError if msg.client else RequestFailed)(msg.error)
            for rid in msg.ids:
                self._fail(rid, err)
        elif isinstance(msg, (AdapterLoaded, AdapterRefused)):
            loop, fut = self._replies.get(msg.token, (None, None))
            if fut is not None:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(msg))
        elif isinstance(msg, LogRestarted):  # said where people look; logging goes on
            self.log_restarts.append(msg.error)
            self.on_event("log_executor_restarted", error=msg.error, pid=msg.pid)
            print(f"phoenixft serve: the recovery log's executor died: {msg.error}",
                  file=sys.stderr, flush=True)
        elif isinstance(msg, LogFailed):  # the engine serves on, but a crash now would lose work
            self.log_errors.append(msg.error)
            self.on_event("log_failed", error=msg.error)
        elif isinstance(msg, Fatal):
            for rid in list(self.pending):
                self._fail(rid, RequestFailed(f"the engine failed: {msg.error}"))

    def on_lost(self, error: str) -> None:
        """No engine serves any more (`--no-recovery` and the engine died, or no standby
        could take over): every request in flight ends at once with the error (they
        waited forever, and /health counted them as running)."""
        self.stats = {}
        for rid in list(self.pending):
            self._fail(rid, EngineDead(f"the engine stopped: {error}"))

    def _deliver(self, rid: str, out: RequestOutput) -> None:
        with self._lock:
            p = self.pending.get(rid)
            if p is None:
                return
            pid = self.supervisor.active.pid if self.supervisor and self.supervisor.active else 0
            p.prompt_computed[pid] = out.prompt_computed
            if out.num_completion_tokens <= p.delivered:
                return  # regenerated after a recovery: the client has it already
            p.delivered = out.num_completion_tokens
            p.history.append(out)
            if out.finished:
                p.finished = True
                self._count_recompute(p)
            waiters = list(p.waiters)
        for loop, q in waiters:
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _count_recompute(self, p: Pending) -> None:
        over = sum(p.prompt_computed.values()) - p.seq.num_prompt_tokens
        if over > 0:
            self.recomputed_prompt_tokens += over

    def _fail(self, rid: str, err: BaseException) -> None:
        with self._lock:
            p = self.pending.pop(rid, None)
        if p is None:
            return
        p.error = err
        self._forget(p)
        for loop, q in list(p.waiters):
            loop.call_soon_threadsafe(q.put_nowait, err)

    def on_ready(self, ready: Ready, timing: dict) -> None:
        """An engine took over: tokens the log holds that no client got yet are delivered
        (the dead engine may have committed a step it never sent), and requests it did not
        resume are submitted to it again."""
        resumed = {r.id: r for r in ready.resumed}
        self.stats = {}  # the dead engine's figures are not the new one's
        # what the new engine holds, not what the dead one did: an adapter the log could
        # not restore is not listed, nor offered to requests
        self.adapters = dict(ready.adapters)
        for token, (loop, fut) in list(self._replies.items()):  # asked of an engine that died
            loop.call_soon_threadsafe(lambda f=fut, t=token: f.done() or f.set_result(
                AdapterRefused(t, "the engine restarted before it answered; load the adapter "
                               "again")))
        with self._lock:
            for r in ready.resumed:
                if r.id not in self.pending:
                    self._adopt(r)  # the whole server restarted: its history from the log
            todo = [p for rid, p in self.pending.items()
                    if rid not in resumed and not p.finished and p.sent_pid != ready.pid]
        for r in ready.resumed:
            self._catch_up(r)
        for p in todo:
            p.history = [o for o in p.history]  # kept: indices dedupe the regenerated ones
            self._submit(p)

    def _catch_up(self, r: Resumed) -> None:
        """Deliver the resumed request's logged tokens beyond what its clients got (the
        indices dedupe the rest), with the text the engine emitted for each."""
        text = self.spec.tokenizer.decode(r.completion)
        prev = 0
        for i, (tok, emitted) in enumerate(zip(r.completion, r.emitted), start=1):
            self._deliver(r.id, RequestOutput(r.id, [tok], text[prev:emitted], False, None,
                                              r.prompt_tokens, i))
            prev = emitted

    def _adopt(self, r: Resumed) -> None:
        """A request the log resumed whose front died with the server: registered again
        (`_catch_up` then fills its history from the log), so its client can reconnect
        where it stopped."""
        rec = self._records.get(r.id, {})
        params = SamplingParams(**rec["params"]) if "params" in rec else SamplingParams()
        seq = Sequence(seq_id=r.id, token_ids=[0] * r.prompt_tokens + r.completion,
                       num_prompt_tokens=r.prompt_tokens, params=params,
                       seed=rec.get("seed", 0))
        p = Pending(seq, rec.get("endpoint", "completions"), rec.get("key"), rec.get("body_sha"))
        self.pending[r.id] = p
        if p.key:
            self.keys[key_id(p.key)] = (r.id, p.body_sha)

    def _restore_from_store(self) -> None:
        """After a restart: finished results (for idempotent retries) and the unfinished
        requests no log may hold (they are resubmitted once an engine is ready)."""
        self._records = {r["id"]: r for r in self.store.load()}
        for rid, rec in self._records.items():
            if rec.get("key"):
                self.keys[key_id(rec["key"])] = (rid, rec.get("body_sha"))
            if "result" in rec:
                self.results[rid] = rec["result"]
                continue
            params = SamplingParams(**rec["params"])
            seq = Sequence(seq_id=rid, token_ids=list(rec["prompt"]),
                           num_prompt_tokens=len(rec["prompt"]), params=params, seed=rec["seed"],
                           adapter=rec.get("adapter"), adapter_version=rec.get("adapter_version", 0))
            self.pending[rid] = Pending(seq, rec["endpoint"], rec.get("key"), rec.get("body_sha"))

    def record_result(self, rid: str, result: dict) -> None:
        """A request finished: its result is kept for retries (within the store's
        retention limits; the oldest beyond them are dropped here)."""
        self.results[rid] = result
        with self._lock:
            p = self.pending.pop(rid, None)
        for old, key in self.store.finished(rid, p.key if p else None, result):
            self.results.pop(old, None)
            if key is not None and self.keys.get(key, (None,))[0] == old:
                del self.keys[key]
