"""`Client` and `AsyncClient`: the entry points, holding the connection and the resources."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from ._base_client import AsyncAPIClient, SyncAPIClient
from ._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from .resources import (
    AsyncFiles,
    AsyncFineTuning,
    AsyncModels,
    AsyncVideos,
    Files,
    FineTuning,
    Models,
    Videos,
)


class _Unset:
    """Marks an option not given (None is a meaningful timeout: wait forever)."""


_UNSET = _Unset()


class Client(SyncAPIClient):
    """A MegaSlide server.

        client = Client(base_url="http://127.0.0.1:8000", api_key="...")
        video = client.videos.create_and_poll(prompt="a red circle moving right", progress=True)
        client.videos.download_content(video.id, path="out.mp4")

    `base_url` and `api_key` default to $MEGASLIDE_BASE_URL and $MEGASLIDE_API_KEY (the URL
    with or without `/v1`). `timeout` is seconds or an httpx.Timeout; `max_retries` counts
    retries after the first attempt. `transport` (e.g. httpx.ASGITransport(app)) or a ready
    `http_client` replaces the network, for tests and custom proxies.
    """

    videos: Videos
    files: Files
    fine_tuning: FineTuning
    models: Models

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
            http_client=http_client,
            transport=transport,
        )
        self.videos = Videos(self)
        self.files = Files(self)
        self.fine_tuning = FineTuning(self)
        self.models = Models(self)

    def with_options(
        self,
        *,
        timeout: float | httpx.Timeout | None | _Unset = _UNSET,
        max_retries: int | None = None,
    ) -> Client:
        """A client like this one (same server, key and connection pool) with other limits:
        `client.with_options(max_retries=0).videos.create(...)`."""
        return Client(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout if timeout is _UNSET else timeout,
            max_retries=self.max_retries if max_retries is None else max_retries,
            default_headers=self._default_headers,
            http_client=self._http,
        )

    def __repr__(self) -> str:
        return f"Client(base_url={self.base_url!r})"


class AsyncClient(AsyncAPIClient):
    """Async twin of Client: the same resources, every call awaited.

    async with AsyncClient() as client:
        video = await client.videos.create_and_poll(prompt="...")
        async for v in client.videos.list():
            ...
    """

    videos: AsyncVideos
    files: AsyncFiles
    fine_tuning: AsyncFineTuning
    models: AsyncModels

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
            http_client=http_client,
            transport=transport,
        )
        self.videos = AsyncVideos(self)
        self.files = AsyncFiles(self)
        self.fine_tuning = AsyncFineTuning(self)
        self.models = AsyncModels(self)

    def with_options(
        self,
        *,
        timeout: float | httpx.Timeout | None | _Unset = _UNSET,
        max_retries: int | None = None,
    ) -> AsyncClient:
        """An AsyncClient like this one (same server, key and connection pool) with other limits."""
        return AsyncClient(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout if timeout is _UNSET else timeout,
            max_retries=self.max_retries if max_retries is None else max_retries,
            default_headers=self._default_headers,
            http_client=self._http,
        )

    def __repr__(self) -> str:
        return f"AsyncClient(base_url={self.base_url!r})"
