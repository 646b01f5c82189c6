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
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from phoenixft.serve.engine.adapters import check_adapter_name
from phoenixft.serve.engine.llm_engine import RequestOutput
from phoenixft.serve.engine.sequence import Sequence
from phoenixft.serve.engine.spec import EngineSpec

from .errors import APIError, EngineDead, RequestFailed, error_body
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, LoadAdapterRequest, _Common
from .remote import RemoteEngine
from .shapes import ResponseShapes, usage

_ENGINE_ERRORS = (EngineDead, RequestFailed)


class OpenAIHandlers(ResponseShapes):
    def __init__(self, spec: EngineSpec, backend: RemoteEngine, metrics: ServeMetrics,
                 model_dir: str | Path, name: str) -> None:
        self.spec, self.backend, self.metrics = spec, backend, metrics
        self.name = name
        self.aliases = {name, str(model_dir), str(Path(model_dir).resolve())}
        self.created = int(time.time())

    # -- shared steps ---------------------------------------------------------------------
    def _checked(self, body: _Common) -> None:
        """400 for fields we do not honour (named) and values no request may have."""
        bad = body.unsupported_fields()
        if bad:
            raise APIError(400, f"unsupported field{'s' if len(bad) > 1 else ''}: "
                           f"{', '.join(bad)} (this server would not honour "
                           f"{'them' if len(bad) > 1 else 'it'}; remove "
                           f"{'them' if len(bad) > 1 else 'it'})", "unsupported_field",
                           param=bad[0])
        try:
            body.check()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc

    def _sequences(self, body: _Common, prompts: list[str | list[int]], default_max: int | None,
                   add_special_tokens: bool = True) -> list[Sequence]:
        """One sequence per prompt and choice (choice index = prompt index * n + i)."""
        adapter = body.model if body.model in self.backend.adapters else None
        if body.model not in self.aliases and adapter is None:
            raise APIError(404, f"the model {body.model!r} does not exist; this server "
                           f"serves {self.name!r} and the adapters "
                           f"{sorted(self.backend.adapters)}", "model_not_found", param="model")
        if not self.backend.alive:
            raise APIError(503, f"the engine stopped: {self.backend.error}", "engine_dead",
                           "server_error")
        seqs = []
        try:
            for prompt in prompts:
                ids = (self.spec.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                       if isinstance(prompt, str) else prompt)
                max_tokens = body.max_tokens
                if max_tokens is None:
                    max_tokens = default_max or max(1, self.spec.max_model_len - len(ids))
                for i in range(body.n):
                    seq = self.spec.make_sequence(f"req-{uuid.uuid4().hex}", ids,
                                                  body.sampling_params(max_tokens, i))
                    if adapter is not None:  # pinned now: a resubmission after a crash keeps it
                        seq.adapter = adapter
                        seq.adapter_version = self.backend.adapters[adapter]
                    seqs.append(seq)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc
        return seqs

    async def _collect(self, request: Request, streams: list[AsyncIterator[RequestOutput]],
                       endpoint: str, t0: float) -> list[list[RequestOutput]]:
        """Run every choice to its end (non-streaming); abort all if the client goes away."""
        got: list[list[RequestOutput]] = [[] for _ in streams]

        async def consume(i: int, outs: AsyncIterator[RequestOutput]) -> None:
            t_first = None
            async for out in outs:
                t_first = t_first or time.monotonic()
                got[i].append(out)
            if got[i]:
                self.metrics.finished(endpoint, got[i][-1], t0, t_first, time.monotonic())

        consumer = asyncio.ensure_future(asyncio.gather(
            *(consume(i, s) for i, s in enumerate(streams))))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not consumer.done():  # the client left: cancelling aborts the requests
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            self.metrics.outcome(endpoint, "aborted")
            raise APIError(499, "client disconnected", "client_closed")
        try:
            consumer.result()
        except _ENGINE_ERRORS as exc:
            self.metrics.outcome(endpoint, "error")
            raise APIError(500, str(exc), "engine_error", "server_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc
        return got

    async def _stream(self, outs: AsyncIterator[RequestOutput], rid: str, endpoint: str,
                      include_usage: bool, opening: bool, t0: float, index: int = 0,
                      echo: str = "", ids: bool = True,
                      record: str | None = None) -> AsyncIterator[str]:
        """One choice's events (with `id:` token counts when it is the only choice)."""
        chunk = self._chunker(endpoint, rid)
        chat = endpoint == "chat"
        last, failed, got, t_first = None, False, [], None
        try:
            if opening and chat:
                yield f"data: {json.dumps(chunk({'role': 'assistant', 'content': ''}, None, index))}\n\n"
            if echo:
                yield f"data: {json.dumps(chunk(echo, None, index))}\n\n"
            async for out in outs:  # one event per token (its id counts them), text or not
                t_first = t_first or time.monotonic()
                last = out
                got.append(out)
                payload = chunk({"content": out.new_text} if chat else out.new_text,
                                out.finish_reason, index,
                                self._logprobs(endpoint, [out], len(echo)))
                tag = f"id: {out.num_completion_tokens}\n" if ids else ""
                yield f"{tag}data: {json.dumps(payload)}\n\n"
            if last is not None:
                self.metrics.finished(endpoint, last, t0, t_first, time.monotonic())
                self.backend.record_result(record or rid, self._result(
                    endpoint, rid, [self._choice(endpoint, 0, got, echo)], [last], 1))
                if include_usage:
                    yield f"data: {json.dumps(chunk(None, None) | {'usage': usage(last)})}\n\n"
        except (*_ENGINE_ERRORS, ValueError) as exc:
            failed = True
            self.metrics.outcome(endpoint, "error")
            code, kind = (("invalid_value", "invalid_request_error") if isinstance(exc, ValueError)
                          else ("engine_error", "server_error"))
            yield f"data: {json.dumps(error_body(str(exc), code, kind))}\n\n"
        finally:
            await outs.aclose()  # aborts the request if the client went away mid-stream
            if not failed and (last is None or not last.finished):
                self.metrics.outcome(endpoint, "aborted")

    async def _sse(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async for e in events:
            yield e
        yield "data: [DONE]\n\n"

    async def _merged(self, streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
        """The events of several choices as they come, then one [DONE]."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(s: AsyncIterator[str]) -> None:
            try:
                async for e in s:
                    await q.put(e)
            finally:
                await q.put(None)

        tasks = [asyncio.ensure_future(pump(s)) for s in streams]
        try:
            left = len(tasks)
            while left:
                e = await q.get()
                if e is None:
                    left -= 1
                else:
                    yield e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        yield "data: [DONE]\n\n"

    async def _serve(self, request: Request, seqs: list[Sequence], endpoint: str,
                     body: _Common, echoes: list[str] | None = None):
        t0 = time.monotonic()
        key = request.headers.get("idempotency-key")
        echoes = echoes or [""] * len(seqs)
        if len(seqs) > 1:
            if key is not None:
                raise APIError(400, "Idempotency-Key is supported for requests with one choice "
                               "(one prompt, n=1)", "unsupported_header", param="Idempotency-Key")
            return await self._serve_many(request, seqs, endpoint, body, echoes, t0)
        sha = None
        if key is not None:
            sha = _body_sha(endpoint, body)
            rid, was = self.backend.by_key(key) or (None, None)
            if rid is not None and was is not None and was != sha:
                shown = key if len(key) <= 64 else key[:64] + "..."
                raise APIError(422, f"Idempotency-Key {shown!r} was already used for request "
                               f"{rid} with a different body; a retry must send the same "
                               "body, a new request needs a new key",
                               "idempotency_key_reused", param="Idempotency-Key")
            if rid is not None and rid in self.backend.results and not body.stream:
                return JSONResponse(self.backend.results[rid], headers={"X-Request-Id": rid})
            if rid is not None and self.backend.find(rid) is not None:
                outs = self.backend.follow(rid, 0)
                return await self._respond(request, outs, rid, endpoint, body, echoes[0], t0)
        rid = seqs[0].seq_id
        outs = self.backend.generate(seqs[0], endpoint, key, sha)
        return await self._respond(request, outs, rid, endpoint, body, echoes[0], t0)

    async def _respond(self, request: Request, outs, rid: str, endpoint: str, body: _Common,
                       echo: str, t0: float):
        headers = {"X-Request-Id": rid}
        if body.stream:
            return StreamingResponse(
                self._sse(self._stream(outs, rid, endpoint, body.include_usage, True, t0,
                                       echo=echo)),
                media_type="text/event-stream", headers=headers)
        got = (await self._collect(request, [outs], endpoint, t0))[0]
        result = self._result(endpoint, rid, [self._choice(endpoint, 0, got, echo)], got[-1:], 1)
        self.backend.record_result(rid, result)
        return JSONResponse(result, headers=headers)

    async def _serve_many(self, request: Request, seqs: list[Sequence], endpoint: str,
                          body: _Common, echoes: list[str], t0: float):
        rid = seqs[0].seq_id
        headers = {"X-Request-Ids": ",".join(s.seq_id for s in seqs)}
        streams = [self.backend.generate(s, endpoint) for s in seqs]
        if body.stream:
            events = [self._stream(o, rid, endpoint, False, True, t0, index=i, echo=echoes[i],
                                   ids=False, record=seqs[i].seq_id)
                      for i, o in enumerate(streams)]
            return StreamingResponse(self._merged(events), media_type="text/event-stream",
                                     headers=headers)
        got = await self._collect(request, streams, endpoint, t0)
        result = self._result(endpoint, rid, [self._choice(endpoint, i, g, echoes[i])
                                              for i, g in enumerate(got)],
                              [g[-1] for g in got], body.n)
        for s in seqs:
            self.backend.record_result(s.seq_id, result)
        return JSONResponse(result, headers=headers)

    # -- endpoints ------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self._checked(body)
        prompts = body.prompts()
        seqs = self._sequences(body, prompts, 16)
        echoes = None
        if body.echo:
            echoes = [p if isinstance(p, str) else self.spec.tokenizer.decode(p)
                      for p in prompts for _ in range(body.n)]
        return await self._serve(request, seqs, "completions", body, echoes)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._checked(body)
        try:
            text = self.spec.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template") from exc
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        seqs = self._sequences(body, [text], None, add_special_tokens=False)
        return await self._serve(request, seqs, "chat", body)

    async def resume_stream(self, request_id: str, request: Request):
        """Continue a stream after its last event the client saw (`Last-Event-ID`)."""
        p = self.backend.find(request_id)
        if p is None:
            raise APIError(404, f"no running request {request_id!r} (finished results are "
                           "returned to a retry with its Idempotency-Key)", "not_found",
                           param="request_id")
        after = request.headers.get("last-event-id", "0")
        if not after.isdigit() or len(after) > 12:
            raise APIError(400, f"Last-Event-ID must be a token count, got {after[:40]!r}",
                           "invalid_value", param="Last-Event-ID")
        most = min(p.seq.params.max_tokens, self.spec.max_model_len - p.seq.num_prompt_tokens)
        if int(after) > most:  # no event of this stream can have that id: it would never come
            raise APIError(400, f"Last-Event-ID {after} is past the end of stream "
                           f"{request_id}, which has at most {most} tokens; send the id of "
                           "the last event received", "invalid_value", param="Last-Event-ID")
        outs = self.backend.follow(request_id, int(after))
        return StreamingResponse(self._sse(self._stream(outs, request_id, p.endpoint, False, False,
                                                        time.monotonic())),
                                 media_type="text/event-stream",
                                 headers={"X-Request-Id": request_id})

    async def load_lora_adapter(self, body: LoadAdapterRequest):
        """Load, or replace while serving, a LoRA-style adapter (vLLM's endpoint). Requests
        name it as their `model`; running requests keep the version they started with. A
        name must follow the rule (adapters.py), must not be the served model's (it would
        take the base model away from every client) and replaces a loaded adapter only
        when asked to (`load_inplace`)."""
        name = body.lora_name
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_adapter_name", param="lora_name") from exc
        if name in self.aliases:
            raise APIError(400, f"adapter name {name!r} is the served model's name; give the "
                           "adapter a name of its own", "invalid_adapter_name",
                           param="lora_name")
        if name in self.backend.adapters and not body.load_inplace:
            raise APIError(400, f"an adapter named {name!r} is already loaded; send "
                           '"load_inplace": true to replace it', "adapter_exists",
                           param="lora_name")
        try:
            version = await self.backend.load_adapter(name, body.lora_path, body.load_inplace)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_adapter", param="lora_path") from exc
        except (EngineDead, TimeoutError) as exc:
            raise APIError(503, str(exc), "engine_unavailable", "server_error") from exc
        return {"lora_name": name, "version": version}

    async def models(self):
        base = {"object": "model", "created": self.created, "owned_by": "phoenixft",
                "max_model_len": self.spec.max_model_len}
        return {"object": "list", "data": [{"id": self.name, **base}] + [
            {"id": a, "parent": self.name, **base} for a in sorted(self.backend.adapters)]}

    async def health(self):
        st = self.backend.stats
        log = st.get("log") or {}
        body = {"status": "ok" if self.backend.alive else "error",
                "running": st.get("running", 0), "waiting": st.get("waiting", 0),
                "engine_pid": st.get("pid"), "log_epochs": log.get("epochs", 0),
                "log_committed_epoch": log.get("processed_epoch", -1)}
        if self.backend.error is not None:
            body["error"] = self.backend.error
        if self.backend.log_errors:
            body["log_errors"] = self.backend.log_errors[-3:]
        return JSONResponse(status_code=200 if self.backend.alive else 503, content=body)

    async def prometheus(self):
        self.metrics.update(self.backend)
        return PlainTextResponse(generate_latest(self.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)


def _body_sha(endpoint: str, body: _Common) -> str:
    """What an Idempotency-Key stands for: the endpoint and the body as parsed (so spacing
    and key order do not matter), without `stream` and `stream_options`, which change how
    the completion is delivered, not what it is."""
    fields = body.model_dump(mode="json", exclude={"stream", "stream_options"})
    text = json.dumps([endpoint, fields], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the ASGI server sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
