"""`JobStore`: the store's repositories over one opened database, the object the server, the
workers and the benchmarks hold."""

from __future__ import annotations

from ..settings import DEFAULT_CRASH_LIMIT
from .database import Database
from .files import FileStore
from .fine_tunes import FineTuneStore
from .jobs import Jobs
from .keys import IdempotencyKeys
from .models import ModelStore
from .videos import VideoStore
from .webhooks import WebhookStore
from .workers import WorkerRegistry


class JobStore:
    """Videos, fine-tunes, files, fine-tuned models, workers, idempotency keys and webhooks, each a
    repository (`store.videos.get(id)`) sharing one database; `jobs` spans both kinds of job.
    A job whose worker dies `crash_limit` times fails instead of running again."""

    def __init__(self, url: str, *, crash_limit: int = DEFAULT_CRASH_LIMIT):
        if crash_limit < 1:
            raise ValueError(f"crash_limit must be at least 1, got {crash_limit}")
        self.url = url
        self.crash_limit = crash_limit
        self.db = Database(url)
        self.videos = VideoStore(self.db, crash_limit=crash_limit)
        self.fine_tunes = FineTuneStore(self.db, crash_limit=crash_limit)
        self.files = FileStore(self.db)
        self.models = ModelStore(self.db)
        self.workers = WorkerRegistry(self.db, self.videos, self.fine_tunes)
        self.keys = IdempotencyKeys(self.db)
        self.jobs = Jobs(self.db)
        self.webhooks = WebhookStore(self.db)

    def close(self) -> None:
        """Close the database's connections."""
        self.db.close()
