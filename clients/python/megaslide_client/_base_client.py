"""The HTTP core shared by every resource: auth, retries with backoff, idempotency keys, errors,
and the loops that walk list pages, resume broken streams and downloads, and poll jobs.

`SyncAPIClient` and `AsyncAPIClient` are twins: the same decisions (what to retry, how long to
wait, which error to raise, where a stream resumes, when a poll stops) live in module functions
and in the I/O-free `Attempts`, `Resume` and `Watch` objects both call; only the I/O differs.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import httpx

from . import _constants as C
from ._exceptions import APIConnectionError, APIError, APITimeoutError, status_error
from ._pagination import AsyncCursorPage, AsyncPaginator, SyncCursorPage
from ._polling import Watch
from ._streaming import Download, PathLike, Resume, stream_timeout
from ._version import __version__

# Statuses worth another attempt: the request timed out (408), a conflict that may clear (409: a
# lock or a request with the same Idempotency-Key still in flight), the queue is full (429), or the
# server failed (5xx).
RETRY_STATUSES = frozenset({408, 409, 429})
# 409s that no retry can fix: the key was used with another body; the file is a running job's data;
# the adapter's name is taken, or a queued video applies it, or it was registered at start.
PERMANENT_CONFLICTS = frozenset(
    {
        "idempotency_key_reused",
        "file_in_use",
        "adapter_exists",
        "adapter_in_use",
        "adapter_registered_at_start",
    }
)

# Module-level so tests can record the waits instead of sleeping through them.
_sleep = time.sleep
_async_sleep = anyio.sleep

# The multipart files of one attempt: by form field, or `(field, file)` pairs (a field repeated).
FilesFactory = Callable[[], Mapping[str, Any] | list[tuple[str, Any]]]
T = TypeVar("T")
HttpClientT = TypeVar("HttpClientT", httpx.Client, httpx.AsyncClient)
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)
ClientT = TypeVar("ClientT", bound="_BaseClient")


# Methods whose retries must not act twice: each call gets an Idempotency-Key its retries repeat,
# and the server answers a retry with the first call's outcome (a DELETE retried after a lost
# answer gets "deleted", not a 404).
KEYED_METHODS = frozenset({"POST", "DELETE"})


def new_idempotency_key() -> str:
    """A fresh key for one logical call; all retries of that call send the same key."""
    return f"megaslide-{uuid.uuid4().hex}"


def idempotency_key_for(method: str, given: str | None) -> str | None:
    """The key one call sends: the caller's, else a fresh one for a POST or DELETE, else none."""
    if method.upper() in KEYED_METHODS and given is None:
        return new_idempotency_key()
    return given


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


class Attempts:
    """The retries of one logical call: after a failure, how long to wait, or the error to raise.

    A request counts every failure. A stream calls `reset` each time it delivers something, so
    that only breaks in a row count against `max_retries`.
    """

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.retries = 0

    def reset(self) -> None:
        self.retries = 0

    def after_break(
        self, e: httpx.TransportError, request: httpx.Request, what: str = "Connection error"
    ) -> float:
        """Seconds to wait after the connection failed; once retries are spent, raises
        APITimeoutError for a timeout and APIConnectionError for anything else."""
        if isinstance(e, httpx.TimeoutException):
            return self._again(APITimeoutError(request), cause=e)
        return self._again(APIConnectionError(f"{what}: {e}", request), cause=e)

    def after_status(self, response: httpx.Response) -> float:
        """Seconds to wait after an error answer (its body read); raises the typed status error
        when the answer is not transient or retries are spent."""
        body = response_body(response)
        if not should_retry(response, body):
            raise status_error(response, body)
        return self._again(status_error(response, body), headers=response.headers)

    def _again(
        self,
        error: APIError,
        cause: BaseException | None = None,
        headers: httpx.Headers | None = None,
    ) -> float:
        if self.retries >= self.max_retries:
            raise error from cause
        delay = retry_delay(self.retries, headers)
        self.retries += 1
        return delay


class _Unset:
    """Marks an option not given (None is a meaningful timeout: wait forever)."""


_UNSET = _Unset()


