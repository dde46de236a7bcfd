"""Webhooks: the events of a key's jobs POSTed to the endpoints it registered, signed as the
Standard Webhooks specification says (https://www.standardwebhooks.com/).

Each delivery carries three headers: `webhook-id` (the message id, the same on every retry, so a
receiver that remembers the ids it has handled sees each message once), `webhook-timestamp`
(seconds since the epoch, when this try was signed) and `webhook-signature`, `v1,<base64>` of
HMAC-SHA256 over `{id}.{timestamp}.{body}` keyed with the endpoint's secret (`whsec_<base64>`, the
base64 part decoded). The body is `{"type", "timestamp", "data"}`, `data` the object the API
returns for the job (or the checkpoint) as it was when the event happened.

The outbox lives in the job store (store/webhooks.py): every API process runs a `Sender` in its
lifespan that claims due deliveries, POSTs each with a short timeout, and records the try; a
failure (no answer, or a status outside 2xx) is retried after `webhook_retry_s`. Nothing here
runs on a worker's path: a worker's only part is the row its transaction writes.

An endpoint's URL must not lead into the server's own network (SSRF): a host that resolves to a
loopback, private, link-local, multicast, reserved or unspecified address is refused when the
endpoint is registered, and again before each try (the name may resolve elsewhere by then),
unless the operator allows it (`webhook_allow_private`). Redirects are not followed.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
import urllib.parse

import anyio
import httpx

from .records import (
    CheckpointRecord,
    FineTuneRecord,
    VideoRecord,
    WebhookDeliveryRecord,
    WebhookEndpointRecord,
)
from .schemas import checkpoint_object, finetune_object, video_object
from .settings import Settings
from .store import UNAVAILABLE, AsyncStore

log = logging.getLogger("megaslide.server")

PRUNE_INTERVAL_S = 3600.0  # how often a sender deletes settled deliveries past event_ttl_s
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
MAX_ERROR_CHARS = 500  # what a try's record keeps of an error message


class UnsafeURL(ValueError):
    """A webhook URL that is not http(s), or that leads to an address the server refuses."""


def new_secret() -> str:
    """A fresh endpoint secret: `whsec_` and the base64 of random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header of a message: `v1,` and the base64 of HMAC-SHA256 over
    `{msg_id}.{timestamp}.{body}`, keyed with the secret's decoded bytes."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """A try's headers, signed at `timestamp`."""
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def _refused(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether an address is outside the public internet."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def check_url(url: str, *, allow_private: bool) -> None:
    """Refuse (`UnsafeURL`) a URL that is not http(s) with a host, or whose host resolves to an
    address outside the public internet while `allow_private` is off. Resolves the name: run it
    off the event loop."""
    try:  # a malformed IPv6 literal, or a port out of range, is a ValueError here
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeURL(f"{url[:200]!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL(f"a webhook URL is http:// or https:// with a host, got {url[:200]!r}")
    if parts.username or parts.password:
        raise UnsafeURL("a webhook URL carries no user name or password")
    if allow_private:
        return
    try:
        found = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise UnsafeURL(f"the host {parts.hostname[:200]!r} does not resolve: {exc}") from None
    for *_, sockaddr in found:
        address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if _refused(address):
            raise UnsafeURL(
                f"{parts.hostname} resolves to {address}, which is not a public address "
                "(the operator may allow such endpoints: webhook_allow_private)"
            )


def event_data(delivery: WebhookDeliveryRecord) -> dict:
    """The `data` of a delivery: what the API returns for its job, or for the checkpoint of a
    `checkpoint.created`, as it was when the event happened."""
    snapshot = delivery.snapshot
    if delivery.type.startswith("video."):
        obj = video_object(VideoRecord.from_row(snapshot))
    elif delivery.type == "fine_tuning.job.checkpoint.created":
        job = FineTuneRecord.from_row(snapshot["job"])
        obj = checkpoint_object(CheckpointRecord.from_row(snapshot["checkpoint"]), job)
    else:
        obj = finetune_object(FineTuneRecord.from_row(snapshot))
    return obj.model_dump(mode="json")


def body(delivery: WebhookDeliveryRecord) -> bytes:
    """A delivery's JSON body, the same on every try."""
    at = datetime.datetime.fromtimestamp(delivery.created_at, datetime.UTC)
    payload = {"type": delivery.type, "timestamp": at.isoformat(), "data": event_data(delivery)}
    return json.dumps(payload, separators=(",", ":")).encode()


