"""The OpenAI-compatible endpoints, one small handler each, over the request table of the
front (`remote.RemoteEngine`), which outlives any engine process.

Validation happens before a stream starts, so a refused streamed request still gets a
proper status code. A client that disconnects aborts its request. A request the engine
fails on gets a 500 in OpenAI's shape (mid-stream: an `error` event, then `[DONE]`); the
other requests go on. An engine crash is not seen by clients at all: the front keeps their
connections and continues every stream from the last token it sent.

Resumption after the whole server died (the run directory and the log survived):
- every response names its request (`X-Request-Id`) and every stream event carries the
  count of completion tokens sent so far as its SSE `id`; `GET /v1/streams/{id}` with a
  `Last-Event-ID` header continues that stream after that token;
- a request sent again with the same `Idempotency-Key` header gets the original request's
  completion (waiting for it if it is still running), computed once.
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
from .async_engine import EngineDead, RequestFailed
from .engine import RequestOutput
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, LoadAdapterRequest, _Common
from .remote import RemoteEngine
from .sequence import Sequence
from .spec import EngineSpec

_ENGINE_ERRORS = (EngineDead, RequestFailed)


def _usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_completion_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_completion_tokens}


class OpenAIHandlers:
    def __init__(self, spec: EngineSpec, backend: RemoteEngine, metrics: ServeMetrics,
                 model_dir: str | Path, name: str) -> None:
        self.spec, self.backend, self.metrics = spec, backend, metrics
        self.name = name
        self.aliases = {name, str(model_dir), str(Path(model_dir).resolve())}
        self.created = int(time.time())

    # -- shared steps ---------------------------------------------------------------------
    def _sequence(self, body: _Common, prompt: str | list[int], default_max: int | None,
                  add_special_tokens: bool = True) -> Sequence:
        adapter = body.model if body.model in self.backend.adapters else None
        if body.model not in self.aliases and adapter is None:
            raise APIError(404, f"the model {body.model!r} does not exist; this server "
                           f"serves {self.name!r} and the adapters "
                           f"{sorted(self.backend.adapters)}", "model_not_found", param="model")
        if not self.backend.alive:
            raise APIError(503, f"the engine stopped: {self.backend.error}", "engine_dead",
                           "server_error")
        try:
            ids = (self.spec.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                   if isinstance(prompt, str) else prompt)
            max_tokens = body.max_tokens
            if max_tokens is None:
                max_tokens = default_max or max(1, self.spec.max_model_len - len(ids))
            params = body.sampling_params(max_tokens)
            seq = self.spec.make_sequence(f"req-{uuid.uuid4().hex}", ids, params)
            if adapter is not None:  # pinned now: a resubmission after a crash keeps it
                seq.adapter, seq.adapter_version = adapter, self.backend.adapters[adapter]
            return seq
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc

    def _chunker(self, endpoint: str, rid: str) -> Callable:
        now = int(time.time())
        if endpoint == "chat":
            def chunk(delta, reason):
                choices = [] if delta is None else [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
                return {"id": "chatcmpl-" + rid[4:], "object": "chat.completion.chunk",
                        "created": now, "model": self.name, "choices": choices}
        else:
            def chunk(text, reason):
                choices = [] if text is None else [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
                return {"id": "cmpl-" + rid[4:], "object": "text_completion", "created": now,
                        "model": self.name, "choices": choices}
        return chunk

    def _result(self, endpoint: str, rid: str, text: str, last: RequestOutput) -> dict:
        if endpoint == "chat":
            return {"id": "chatcmpl-" + rid[4:], "object": "chat.completion",
                    "created": int(time.time()), "model": self.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": last.finish_reason}],
                    "usage": _usage(last)}
        return self._chunker(endpoint, rid)(text, last.finish_reason) | {"usage": _usage(last)}

    async def _collect(self, request: Request, outs: AsyncIterator[RequestOutput], rid: str,
                       endpoint: str) -> dict:
        """Run to the end (non-streaming); abort if the client goes away meanwhile."""
        parts: list[str] = []
        got: list[RequestOutput] = []

        async def consume() -> None:
            async for out in outs:
                parts.append(out.new_text)
                got.append(out)

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
        except _ENGINE_ERRORS as exc:
            self.metrics.requests.labels(endpoint, "error").inc()
            raise APIError(500, str(exc), "engine_error", "server_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc
        last = got[-1]
        self._record(last, endpoint)
        result = self._result(endpoint, rid, "".join(parts), last)
        self.backend.record_result(rid, result)
        return result

    def _record(self, last: RequestOutput, endpoint: str) -> None:
        m = self.metrics
        m.requests.labels(endpoint, "ok").inc()
        m.prompt_tokens.inc(last.num_prompt_tokens)
        m.gen_tokens.inc(last.num_completion_tokens)

    async def _stream(self, outs: AsyncIterator[RequestOutput], rid: str, endpoint: str,
                      include_usage: bool, opening: bool) -> AsyncIterator[str]:
        chunk = self._chunker(endpoint, rid)
        chat = endpoint == "chat"
        last, failed, parts = None, False, []
        try:
            if opening and chat:
                yield f"data: {json.dumps(chunk({'role': 'assistant', 'content': ''}, None))}\n\n"
            async for out in outs:  # one event per token (its id counts them), text or not
                last = out
                parts.append(out.new_text)
                payload = chunk({"content": out.new_text} if chat else out.new_text,
                                out.finish_reason)
                yield f"id: {out.num_completion_tokens}\ndata: {json.dumps(payload)}\n\n"
            if last is not None:
                self._record(last, endpoint)
                self.backend.record_result(rid, self._result(endpoint, rid, "".join(parts), last))
                if include_usage:
                    yield f"data: {json.dumps(chunk(None, None) | {'usage': _usage(last)})}\n\n"
        except (*_ENGINE_ERRORS, ValueError) as exc:
            failed = True
            self.metrics.requests.labels(endpoint, "error").inc()
            code, kind = (("invalid_value", "invalid_request_error") if isinstance(exc, ValueError)
                          else ("engine_error", "server_error"))
            yield f"data: {json.dumps(error_body(str(exc), code, kind))}\n\n"
        finally:
            await outs.aclose()  # aborts the request if the client went away mid-stream
            if not failed and (last is None or not last.finished):
                self.metrics.requests.labels(endpoint, "aborted").inc()
        yield "data: [DONE]\n\n"

    async def _serve(self, request: Request, seq: Sequence, endpoint: str, stream: bool,
                     include_usage: bool):
        key = request.headers.get("idempotency-key")
        if key is not None:
            rid = self.backend.by_key(key)
            if rid is not None and rid in self.backend.results and not stream:
                return JSONResponse(self.backend.results[rid], headers={"X-Request-Id": rid})
            if rid is not None and self.backend.find(rid) is not None:
                outs = self.backend.follow(rid, 0)
                return await self._respond(request, outs, rid, endpoint, stream, include_usage)
        rid = seq.seq_id
        outs = self.backend.generate(seq, endpoint, key)
        return await self._respond(request, outs, rid, endpoint, stream, include_usage)

    async def _respond(self, request: Request, outs, rid: str, endpoint: str, stream: bool,
                       include_usage: bool):
        headers = {"X-Request-Id": rid}
        if stream:
            return StreamingResponse(self._stream(outs, rid, endpoint, include_usage, True),
                                     media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(request, outs, rid, endpoint), headers=headers)

    # -- endpoints ------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        seq = self._sequence(body, body.prompt, 16)
        return await self._serve(request, seq, "completions", body.stream, body.include_usage)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            text = self.spec.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template") from exc
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        seq = self._sequence(body, text, None, add_special_tokens=False)
        return await self._serve(request, seq, "chat", body.stream, body.include_usage)

    async def resume_stream(self, request_id: str, request: Request):
        """Continue a stream after its last event the client saw (`Last-Event-ID`)."""
        p = self.backend.find(request_id)
        if p is None:
            raise APIError(404, f"no running request {request_id!r} (finished results are "
                           "returned to a retry with its Idempotency-Key)", "not_found",
                           param="request_id")
        after = request.headers.get("last-event-id", "0")
        if not after.isdigit():
            raise APIError(400, f"Last-Event-ID must be a token count, got {after!r}",
                           "invalid_value")
        outs = self.backend.follow(request_id, int(after))
        return StreamingResponse(self._stream(outs, request_id, p.endpoint, False, False),
                                 media_type="text/event-stream",
                                 headers={"X-Request-Id": request_id})

    async def load_lora_adapter(self, body: LoadAdapterRequest):
        """Load, or replace while serving, a LoRA-style adapter (vLLM's endpoint). Requests
        name it as their `model`; running requests keep the version they started with."""
        try:
            version = await self.backend.load_adapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_adapter", param="lora_path") from exc
        except (EngineDead, TimeoutError) as exc:
            raise APIError(503, str(exc), "engine_unavailable", "server_error") from exc
        return {"lora_name": body.lora_name, "version": version}

    async def models(self):
        base = {"object": "model", "created": self.created, "owned_by": "phoenixft",
                "max_model_len": self.spec.max_model_len}
        return {"object": "list", "data": [{"id": self.name, **base}] + [
            {"id": a, "parent": self.name, **base} for a in sorted(self.backend.adapters)]}

    async def health(self):
        st = self.backend.stats
        body = {"status": "ok" if self.backend.alive else "error",
                "running": st.get("running", 0), "waiting": st.get("waiting", 0)}
        if self.backend.error is not None:
            body["error"] = self.backend.error
        return JSONResponse(status_code=200 if self.backend.alive else 503, content=body)

    async def prometheus(self):
        self.metrics.update(self.backend)
        return PlainTextResponse(generate_latest(self.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the ASGI server sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
