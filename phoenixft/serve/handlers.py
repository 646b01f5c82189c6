"""The OpenAI-compatible endpoints, one small handler each, over one engine thread.

Validation happens before a stream starts, so a streamed request that is refused still
gets a proper status code. A client that disconnects aborts its request (its blocks are
freed at the next engine step). A request the engine fails on gets a 500 in OpenAI's
shape (mid-stream: an ``error`` event, then ``[DONE]``); the other requests go on.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .api_errors import APIError, error_body
from .async_engine import AsyncEngine, EngineDead, RequestFailed
from .engine import LLMEngine, RequestOutput
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, _Common
from .sequence import Sequence


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_completion_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_completion_tokens}


class OpenAIHandlers:
    def __init__(self, engine: LLMEngine, runner: AsyncEngine, metrics: ServeMetrics,
                 model_dir: str | Path, name: str) -> None:
        self.engine, self.runner, self.metrics = engine, runner, metrics
        self.name = name
        self.aliases = {name, str(model_dir), str(Path(model_dir).resolve())}
        self.created = int(time.time())

    # -- shared steps ---------------------------------------------------------------------
    def _sequence(self, body: _Common, prompt: str | list[int], default_max: int | None,
                  add_special_tokens: bool = True) -> Sequence:
        if body.model not in self.aliases:
            raise APIError(404, f"the model {body.model!r} does not exist; this server "
                           f"serves {self.name!r}", "model_not_found", param="model")
        if not self.runner.alive:
            raise APIError(503, f"the engine stopped: {self.runner.error!r}", "engine_dead",
                           "server_error")
        try:
            ids = (self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                   if isinstance(prompt, str) else prompt)
            max_tokens = body.max_tokens
            if max_tokens is None:
                max_tokens = default_max or max(1, self.engine.max_model_len - len(ids))
            params = body.sampling_params(max_tokens)
            return self.engine.make_sequence(f"req-{uuid.uuid4().hex}", ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc

    async def _collect(self, request: Request, seq: Sequence, endpoint: str) -> RequestOutput:
        """Run to the end (non-streaming); abort if the client goes away meanwhile."""
        parts: list[str] = []
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in self.runner.generate(seq):
                parts.append(out.new_text)
                outs.append(out)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not consumer.done():  # the client left: cancelling aborts the request
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            self.metrics.requests.labels(endpoint, "aborted").inc()
            raise APIError(499, "client disconnected", "client_closed")
        try:
            consumer.result()
        except (EngineDead, RequestFailed) as exc:
            self.metrics.requests.labels(endpoint, "error").inc()
            raise APIError(500, str(exc), "engine_error", "server_error") from exc
        last = outs[-1]
        self._record(seq, last, endpoint)
        last.new_text = "".join(parts)
        return last

    def _record(self, seq: Sequence, last: RequestOutput, endpoint: str) -> None:
        m = self.metrics
        m.requests.labels(endpoint, "ok").inc()
        m.prompt_tokens.inc(last.num_prompt_tokens)
        m.gen_tokens.inc(last.num_completion_tokens)
        if seq.first_token_time is not None:
            m.ttft.observe(seq.first_token_time - seq.arrival_time)

    async def _stream(self, seq: Sequence, endpoint: str, chunk: Callable, include_usage: bool,
                      first: dict | None) -> AsyncIterator[str]:
        last, failed = None, False
        gen = self.runner.generate(seq)
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
                self._record(seq, last, endpoint)
                if include_usage:
                    usage = chunk(None, None) | {"usage": _usage(last)}
                    yield f"data: {json.dumps(usage)}\n\n"
        except (EngineDead, RequestFailed) as exc:
            failed = True
            self.metrics.requests.labels(endpoint, "error").inc()
            yield f"data: {json.dumps(error_body(str(exc), 'engine_error', 'server_error'))}\n\n"
        finally:
            await gen.aclose()  # aborts the request if the client went away mid-stream
            if not failed and (last is None or not last.finished):
                self.metrics.requests.labels(endpoint, "aborted").inc()
        yield "data: [DONE]\n\n"

    # -- endpoints ------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        seq = self._sequence(body, body.prompt, 16)
        rid, now = "cmpl-" + seq.seq_id[4:], int(time.time())

        def chunk(text, reason):
            choices = [] if text is None else [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
            return {"id": rid, "object": "text_completion", "created": now, "model": self.name,
                    "choices": choices}

        if body.stream:
            return StreamingResponse(self._stream(seq, "completions", chunk, body.include_usage,
                                                  None), media_type="text/event-stream")
        last = await self._collect(request, seq, "completions")
        return chunk(last.new_text, last.finish_reason) | {"usage": _usage(last)}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            text = self.engine.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template") from exc
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        seq = self._sequence(body, text, None, add_special_tokens=False)
        rid, now = "chatcmpl-" + seq.seq_id[4:], int(time.time())

        def chunk(delta, reason):
            choices = [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
            return {"id": rid, "object": "chat.completion.chunk", "created": now,
                    "model": self.name, "choices": choices}

        if body.stream:
            return StreamingResponse(
                self._stream(seq, "chat", chunk, body.include_usage,
                             {"role": "assistant", "content": ""}),
                media_type="text/event-stream")
        last = await self._collect(request, seq, "chat")
        return {"id": rid, "object": "chat.completion", "created": now, "model": self.name,
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": last.new_text},
                             "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": _usage(last)}

    async def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                            "created": self.created, "owned_by": "phoenixft",
                                            "max_model_len": self.engine.max_model_len}]}

    async def health(self):
        body = {"status": "ok" if self.runner.alive else "error",
                "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting)}
        if self.runner.error is not None:
            body["error"] = repr(self.runner.error)
        return JSONResponse(status_code=200 if self.runner.alive else 503, content=body)

    async def prometheus(self):
        return PlainTextResponse(generate_latest(self.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the ASGI server sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
