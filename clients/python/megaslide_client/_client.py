"""`Client` and `AsyncClient`: the entry points, holding the connection and the resources."""

from __future__ import annotations

from functools import cached_property

from ._base_client import AsyncAPIClient, SyncAPIClient
from .resources import (
    Adapters,
    AsyncAdapters,
    AsyncFiles,
    AsyncFineTuning,
    AsyncModels,
    AsyncVideos,
    AsyncWebhooks,
    Files,
    FineTuning,
    Models,
    Videos,
    Webhooks,
)


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

    videos = cached_property(Videos)
    files = cached_property(Files)
    fine_tuning = cached_property(FineTuning)
    models = cached_property(Models)
    adapters = cached_property(Adapters)
    webhooks = cached_property(Webhooks)


class AsyncClient(AsyncAPIClient):
    """Async twin of Client: the same resources, every call awaited.

    async with AsyncClient() as client:
        video = await client.videos.create_and_poll(prompt="...")
        async for v in client.videos.list():
            ...
    """

    videos = cached_property(AsyncVideos)
    files = cached_property(AsyncFiles)
    fine_tuning = cached_property(AsyncFineTuning)
    models = cached_property(AsyncModels)
    adapters = cached_property(AsyncAdapters)
    webhooks = cached_property(AsyncWebhooks)
