"""Every error the server answers has OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

Bad JSON (invalid UTF-8, nesting too deep, not JSON at all), wrong types and bad values
are 400 ``invalid_request_error``; an unknown model 404 ``model_not_found``; a request the
engine failed on 500 ``server_error``. Nothing reaches a client as FastAPI's default
``{"detail": ...}``.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("phoenixft.serve")


class EngineDead(RuntimeError):
    """No engine can serve (none is running, or the one that was stopped after an error)."""


class RequestFailed(RuntimeError):
    """The engine raised while computing this request; it was dropped, serving goes on."""


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str,
                 type_: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = (
            status, message, code, type_, param)


def error_body(message: str, code: str, type_: str = "invalid_request_error",
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, code: str, type_: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, code, type_, param))


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errs):
        return error_response(400, "the request body is not valid JSON", "invalid_json")
    parts = []
    for e in errs[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    param = ".".join(str(x) for x in errs[0].get("loc", ()) if x != "body") if errs else None
    return error_response(400, "invalid request: " + "; ".join(parts), "invalid_type",
                          param=param or None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code, exc.type, exc.param)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own errors: a body it could not parse, an unknown route or method."""
    if exc.status_code == 400:
        return error_response(400, f"the request body could not be parsed: {exc.detail}",
                              "invalid_json")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, str(exc.detail), code)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, RecursionError):  # JSON nested deeper than the parser allows
        return error_response(400, "the request body is nested too deeply", "invalid_json")
    log.exception("unexpected error in %s", request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error",
                          "server_error")


def require_key(app: FastAPI, key: str) -> None:
    """`Authorization: Bearer KEY` on /v1/* (as vLLM's --api-key); 401 in OpenAI's shape."""
    want = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                return error_response(401, "a valid API key is needed: send the header "
                                      "`Authorization: Bearer <key>`", "invalid_api_key")
        return await call_next(request)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
