"""`verify_webhook`: check a delivery from a MegaSlide server as the Standard Webhooks
specification says (https://www.standardwebhooks.com/), before trusting its body."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300  # how far a delivery's timestamp may be from this machine's clock


class WebhookVerificationError(Exception):
    """A delivery whose headers are missing, whose timestamp is too old or too new, or whose
    signature was not made with the endpoint's secret."""


def verify_webhook(
    payload: bytes | str,
    headers: Mapping[str, str],
    secret: str,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> dict[str, Any]:
    """The delivery's event (`{"type", "timestamp", "data"}`) once its signature is checked.

    `payload` is the request body exactly as received (not re-serialized JSON); `headers` its
    headers, in any case; `secret` the endpoint's `whsec_...`. A timestamp more than
    `tolerance_s` from now is refused, so a captured delivery cannot be replayed later. Keep the
    `webhook-id`s handled: a delivery may come more than once (after a retry), under its id.
    Raises WebhookVerificationError.
    """
    body = payload.encode() if isinstance(payload, str) else bytes(payload)
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id = lower["webhook-id"]
        stamp = lower["webhook-timestamp"]
        signatures = lower["webhook-signature"]
    except KeyError as exc:
        raise WebhookVerificationError(f"missing header {exc.args[0]}") from None
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError(f"invalid webhook-timestamp {stamp!r}") from None
    if abs(time.time() - timestamp) > tolerance_s:
        raise WebhookVerificationError(
            f"webhook-timestamp {timestamp} is more than {tolerance_s:g} s from now"
        )
    # A secret written without its base64 padding decodes too (extra padding is ignored).
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX) + "==")
    signed = f"{msg_id}.{timestamp}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
    for signature in signatures.split(" "):
        version, _, value = signature.partition(",")
        if version == "v1" and hmac.compare_digest(value.encode(), expected):
            return json.loads(body)
    raise WebhookVerificationError("no signature matches the secret")