class _BaseClient(Generic[HttpClientT, TransportT]):
    """Configuration shared by the sync and async clients."""

    _http_class: type[HttpClientT]

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = C.DEFAULT_TIMEOUT,
        max_retries: int = C.DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: HttpClientT | None = None,
        transport: TransportT | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if http_client is not None and transport is not None:
            raise ValueError("give http_client or transport, not both")
        base_url = base_url or os.environ.get(C.BASE_URL_ENV) or C.DEFAULT_BASE_URL
        self.base_url = root_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get(C.API_KEY_ENV)
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.max_retries = max_retries
        self._default_headers = dict(default_headers or {})
        self._owns_http = http_client is None
        self._http: HttpClientT = http_client or self._http_class(
            transport=transport, timeout=self.timeout
        )

    def with_options(
        self: ClientT,
        *,
        timeout: float | httpx.Timeout | None | _Unset = _UNSET,
        max_retries: int | None = None,
    ) -> ClientT:
        """A client like this one (same server, key and connection pool) with other limits:
        `client.with_options(max_retries=0).videos.create(...)`."""
        return type(self)(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout if isinstance(timeout, _Unset) else timeout,
            max_retries=self.max_retries if max_retries is None else max_retries,
            default_headers=self._default_headers,
            http_client=self._http,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

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
        return self._http.build_request(
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


class SyncAPIClient(_BaseClient[httpx.Client, httpx.BaseTransport]):
    """Sends requests with retries over an `httpx.Client`."""

    _http_class = httpx.Client

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

        A POST or DELETE gets an Idempotency-Key (a fresh one unless given) that every retry
        repeats, so a call whose answer was lost is answered by the server with the first
        outcome: the job a create made, not a new one; "deleted", not a 404.
        With `stream=True` the response comes back unread and open; the caller closes it.
        """
        attempts = Attempts(self.max_retries if max_retries is None else max_retries)
        idempotency_key = idempotency_key_for(method, idempotency_key)
        while True:
            request = self._build_request(
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
                if response.is_error or not stream:
                    try:
                        response.read()
                    finally:
                        response.close()
            except httpx.TransportError as e:
                _sleep(attempts.after_break(e, request))
                continue
            if not response.is_error:
                return response
            _sleep(attempts.after_status(response))

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", path, **kwargs)

    def get_page(
        self, path: str, item_type: type[T], *, after: str | None = None, **params: Any
    ) -> SyncCursorPage[T]:
        """The first page of the list at `path` (from `after`); it fetches the next ones itself."""

        def fetch(cursor: str | None) -> SyncCursorPage[T]:
            body = self.get(path, params={**params, "after": cursor}).json()
            return SyncCursorPage(body, item_type, fetch)

        return fetch(after)

    def get_stream(
        self, path: str, resume: Resume, *, params: Mapping[str, Any] | None = None
    ) -> Iterator[Any]:
        """GET a streamed body, reopening it where it broke as `resume` decides; yields what
        `resume` makes of it. Breaks in a row beyond max_retries raise APIConnectionError."""
        attempts = Attempts(self.max_retries)
        timeout = stream_timeout(self.timeout)
        while True:
            response = self.get(
                path, params=params, headers=resume.headers(), stream=True, timeout=timeout
            )
            try:
                resume.begin(response)
                for piece in response.iter_lines() if resume.lines else response.iter_bytes():
                    for item in resume.feed(piece):
                        attempts.reset()
                        yield item
                yield from resume.end()
                return
            except httpx.TransportError as e:
                wait = attempts.after_break(e, response.request, "the stream broke")
            finally:
                response.close()
            _sleep(wait)

    def download(
        self, path: str, *, params: Mapping[str, Any] | None = None, to: PathLike | None = None
    ) -> Path | bytes:
        """GET a file into the path `to` (returned) or into memory (the bytes returned), resuming
        with Range requests where the connection broke."""
        with Download(to) as download:
            for _ in self.get_stream(path, download, params=params):
                pass
        return download.result()

    def poll(self, fetch: Callable[[], Any], watch: Watch[T]) -> T:
        """Call `fetch` until `watch` finds the job over, sleeping between calls as it says."""
        while (wait := watch.see(fetch())) is not None:
            _sleep(wait)
        return watch.result

    def close(self) -> None:
        """Close the connection pool (not an `http_client` you passed in)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncAPIClient(_BaseClient[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    """Sends requests with retries over an `httpx.AsyncClient`."""

    _http_class = httpx.AsyncClient

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
        attempts = Attempts(self.max_retries if max_retries is None else max_retries)
        idempotency_key = idempotency_key_for(method, idempotency_key)
        while True:
            request = self._build_request(
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
                if response.is_error or not stream:
                    try:
                        await response.aread()
                    finally:
                        await response.aclose()
            except httpx.TransportError as e:
                await _async_sleep(attempts.after_break(e, request))
                continue
            if not response.is_error:
                return response
            await _async_sleep(attempts.after_status(response))

    async def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.request("GET", path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.request("DELETE", path, **kwargs)

    def get_page(
        self, path: str, item_type: type[T], *, after: str | None = None, **params: Any
    ) -> AsyncPaginator[T]:
        """`await` it for the first page of the list at `path`, or `async for` over every item."""

        async def fetch(cursor: str | None) -> AsyncCursorPage[T]:
            body = (await self.get(path, params={**params, "after": cursor})).json()
            return AsyncCursorPage(body, item_type, fetch)

        return AsyncPaginator(lambda: fetch(after))

    async def get_stream(
        self, path: str, resume: Resume, *, params: Mapping[str, Any] | None = None
    ) -> AsyncIterator[Any]:
        """Async twin of `SyncAPIClient.get_stream`."""
        attempts = Attempts(self.max_retries)
        timeout = stream_timeout(self.timeout)
        while True:
            response = await self.get(
                path, params=params, headers=resume.headers(), stream=True, timeout=timeout
            )
            try:
                resume.begin(response)
                async for piece in (
                    response.aiter_lines() if resume.lines else response.aiter_bytes()
                ):
                    for item in resume.feed(piece):
                        attempts.reset()
                        yield item
                for item in resume.end():
                    yield item
                return
            except httpx.TransportError as e:
                wait = attempts.after_break(e, response.request, "the stream broke")
            finally:
                await response.aclose()
            await _async_sleep(wait)

    async def download(
        self, path: str, *, params: Mapping[str, Any] | None = None, to: PathLike | None = None
    ) -> Path | bytes:
        """Async twin of `SyncAPIClient.download`."""
        with Download(to) as download:
            async for _ in self.get_stream(path, download, params=params):
                pass
        return download.result()

    async def poll(self, fetch: Callable[[], Any], watch: Watch[T]) -> T:
        """Await `fetch()` until `watch` finds the job over, sleeping between calls as it says."""
        while (wait := watch.see(await fetch())) is not None:
            await _async_sleep(wait)
        return watch.result

    async def close(self) -> None:
        """Close the connection pool (not an `http_client` you passed in)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
