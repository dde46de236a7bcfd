"""The HTTP core shared by every resource: auth, retries with backoff, idempotency keys, errors.

`SyncAPIClient` and `AsyncAPIClient` are twins: the same decisions (what to retry, how long to
wait, which error to raise) live in module functions both call, and only the I/O differs.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import httpx

from . import _constants as C
from ._exceptions import APIConnectionError, APITimeoutError, status_error
from ._version import __version__

# Statuses worth another attempt: the request timed out (408), a conflict that may clear (409: a
# lock or a request with the same Idempotency-Key still in flight), the queue is full (429), or the
# server failed (5xx).
RETRY_STATUSES = frozenset({408, 409, 429})
# 409s that no retry can fix: the key was used with another body; the file is a running job's data.
PERMANENT_CONFLICTS = frozenset({"idempotency_key_reused", "file_in_use"})

# Module-level so tests can record the waits instead of sleeping through them.
_sleep = time.sleep
_async_sleep = anyio.sleep

FilesFactory = Callable[[], Mapping[str, Any]]


def new_idempotency_key() -> str:
    """A fresh key for one logical POST; all retries of that call send the same key."""
    return f"megaslide-{uuid.uuid4().hex}"


def should_retry(response: httpx.Response, body: Any = None) -> bool:
    """Whether an error answer is transient. The server may decide with `x-should-retry`."""
    explicit = response.headers.get("x-should-retry")
    if explicit in ("true", "false"):
        return explicit == "true"
    if response.status_code == 409:
        error = body.get("error") if isinstance(body, dict) else None
        return not (isinstance(error, dict) and error.get("code") in PERMANENT_CONFLICTS)
    return response.status_code in RETRY_STATUSES or response.status_code >= 500


def retry_after(headers: httpx.Headers | None) -> float | None:
    """Seconds the server asked us to wait (retry-after-ms, then Retry-After), if sensible.

    Retry-After is either seconds or an HTTP date (RFC 9110 10.2.3). Values outside
    [0, MAX_RETRY_AFTER] are ignored so a confused server cannot stall a call for an hour.
    """
    if headers is None:
        return None
    seconds: float | None = None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            seconds = float(ms) / 1000.0
        except ValueError:
            seconds = None
    if seconds is None and headers.get("retry-after") is not None:
        value = headers["retry-after"]
        try:
            seconds = float(value)
        except ValueError:
            date = email.utils.parsedate_to_datetime(value) if value else None
            if date is not None:
                seconds = date.timestamp() - time.time()
    if seconds is None or not (0 <= seconds <= C.MAX_RETRY_AFTER):
        return None
    return seconds


def retry_delay(attempt: int, headers: httpx.Headers | None = None) -> float:
    """How long to wait before retry number `attempt` (0-based).

    The server's Retry-After wins; otherwise exponential backoff with jitter:
    min(INITIAL_RETRY_DELAY * 2**attempt, MAX_RETRY_DELAY), shortened by up to RETRY_JITTER.
    """
    asked = retry_after(headers)
    if asked is not None:
        return asked
    delay = min(C.INITIAL_RETRY_DELAY * (2.0**attempt), C.MAX_RETRY_DELAY)
    return delay * (1.0 - C.RETRY_JITTER * random.random())


def response_body(response: httpx.Response) -> Any:
    """The (already read) body as JSON when it is JSON, else as text."""
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text


def root_url(base_url: str) -> str:
    """The server root: accepts `http://host:8000`, `.../v1` and trailing slashes alike."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


