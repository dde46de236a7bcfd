"""Timeouts, retry limits and polling intervals, in one place so they can be read and tuned."""

from __future__ import annotations

import httpx

# A request may wait this long for the server; connecting gets much less, so a dead host fails fast.
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# Streams (SSE events, MP4 downloads) can be silent between denoising steps on a large model, so
# their read timeout is longer; a stream that stays silent longer than this is treated as dead.
STREAM_READ_TIMEOUT = 600.0

# Retries after the first attempt, for 408, 409, 429, 5xx and connection errors.
DEFAULT_MAX_RETRIES = 2
# Exponential backoff: 0.5 s, 1 s, 2 s, ... capped at 8 s, each shortened by up to 25 % jitter so
# many clients that failed together do not come back together.
INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
RETRY_JITTER = 0.25
# A server's Retry-After / retry-after-ms is honoured up to this many seconds; a longer one is
# treated as absent (the backoff above applies) rather than stalling a call for minutes.
MAX_RETRY_AFTER = 60.0

# Polling when the server sends no openai-poll-after-ms header.
DEFAULT_POLL_INTERVAL_MS = 1000

# Environment variables read when base_url / api_key are not given.
BASE_URL_ENV = "MEGASLIDE_BASE_URL"
API_KEY_ENV = "MEGASLIDE_API_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