class Sender:
    """Sends the outbox's due deliveries from this process, `webhook_concurrency` at a time."""

    def __init__(self, settings: Settings, store: AsyncStore):
        self.settings, self.store = settings, store
        # A claim outlives the longest try (the receiver's time plus the name's resolution) with
        # room to record it; a sender killed mid-try leaves its claim to run out, then another
        # (or its own restart) sends the delivery again.
        self.lease_s = 2 * settings.webhook_timeout_s + 5.0
        self._wake = anyio.Event()

    def wake(self) -> None:
        """Deliveries may be due: look now rather than at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled (the lifespan's end)."""
        limit = self.settings.webhook_concurrency
        timeout = httpx.Timeout(self.settings.webhook_timeout_s)
        async with (
            httpx.AsyncClient(timeout=timeout, follow_redirects=False) as http,
            anyio.create_task_group() as tasks,
        ):
            free = anyio.Semaphore(limit)
            pruned_at = -PRUNE_INTERVAL_S
            while True:
                room = free.value
                try:
                    if time.monotonic() - pruned_at > PRUNE_INTERVAL_S:
                        pruned_at = time.monotonic()
                        await self.store.webhooks.prune(self.settings.event_ttl_s)
                    claimed = await self.store.webhooks.claim(room, lease_s=self.lease_s)
                except UNAVAILABLE:
                    log.exception("webhooks: the job store fails; retrying")
                    claimed = []
                for delivery, endpoint in claimed:
                    await free.acquire()
                    tasks.start_soon(self._send_one, http, free, delivery, endpoint)
                if len(claimed) < room or not room:
                    with anyio.move_on_after(self.settings.webhook_poll_s):
                        await self._wake.wait()
                    self._wake = anyio.Event()

    async def _send_one(
        self,
        http: httpx.AsyncClient,
        free: anyio.Semaphore,
        delivery: WebhookDeliveryRecord,
        endpoint: WebhookEndpointRecord,
    ) -> None:
        try:
            await self.send(http, delivery, endpoint)
        except Exception:  # the loop goes on: the delivery is tried again when its claim ends
            log.exception("webhooks: could not send or record a try of %s", delivery.id)
        finally:
            free.release()
        self.wake()  # the job's next delivery may be due now

    async def send(
        self,
        http: httpx.AsyncClient,
        delivery: WebhookDeliveryRecord,
        endpoint: WebhookEndpointRecord,
    ) -> str | None:
        """One try of `delivery`, recorded; its status after (None: the claim was lost)."""
        started = time.monotonic()
        status_code, error = None, None
        try:
            await anyio.to_thread.run_sync(
                lambda: check_url(endpoint.url, allow_private=self.settings.webhook_allow_private)
            )
            content = body(delivery)
            signed = headers(endpoint.secret, delivery.id, int(time.time()), content)
            # One deadline for the whole try (httpx's applies to each read, which a receiver
            # trickling bytes could stretch past the claim); the answer's body is never read.
            with anyio.fail_after(self.settings.webhook_timeout_s):
                request = http.stream("POST", endpoint.url, content=content, headers=signed)
                async with request as response:
                    status_code = response.status_code
            if not 200 <= status_code < 300:
                error = f"the receiver answered {status_code}"
        except UnsafeURL as exc:
            error = f"refused: {exc}"
        except (httpx.TimeoutException, TimeoutError):
            error = f"no answer within {self.settings.webhook_timeout_s:g} s"
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        status = await self.store.webhooks.record_attempt(
            delivery,
            status_code=status_code,
            error=error[:MAX_ERROR_CHARS] if error else None,
            duration_ms=round((time.monotonic() - started) * 1000),
            delivered=error is None,
            retry_s=self.settings.webhook_retry_s,
        )
        if status is not None and error is not None:
            log.warning("webhook %s to %s: %s (%s)", delivery.id, endpoint.id, error, status)
        return status
