"""Python client for a MegaSlide server: video generation and fine-tuning over HTTP.

from megaslide_client import Client

client = Client(base_url="http://127.0.0.1:8000")
video = client.videos.create_and_poll(prompt="a red circle moving right", size="64x64", progress=True)
if video.status == "completed":
    client.videos.download_content(video.id, path="out.mp4")
"""

from . import types
from ._client import AsyncClient, Client
from ._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from ._exceptions import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    UnprocessableEntityError,
)
from ._version import __version__
from ._webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "Client",
    "AsyncClient",
    "types",
    "DEFAULT_TIMEOUT",
    "DEFAULT_MAX_RETRIES",
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
    "WebhookVerificationError",
    "verify_webhook",
    "__version__",
]
