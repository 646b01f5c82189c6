"""Limits on what one client can make the front hold: the size of a request body, and
how long a client may take to send a request's headers and body.

The front is one process (its event loop serves every client and /health): a 400 MB
prompt once took it to 7 GB of memory and stalled /health for 11 s, and a client that
sends its headers a byte at a time (slow-loris) held a connection forever. So:

- `BodyLimit` (ASGI middleware) answers 413 before reading a body whose Content-Length
  is over the limit, and counts the bytes of bodies sent without one (chunked), answering
  413 as soon as they pass it; either way the connection is closed, so the rest is never
  read. A body that does not arrive within the read timeout gets 408.
- `timed_h11(timeout_s)` is uvicorn's h11 protocol with a deadline for the request's
  headers, counted from the connection (or the end of the previous response on a
  keep-alive connection) to the end of the headers. Any byte used to reset uvicorn's
  keep-alive timer, so trickling kept a connection open; this deadline is not reset.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

DEFAULT_MAX_BODY = 4 << 20
DEFAULT_READ_TIMEOUT_S = 30.0


def _reply(status: int, message: str, code: str) -> tuple[dict, dict]:
    body = json.dumps(error_body(message, code)).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                         (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body, "more_body": False})


class BodyLimit:
    """ASGI middleware: the whole body is read here, bounded in size and time, then handed
    to the app (which would read it whole anyway, to parse the JSON)."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    def _too_large(self, got: str) -> tuple[dict, dict]:
        return _reply(413, f"the request body ({got}) is over this server's limit of "
                      f"{self.max_bytes} bytes ({self.max_bytes / 2**20:.1f} MiB): send a "
                      "smaller request, or start the server with a larger "
                      "--max-request-body", "request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            for msg in self._too_large(f"Content-Length {int(declared)}"):
                await send(msg)
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        chunks, size = [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                for m in _reply(408, f"the request body did not arrive within "
                                f"{self.read_timeout_s:g} s (received {size} bytes); send it "
                                "at once, or start the server with a longer "
                                "--request-read-timeout", "request_timeout"):
                    await send(m)
                return None
            if msg["type"] == "http.disconnect":
                return None  # the client left before its request was whole
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                for m in self._too_large(f"{size} bytes so far"):
                    await send(m)
                return None
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()  # then: disconnects

        return await self.app(scope, replay, send)


_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def timed_h11(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol whose connections must deliver each request's headers
    within `timeout_s` (408, then the connection is closed)."""
    body = json.dumps(error_body(f"the request headers did not arrive within {timeout_s:g} s",
                                 "request_timeout")).encode()
    response = _TIMEOUT_RESPONSE % (len(body), body)

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_for: object = None  # the request cycle that was current when armed

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_for = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _check(self) -> None:
            if self.cycle is not self._waiting_for:  # a request's headers are in
                self._disarm()

        def _expired(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.cycle is self._waiting_for:
                self.transport.write(response)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check()

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.cycle is before:  # no pipelined request started: wait for the next
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol
