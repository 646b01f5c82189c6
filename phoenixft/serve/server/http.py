"""`phoenixft serve`: an OpenAI-compatible HTTP front (fastapi) over supervised engine
processes. The front validates and tokenizes requests, keeps their connections and their
request table (`remote.py`); the engines run in child processes, one active and one warm
standby (`supervisor.py`), the active one keeping a recovery log outside itself
(`recorder.py`, `log.py`) from which the standby takes its requests over when it dies.
The handlers are in `handlers.py`, the error shape in `errors.py`; this module wires
them to routes and to the run directory (`status.json`, `events.jsonl`), and bounds what a
client can make the front hold (`limits.py`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import threading
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path

from fastapi import FastAPI

from phoenixft.observe.events import EventLog, write_json_atomic
from phoenixft.serve.engine.config import EngineConfig
from phoenixft.serve.engine.loader import weight_files
from phoenixft.serve.engine.spec import EngineSpec

from . import errors
from .handlers import OpenAIHandlers
from .janitor import start_janitor
from .limits import DEFAULT_MAX_BODY, DEFAULT_READ_TIMEOUT_S, BodyLimit
from .messages import Ready
from .metrics import ServeMetrics
from .remote import RemoteEngine
from .stale_logs import claim
from .store import DEFAULT_KEEP, DEFAULT_KEEP_S, RequestStore
from .supervisor import EngineSupervisor, make_socket_dir

MIN_RING_BYTES = 1 << 20


def default_log_dir(run_dir: str | Path | None) -> Path:
    """Host shared memory; the same directory for the same run directory, so a restarted
    server finds the log its predecessor left."""
    tag = (hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
           if run_dir else uuid.uuid4().hex[:12])
    return Path("/dev/shm") / f"phoenixft-serve-{tag}"


def build_app(model_dir: str | Path, config: EngineConfig | None = None,
              model_name: str | None = None, *, run_dir: str | Path | None = None,
              log_dir: str | Path | None = None, threads: int | None = None,
              ring_bytes: int = 16 << 20, compact_bytes: int = 256 << 20,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
              read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, keep_finished: int = DEFAULT_KEEP,
              keep_finished_s: float = DEFAULT_KEEP_S, recovery: bool = True) -> FastAPI:
    """Validate the model (config, tokenizer, that the weights files are readable; the
    engines load the weights) and the limits, and return the app; the engine processes run
    while the app lives (`app.state.supervisor.start()`, or the app's startup), and
    `app.state.cleanup()` (or the app's shutdown) stops them and removes what the front
    made. Everything is validated before anything is created (ValueError)."""
    config = config or EngineConfig()
    spec = EngineSpec(model_dir, config)
    weight_files(model_dir)
    if max_body_bytes < 1:
        raise ValueError(f"--max-request-body {max_body_bytes}: give at least 1 byte")
    if not read_timeout_s > 0:
        raise ValueError(f"--request-read-timeout {read_timeout_s}: give a number of seconds > 0")
    if ring_bytes < MIN_RING_BYTES:
        raise ValueError(f"--recovery-ring-bytes {ring_bytes}: give at least {MIN_RING_BYTES} "
                         f"({MIN_RING_BYTES >> 20} MiB): one step's log record must fit it")
    store = RequestStore(run_dir, keep=keep_finished, keep_s=keep_finished_s)
    metrics = ServeMetrics(model_name or Path(model_dir).resolve().name)
    backend = RemoteEngine(spec, run_dir, store)
    # What this front makes and nothing may outlive (with a run dir, the log is kept for a
    # restarted server to resume from, unless the stop is clean): the janitor removes it
    # after the front's exit, however it exits; a clean stop removes it itself.
    sock_dir = make_socket_dir()
    work_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="phoenixft-serve-run-"))
    log = Path(log_dir) if log_dir else default_log_dir(run_dir)
    owned = [sock_dir] + ([] if run_dir else [str(work_dir), str(log)])
    janitor = start_janitor(owned)
    claim(log, run_dir)  # (`stale_logs.py`: a later server names it once this front is gone)
    events = EventLog(work_dir / "events.jsonl", role="front")
    backend.on_event = events.emit
    supervisor = EngineSupervisor(model_dir, asdict(config), log, work_dir, threads=threads,
                                  on_message=backend.on_message,
                                  on_ready=lambda ready, timing: _on_ready(ready, timing),
                                  emit=events.emit, ring_bytes=ring_bytes,
                                  compact_bytes=compact_bytes, sock_dir=sock_dir,
                                  recovery=recovery)
    backend.supervisor = supervisor
    supervisor.on_change = lambda: status()
    supervisor.on_lost = backend.on_lost
    h = OpenAIHandlers(spec, backend, metrics, model_dir,
                       model_name or Path(model_dir).resolve().name)

    status_lock = threading.Lock()

    def status() -> None:
        # Two threads rewrite it (a failover, a standby saying hello): under one lock, so
        # the file ends with the state read last, never with an older one written later.
        with status_lock:
            write_json_atomic(work_dir / "status.json", {
                "front_pid": os.getpid(), **supervisor.pids(), "crashes": supervisor.crashes,
                "log_dir": str(log), "model": str(model_dir), "error": supervisor.error,
                "janitor_pid": janitor.pid})

    def _on_ready(ready: Ready, timing: dict) -> None:
        backend.on_ready(ready, timing)
        events.emit("engine_ready", pid=ready.pid, resumed=len(ready.resumed),
                    report=ready.report, **timing)
        status()

    cleaned = threading.Event()

    def cleanup() -> None:
        """Stop the engines; remove the log (a clean stop: nothing is left to resume) and
        what only this front used. Idempotent."""
        if cleaned.is_set():
            return
        cleaned.set()
        supervisor.stop()
        events.emit("stopped", crashes=supervisor.crashes)
        status()
        for path in [str(log), *owned]:
            shutil.rmtree(path, ignore_errors=True)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await asyncio.to_thread(supervisor.start)
        except BaseException:
            cleanup()
            raise
        yield
        cleanup()

    app = FastAPI(title="phoenixft", lifespan=lifespan)
    app.state.spec, app.state.backend, app.state.supervisor = spec, backend, supervisor
    app.state.log_dir = log
    app.state.cleanup = cleanup
    errors.install(app)
    if api_key:
        errors.require_key(app, api_key)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
    app.post("/v1/completions")(h.completions)
    app.post("/v1/chat/completions")(h.chat_completions)
    app.get("/v1/streams/{request_id}")(h.resume_stream)
    app.post("/v1/load_lora_adapter")(h.load_lora_adapter)
    app.get("/v1/models")(h.models)
    app.get("/health")(h.health)
    app.get("/metrics")(h.prometheus)
    return app