class _BaseClient:
    """Configuration shared by the sync and async clients."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: float | httpx.Timeout | None,
        max_retries: int,
        default_headers: Mapping[str, str] | None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        base_url = base_url or os.environ.get(C.BASE_URL_ENV) or C.DEFAULT_BASE_URL
        self.base_url = root_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get(C.API_KEY_ENV)
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.max_retries = max_retries
        self._default_headers = dict(default_headers or {})

    def _headers(
        self, extra: Mapping[str, str] | None, idempotency_key: str | None
    ) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": f"megaslide-client/{__version__}"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(self._default_headers)
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        headers.update(extra or {})
        return headers

    def _build_request(
        self,
        http: httpx.Client | httpx.AsyncClient,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None,
        json_body: Any,
        data: Mapping[str, Any] | None,
        files: FilesFactory | None,
        headers: Mapping[str, str] | None,
        timeout: float | httpx.Timeout | None,
        idempotency_key: str | None,
    ) -> httpx.Request:
        params = {k: v for k, v in (params or {}).items() if v is not None}
        return http.build_request(
            method,
            self.base_url + path,
            params=params or None,
            json=json_body,
            data=data,
            # A fresh file mapping per attempt: a retry must not send an exhausted stream.
            files=files() if files is not None else None,
            headers=self._headers(headers, idempotency_key),
            timeout=self.timeout if timeout is None else timeout,
        )


class SyncAPIClient(_BaseClient):
    """Sends requests with retries over an `httpx.Client`."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: float | httpx.Timeout | None,
        max_retries: int,
        default_headers: Mapping[str, str] | None,
        http_client: httpx.Client | None,
        transport: httpx.BaseTransport | None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
        )
        if http_client is not None and transport is not None:
            raise ValueError("give http_client or transport, not both")
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(transport=transport, timeout=self.timeout)

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        data: Mapping[str, Any] | None = None,
        files: FilesFactory | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        stream: bool = False,
        idempotency_key: str | None = None,
        max_retries: int | None = None,
    ) -> httpx.Response:
        """Send one logical request, retrying transient failures; raise a typed error otherwise.

        A POST gets an Idempotency-Key (a fresh one unless given) that every retry repeats, so a
        create whose answer was lost is answered by the server with the first job, not a new one.
        With `stream=True` the response comes back unread and open; the caller closes it.
        """
        retries = self.max_retries if max_retries is None else max_retries
        if method.upper() == "POST" and idempotency_key is None:
            idempotency_key = new_idempotency_key()
        attempt = 0
        while True:
            request = self._build_request(
                self._http,
                method,
                path,
                params=params,
                json_body=json,
                data=data,
                files=files,
                headers=headers,
                timeout=timeout,
                idempotency_key=idempotency_key,
            )
            try:
                response = self._http.send(request, stream=True)
            except httpx.TimeoutException as e:
                if attempt < retries:
                    _sleep(retry_delay(attempt))
                    attempt += 1
                    continue
                raise APITimeoutError(request) from e
            except httpx.TransportError as e:
                if attempt < retries:
                    _sleep(retry_delay(attempt))
                    attempt += 1
                    continue
                raise APIConnectionError(f"Connection error: {e}", request) from e
            if response.is_error:
                try:
                    response.read()
                finally:
                    response.close()
                body = response_body(response)
                if attempt < retries and should_retry(response, body):
                    _sleep(retry_delay(attempt, response.headers))
                    attempt += 1
                    continue
                raise status_error(response, body)
            if not stream:
                try:
                    response.read()
                finally:
                    response.close()
            return response

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", path, **kwargs)

    def close(self) -> None:
        """Close the connection pool (not an `http_client` you passed in)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncAPIClient(_BaseClient):
    """Sends requests with retries over an `httpx.AsyncClient`."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: float | httpx.Timeout | None,
        max_retries: int,
        default_headers: Mapping[str, str] | None,
        http_client: httpx.AsyncClient | None,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
        )
        if http_client is not None and transport is not None:
            raise ValueError("give http_client or transport, not both")
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(transport=transport, timeout=self.timeout)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        data: Mapping[str, Any] | None = None,
        files: FilesFactory | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        stream: bool = False,
        idempotency_key: str | None = None,
        max_retries: int | None = None,
    ) -> httpx.Response:
        """Async twin of `SyncAPIClient.request`."""
        retries = self.max_retries if max_retries is None else max_retries
        if method.upper() == "POST" and idempotency_key is None:
            idempotency_key = new_idempotency_key()
        attempt = 0
        while True:
            request = self._build_request(
                self._http,
                method,
                path,
                params=params,
                json_body=json,
                data=data,
                files=files,
                headers=headers,
                timeout=timeout,
                idempotency_key=idempotency_key,
            )
            try:
                response = await self._http.send(request, stream=True)
            except httpx.TimeoutException as e:
                if attempt < retries:
                    await _async_sleep(retry_delay(attempt))
                    attempt += 1
                    continue
                raise APITimeoutError(request) from e
            except httpx.TransportError as e:
                if attempt < retries:
                    await _async_sleep(retry_delay(attempt))
                    attempt += 1
                    continue
                raise APIConnectionError(f"Connection error: {e}", request) from e
            if response.is_error:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                body = response_body(response)
                if attempt < retries and should_retry(response, body):
                    await _async_sleep(retry_delay(attempt, response.headers))
                    attempt += 1
                    continue
                raise status_error(response, body)
            if not stream:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            return response

    async def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.request("DELETE", path, **kwargs)

    async def close(self) -> None:
        """Close the connection pool (not an `http_client` you passed in)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
