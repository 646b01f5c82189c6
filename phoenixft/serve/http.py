"""OpenAI-compatible HTTP server (fastapi): completions, chat completions, models,
health, Prometheus metrics.

Errors follow OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: bad
JSON, wrong types and bad values are 400 ``invalid_request_error``, an unknown model is
404 ``model_not_found``, an engine failure 500. Validation happens before a stream
starts, so a streamed request that is refused still gets a proper status code. A client
that disconnects aborts its request (its blocks are freed at the next engine step).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from .async_engine import AsyncEngine, EngineDead
from .config import EngineConfig
from .engine import LLMEngine, RequestOutput
from .protocol import ChatCompletionRequest, CompletionRequest, _Common
from .sequence import Sequence


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str,
                 type_: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = (
            status, message, code, type_, param)


def _error(status: int, message: str, code: str, type_: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type_, "param": param, "code": code}})


class _Metrics:
    """Per-app registry (no process-global state), updated by handlers and engine thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("phoenixft_requests", "finished requests by endpoint and "
                                "outcome", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("phoenixft_prompt_tokens", "prompt tokens", registry=r)
        self.gen_tokens = Counter("phoenixft_generation_tokens", "generated tokens",
                                  registry=r)
        self.ttft = Histogram("phoenixft_time_to_first_token_seconds", "time to first token",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.running = Gauge("phoenixft_running_requests", "running sequences", registry=r)
        self.waiting = Gauge("phoenixft_waiting_requests", "waiting sequences", registry=r)
        self.kv_usage = Gauge("phoenixft_kv_cache_usage_ratio", "share of KV blocks in use",
                              registry=r)
        self.preemptions = Gauge("phoenixft_preemptions", "preemptions so far", registry=r)

    def on_step(self, engine: LLMEngine) -> None:
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_usage.set(engine.block_manager.usage)
        self.preemptions.set(engine.scheduler.num_preemptions)


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_completion_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_completion_tokens}


def build_app(model_dir: str | Path, config: EngineConfig | None = None,
              model_name: str | None = None) -> FastAPI:
    """Load the model and return the app; the engine thread runs while the app lives."""
    engine = LLMEngine(model_dir, config)
    name = model_name or Path(model_dir).resolve().name
    aliases = {name, str(model_dir), str(Path(model_dir).resolve())}
    metrics = _Metrics()
    runner = AsyncEngine(engine, on_step=metrics.on_step)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        runner.shutdown()

    app = FastAPI(title="phoenixft", lifespan=lifespan)
    app.state.engine, app.state.runner = engine, runner

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            return _error(400, "the request body is not valid JSON", "invalid_json")
        parts = []
        for e in errs[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        param = ".".join(str(x) for x in errs[0].get("loc", ()) if x != "body") if errs else None
        return _error(400, "invalid request: " + "; ".join(parts), "invalid_type",
                      param=param or None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.type, exc.param)

    def check(body: _Common, prompt: str | list[int], default_max: int | None,
              add_special_tokens: bool = True) -> Sequence:
        if body.model not in aliases:
            raise APIError(404, f"the model {body.model!r} does not exist; this server "
                           f"serves {name!r}", "model_not_found", param="model")
        if not runner.alive:
            raise APIError(503, f"the engine stopped: {runner.error!r}", "engine_dead",
                           "server_error")
        try:
            ids = (engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                   if isinstance(prompt, str) else prompt)
            max_tokens = body.max_tokens
            if max_tokens is None:
                max_tokens = default_max or max(1, engine.max_model_len - len(ids))
            params = body.sampling_params(max_tokens)
            return engine.make_sequence(f"req-{uuid.uuid4().hex}", ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc

    async def collect(request: Request, seq: Sequence, endpoint: str) -> RequestOutput:
        """Run to the end (non-streaming); abort if the client goes away meanwhile."""
        parts: list[str] = []
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in runner.generate(seq):
                parts.append(out.new_text)
                outs.append(out)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not consumer.done():  # the client left: cancelling aborts the request
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            metrics.requests.labels(endpoint, "aborted").inc()
            raise APIError(499, "client disconnected", "client_closed")
        try:
            consumer.result()
        except EngineDead as exc:
            metrics.requests.labels(endpoint, "error").inc()
            raise APIError(500, str(exc), "engine_error", "server_error") from exc
        last = outs[-1]
        record(seq, last, endpoint)
        last.new_text = "".join(parts)
        return last

    def record(seq: Sequence, last: RequestOutput, endpoint: str) -> None:
        metrics.requests.labels(endpoint, "ok").inc()
        metrics.prompt_tokens.inc(last.num_prompt_tokens)
        metrics.gen_tokens.inc(last.num_completion_tokens)
        if seq.first_token_time is not None:
            metrics.ttft.observe(seq.first_token_time - seq.arrival_time)

    async def stream(seq: Sequence, endpoint: str, chunk, include_usage: bool,
                     first: dict | None) -> AsyncIterator[str]:
        last, failed = None, False
        gen = runner.generate(seq)
        try:
            if first is not None:
                yield f"data: {json.dumps(chunk(first, None))}\n\n"
            async for out in gen:
                last = out
                if out.new_text or out.finished:
                    payload = chunk({"content": out.new_text} if first is not None
                                    else out.new_text, out.finish_reason)
                    yield f"data: {json.dumps(payload)}\n\n"
            if last is not None:
                record(seq, last, endpoint)
                if include_usage:
                    usage = chunk(None, None) | {"usage": _usage(last)}
                    yield f"data: {json.dumps(usage)}\n\n"
        except EngineDead as exc:
            failed = True
            metrics.requests.labels(endpoint, "error").inc()
            err = {"error": {"message": str(exc), "type": "server_error", "param": None,
                             "code": "engine_error"}}
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            await gen.aclose()  # aborts the request if the client went away mid-stream
            if not failed and (last is None or not last.finished):
                metrics.requests.labels(endpoint, "aborted").inc()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        seq = check(body, body.prompt, 16)
        rid, now = "cmpl-" + seq.seq_id[4:], int(time.time())

        def chunk(text, reason):
            choices = [] if text is None else [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
            return {"id": rid, "object": "text_completion", "created": now, "model": name,
                    "choices": choices}

        if body.stream:
            return StreamingResponse(stream(seq, "completions", chunk, body.include_usage,
                                            None), media_type="text/event-stream")
        last = await collect(request, seq, "completions")
        return chunk(last.new_text, last.finish_reason) | {"usage": _usage(last)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            text = engine.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template") from exc
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        seq = check(body, text, None, add_special_tokens=False)
        rid, now = "chatcmpl-" + seq.seq_id[4:], int(time.time())

        def chunk(delta, reason):
            choices = [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
            return {"id": rid, "object": "chat.completion.chunk", "created": now,
                    "model": name, "choices": choices}

        if body.stream:
            return StreamingResponse(
                stream(seq, "chat", chunk, body.include_usage,
                       {"role": "assistant", "content": ""}),
                media_type="text/event-stream")
        last = await collect(request, seq, "chat")
        return {"id": rid, "object": "chat.completion", "created": now, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": last.new_text},
                             "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": _usage(last)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "phoenixft",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if runner.alive else "error",
                "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting)}
        if runner.error is not None:
            body["error"] = repr(runner.error)
        return JSONResponse(status_code=200 if runner.alive else 503, content=body)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    return app


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the ASGI server sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
