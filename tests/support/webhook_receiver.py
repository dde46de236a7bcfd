"""A webhook receiver for tests: an HTTP server on 127.0.0.1 in a thread of the test process that
records every POST and answers as told, and dedups on `webhook-id` as a receiver must to turn
at-least-once delivery into exactly once."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() on arrival

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def event(self) -> dict:
        return json.loads(self.body)


class Receiver:
    """Answers `statuses` in turn (then 200), each after `delay_s`; while `hold` is clear, a
    request waits for it (the answer a killed sender never reads). Use as a context manager."""

    def __init__(self, statuses: tuple[int, ...] = (), delay_s: float = 0.0):
        self.statuses = list(statuses)
        self.delay_s = delay_s
        self.hold = threading.Event()
        self.hold.set()
        self.received: list[Received] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length", 0))
                body = self.rfile.read(length)
                if len(body) < length:  # the sender died mid-request: no request was made
                    self.close_connection = True
                    return
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.lock:
                    receiver.received.append(Received(headers, body, time.monotonic()))
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.hold.wait(60)
                time.sleep(receiver.delay_s)
                try:
                    self.send_response(status)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender went away (killed) before the answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()

    def all(self) -> list[Received]:
        with self.lock:
            return list(self.received)

    def unique(self, secret: str) -> list[dict]:
        """Each message once, in the order of its first arrival, its signature checked by the
        `standardwebhooks` package (which raises on a bad one)."""
        seen, out = set(), []
        for r in self.all():
            Webhook(secret).verify(r.body, r.headers)
            if r.id not in seen:
                seen.add(r.id)
                out.append({"id": r.id, **r.event})
        return out
