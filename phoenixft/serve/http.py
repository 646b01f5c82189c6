"""OpenAI-compatible HTTP server (fastapi): completions, chat completions, models,
health, Prometheus metrics. The handlers are in `handlers.py`, the error shape in
`api_errors.py`; this module only wires them to routes."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from . import api_errors
from .async_engine import AsyncEngine
from .config import EngineConfig
from .engine import LLMEngine
from .handlers import OpenAIHandlers
from .metrics import ServeMetrics


def build_app(model_dir: str | Path, config: EngineConfig | None = None,
              model_name: str | None = None) -> FastAPI:
    """Load the model and return the app; the engine thread runs while the app lives."""
    engine = LLMEngine(model_dir, config)
    metrics = ServeMetrics()
    runner = AsyncEngine(engine, on_step=metrics.on_step,
                         on_step_failure=lambda exc, ids: metrics.step_failures.inc())
    h = OpenAIHandlers(engine, runner, metrics, model_dir,
                       model_name or Path(model_dir).resolve().name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        runner.shutdown()

    app = FastAPI(title="phoenixft", lifespan=lifespan)
    app.state.engine, app.state.runner = engine, runner
    api_errors.install(app)
    app.post("/v1/completions")(h.completions)
    app.post("/v1/chat/completions")(h.chat_completions)
    app.get("/v1/models")(h.models)
    app.get("/health")(h.health)
    app.get("/metrics")(h.prometheus)
    return app
