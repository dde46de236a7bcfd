"""Errors raised by the client: one class per HTTP status family, plus connection and timeout.

APIError
├── APIConnectionError          the server could not be reached (after retries)
│   └── APITimeoutError         the request timed out (after retries)
└── APIStatusError              the server answered 4xx / 5xx (after retries)
    ├── BadRequestError             400
    ├── AuthenticationError         401
    ├── PermissionDeniedError       403
    ├── NotFoundError               404
    ├── ConflictError               409
    ├── UnprocessableEntityError    422
    ├── RateLimitError              429
    └── InternalServerError         >= 500
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
]


class APIError(Exception):
    """Base of every error this client raises."""

    def __init__(
        self, message: str, request: httpx.Request | None = None, body: Any = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        self.body = body


class APIConnectionError(APIError):
    """The request never got an HTTP answer: refused, reset, DNS, TLS, or a broken stream."""

    def __init__(
        self, message: str = "Connection error.", request: httpx.Request | None = None
    ) -> None:
        super().__init__(message, request)


class APITimeoutError(APIConnectionError):
    """The request timed out."""

    def __init__(self, request: httpx.Request | None = None) -> None:
        super().__init__("Request timed out.", request)


class APIStatusError(APIError):
    """The server answered with a 4xx or 5xx status.

    `message` is the server's `error.message` when the body is the standard error envelope
    `{"error": {"message", "type", "param", "code"}}`; `type`, `param` and `code` come from it too.
    """

    def __init__(self, message: str, *, response: httpx.Response, body: Any) -> None:
        super().__init__(message, response.request, body)
        self.response = response
        self.status_code = response.status_code
        self.request_id = response.headers.get("x-request-id")
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        self.type: str | None = error.get("type")
        self.param: str | None = error.get("param")
        self.code: str | None = error.get("code")

    def __str__(self) -> str:
        return f"Error code: {self.status_code} - {self.message}"


class BadRequestError(APIStatusError):
    """400: the request is malformed or a field is invalid."""


class AuthenticationError(APIStatusError):
    """401: no API key, or a wrong one."""


class PermissionDeniedError(APIStatusError):
    """403: the key may not do this."""


class NotFoundError(APIStatusError):
    """404: unknown id, model or route."""


class ConflictError(APIStatusError):
    """409: the resource is not in a state that allows this (e.g. content of an unfinished video)."""


class UnprocessableEntityError(APIStatusError):
    """422: the body parsed but a field failed validation."""


class RateLimitError(APIStatusError):
    """429: the queue is full; the server says when to come back in Retry-After."""


class InternalServerError(APIStatusError):
    """5xx: the server failed."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_error(response: httpx.Response, body: Any) -> APIStatusError:
    """The typed error for an error response whose body has already been read."""
    message = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    if message is None:
        message = body if isinstance(body, str) and body else response.reason_phrase
    if response.status_code >= 500:
        cls = InternalServerError
    else:
        cls = _BY_STATUS.get(response.status_code, APIStatusError)
    return cls(str(message), response=response, body=body)
