"""Domain errors and their one mapping to HTTP: the OpenAI error envelope on every 4xx and 5xx.

Handlers raise these types; `install_error_handlers` turns them, the engine's `RequestError` (a
request a model cannot take), request-validation errors and unknown routes into
`{"error": {"message", "type", "param", "code"}}`, and `UnexpectedErrors` does the same for any
other exception, as a 500.
A failed job is not an error here: it is a job whose status is `failed` (see `worker/`).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megaslide.engine.request import RequestError

from .store import UNAVAILABLE, is_disk_full

log = logging.getLogger("megaslide.server")


class APIError(Exception):
    """An error answered to the client; subclasses fix the status and type."""

    status = 500
    type = "server_error"
    default_code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.message, self.param = message, param
        self.code = code or self.default_code
        self.headers = headers or {}


class InvalidRequest(APIError):
    status, type, default_code = 400, "invalid_request_error", "invalid_value"


class Unauthorized(APIError):
    status, type, default_code = 401, "invalid_request_error", "invalid_api_key"


class Forbidden(APIError):
    status, type, default_code = 403, "invalid_request_error", "permission_denied"


class NotFound(APIError):
    status, type, default_code = 404, "invalid_request_error", "not_found"


class Conflict(APIError):
    status, type, default_code = 409, "invalid_request_error", "conflict"


class RequestTimeout(APIError):
    status, type, default_code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(APIError):
    status, type, default_code = 413, "invalid_request_error", "file_too_large"


class QueueFull(APIError):
    """The queue holds `max_queue` jobs; the client should retry after `retry_after` seconds."""

    status, type, default_code = 429, "rate_limit_error", "queue_full"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class TooManyStreams(QueueFull):
    """The key holds as many event streams as it may; one must close first."""

    default_code = "too_many_streams"


class QuotaExceeded(APIError):
    """The key holds as much of something as it may keep (adapters): it must delete some first;
    waiting does not help, so no Retry-After."""

    status, type, default_code = 429, "rate_limit_error", "quota_exceeded"


class NotReady(APIError):
    status, type, default_code = 503, "server_error", "not_ready"


class StoreUnavailable(APIError):
    """The job store cannot be reached or written right now (a lock held too long, a database
    restarting): retry later."""

    status, type, default_code = 503, "server_error", "store_unavailable"


class InsufficientStorage(APIError):
    """The disk holding the job store or the storage is full: nothing new can be kept."""

    status, type, default_code = 507, "server_error", "insufficient_storage"


class WorkerDead(APIError):
    """The worker is gone: no job can run until the server restarts."""

    status, type, default_code = 503, "server_error", "worker_dead"


def envelope(
    status: int, message: str, type_: str, param=None, code=None, headers=None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def invalid_request(exc: ValidationError | RequestValidationError) -> InvalidRequest:
    """The first pydantic error as an InvalidRequest whose message and `param` name the field."""
    err = exc.errors()[0]
    loc = [
        str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header", "form")
    ]
    field = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(
            f"Unrecognized request argument supplied: {field}",
            param=field,
            code="unknown_parameter",
        )
    if err.get("type") == "missing":
        return InvalidRequest(
            f"Missing required parameter: {field}", param=field, code="missing_required_parameter"
        )
    if err.get("type") == "value_error":  # our own validators: their words, without a prefix
        message = str(err["ctx"]["error"])
    else:
        message = err.get("msg", "invalid value")
    return InvalidRequest(f"{field}: {message}" if field else message, param=field)


DISK_FULL = "the server's disk is full; nothing new can be stored until space is freed"


def _api_error_response(exc: APIError) -> JSONResponse:
    return envelope(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Map every error the app can raise to the OpenAI envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _api_error_response(exc)

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError):
        if not is_disk_full(exc):
            raise exc  # not ours to explain: UnexpectedErrors answers it
        return _api_error_response(InsufficientStorage(DISK_FULL))

    for unavailable in UNAVAILABLE:

        @app.exception_handler(unavailable)
        async def _store_error(request: Request, exc: Exception):
            if is_disk_full(exc):
                return _api_error_response(InsufficientStorage(DISK_FULL))
            log.warning("job store unavailable on %s %s: %s", request.method, request.url, exc)
            return _api_error_response(
                StoreUnavailable("the job store is unavailable right now; retry shortly")
            )

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        code = exc.code or InvalidRequest.default_code
        return envelope(400, str(exc), InvalidRequest.type, exc.param, code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = invalid_request(exc)
        return envelope(err.status, err.message, err.type, err.param, err.code)

    # Validation errors are answered 400 above: FastAPI's generated 422 would misinform the schema.
    generate_openapi = app.openapi

    def openapi() -> dict:
        schema = generate_openapi()  # built once, then cached by FastAPI; this edit is idempotent
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message, code = f"Unknown route: {request.method} {request.url.path}", "unknown_url"
        else:
            message, code = str(exc.detail), None
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405 and (methods := allowed_methods(request)):
            headers = {**(headers or {}), "Allow": ", ".join(methods)}
        return envelope(exc.status_code, message, type_, None, code, headers)


def allowed_methods(request: Request) -> list[str]:
    """The methods the API takes at this request's path, from its OpenAPI schema (FastAPI keeps a
    route per method, so Starlette's own 405 knows only the first that matched)."""
    path = request.url.path
    for template, operations in request.app.openapi()["paths"].items():
        segments = ("[^/]+" if s.startswith("{") else re.escape(s) for s in template.split("/"))
        if re.fullmatch("/".join(segments), path):
            return sorted(m.upper() for m in operations)
    return []


class UnexpectedErrors:
    """Pure ASGI middleware: an exception no handler took is answered with the envelope 500, and
    the connection stays open.

    Starlette's own last resort answers and then re-raises, for the server to log; uvicorn then
    closes the connection, so one bad request would cost a keep-alive client its connection (and
    every request queued behind it on that connection). Here the exception is logged and ends with
    the answer. A response that had already started cannot be replaced: that exception goes on to
    the server, whose cutting of the connection is how the client learns its body is incomplete.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except ClientDisconnect:
            # The client left before its body ended (a dropped upload): nobody is there to
            # answer, nothing was stored (the route cleans up what it began), and the server
            # is fine, so it is worth one line, not a traceback per drop.
            log.info("client disconnected during %s %s", scope["method"], scope["path"])
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            response = envelope(
                500,
                f"internal server error: {type(exc).__name__}",
                "server_error",
                None,
                "internal_error",
            )
            await response(scope, receive, send)
