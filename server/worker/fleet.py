"""The workers as an API host sees them: whatever the store's registry lists as alive, and the one
worker the host runs itself, if any.

A worker registers itself, its device and the model cards it serves, and renews that with a
heartbeat; an API host reads the registry to list models, answer `/readyz`, and add up the
workers' metrics. `Fleet` is that view. It may own a worker of its own: `WorkerThread`, in a
thread of the API's process (`megaslide serve`), whose live state speaks for it ahead of the
registry; or `process.WorkerProcess`, in a child process (`megaslide serve --worker-process`),
seen through the registry like any other. Without one (`megaslide serve --no-worker`) it only
looks.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..backend import Backend
from ..metrics import Totals
from ..protocol import ModelCard, WorkerClient, card_from_dict
from ..records import WorkerRecord
from ..settings import Settings
from ..store import JobStore
from .heartbeat import default_name
from .loop import Worker
from .models import fine_tuned_card
from .process import WorkerProcess

VIEW_TTL_S = 0.5  # how long a read of the registry serves before the next one


class WorkerThread:
    """A worker in a thread of this process, on the models `backend` provides, beside any other
    workers of the same store."""

    def __init__(self, settings: Settings, backend: Backend):
        self.settings, self.backend = settings, backend
        self.worker: Worker | None = None
        self._thread: threading.Thread | None = None

    def start(self, store: JobStore) -> None:
        """Register a worker of `store` and run it on a thread of its own."""
        # A worker can start again after a stop (an app's lifespan run twice): a new one.
        name = self.settings.worker_name or default_name(self.backend.device_name)
        self.worker = Worker(self.settings, self.backend, store, name)
        self.worker.register()
        self._thread = threading.Thread(
            target=self.worker.run, name="megaslide-worker", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop at the next step boundary and leave the registry (blocks until then)."""
        if self.worker is None:
            return
        self.worker.stop.set()
        self.worker.wake.set()
        self._thread.join()
        self.worker.close()


class Fleet(WorkerClient):
    """The live workers of a job store, read from its registry (cached for `VIEW_TTL_S`), and
    `own`, the worker this host runs, if any."""

    def __init__(
        self,
        settings: Settings,
        check_dataset: Callable[[Path], int],
        own: WorkerThread | WorkerProcess | None = None,
    ):
        self.settings = settings
        self.store: JobStore | None = None
        self.own = own
        self._check_dataset = check_dataset
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._workers: list[WorkerRecord] = []
        self._cards: dict[str, ModelCard] = {}  # by (name, json) of the published card

    @classmethod
    def embedded(cls, settings: Settings, backend: Backend) -> Fleet:
        """`megaslide serve`'s: a worker in a thread of this process on `backend`'s models."""
        return cls(settings, backend.check_dataset, WorkerThread(settings, backend))

    async def start(self, store: JobStore) -> None:
        self.store = store
        if self.own is not None:
            self.own.start(store)

    async def shutdown(self) -> None:
        if self.own is not None:
            await asyncio.to_thread(self.own.stop)

    @property
    def _here(self) -> Worker | None:
        """The worker running in this process, whose live state outranks the registry's."""
        return self.own.worker if isinstance(self.own, WorkerThread) else None

    # --- the registry ------------------------------------------------------------------------

    def _view(self, fresh: bool = False) -> list[WorkerRecord]:
        """The live workers' records, re-read when older than `VIEW_TTL_S` (or `fresh`)."""
        with self._lock:
            if fresh or time.monotonic() - self._read_at > VIEW_TTL_S:
                self._workers = self.store.workers.live(self.settings.lease_s)
                self._read_at = time.monotonic()
            return self._workers

    def live_workers(self) -> list[dict]:
        return [
            {
                "name": w.name,
                "host": w.host,
                "device": w.device,
                "capacity": w.capacity,
                "ready": w.ready,
                "dead": w.dead,
                "models": [c["name"] for c in w.models],
            }
            for w in self._view()
        ]

    def _card(self, published: dict) -> ModelCard:
        key = repr(sorted(published.items()))
        if key not in self._cards:
            self._cards[key] = card_from_dict(published)
        return self._cards[key]

    def base_cards(self, fresh: bool = False) -> list[ModelCard]:
        """The base models live workers serve (or load), each name once (the first
        registered), with the adapters any of them has registered: a job naming one waits for
        a worker that has it (see `Models.runnable`). Jobs for a model whose worker is still
        loading wait in the queue. This process's own worker's cards come first, exact (with
        the model's own rules), even before its first heartbeat says they are ready."""
        here = self._here
        cards: dict[str, ModelCard] = dict(here.cards) if here is not None else {}
        own = set(cards)
        for w in self._view(fresh):
            if not w.dead:
                for published in w.models:
                    card = self._card(published)
                    if card.name in own:
                        continue
                    first = cards.setdefault(card.name, card)
                    known = {a["name"] for a in first.adapters}
                    if more := tuple(a for a in card.adapters if a["name"] not in known):
                        cards[card.name] = first.replace(adapters=(*first.adapters, *more))
        return list(cards.values())

    def models(self, fresh: bool = False) -> list[ModelCard]:
        bases = {card.name: card for card in self.base_cards(fresh)}
        fine_tuned = []
        for row in self.store.models.list() if self.store is not None else []:
            parent = bases.get(row.parent) or next(
                (c for c in fine_tuned if c.name == row.parent), None
            )
            if parent is not None:
                fine_tuned.append(fine_tuned_card(row, parent))
        return [*bases.values(), *fine_tuned]

    def model(self, name: str) -> ModelCard | None:
        card = super().model(name)
        if card is None:  # made or registered since the last read, perhaps
            card = next((m for m in self.models(fresh=True) if m.name == name), None)
        return card

    @property
    def ready(self) -> bool:
        if (w := self._here) is not None:
            return w.ready and w.dead is None and w.trouble is None
        return any(w.ready and not w.dead for w in self._view())

    @property
    def dead(self) -> str | None:
        w = self._here
        return w.dead if w is not None else None

    @property
    def trouble(self) -> str | None:
        w = self._here
        return w.trouble if w is not None else None

    @property
    def metrics(self) -> Totals:
        """The live workers' as they last published them; this process's worker's live."""
        w = self._here
        published = [
            other.metrics
            for other in self._view()
            if other.metrics and (w is None or other.name != w.name)
        ]
        return Totals([*published, w.metrics.snapshot()] if w is not None else published)

    def check_dataset(self, root: Path) -> int:
        return self._check_dataset(root)

    def wake(self) -> None:
        # Only this process's worker is woken: workers elsewhere poll the store.
        if (w := self._here) is not None:
            w.wake.set()

    def retry_after(self) -> int:
        mean = self.metrics.mean("video_seconds")
        return max(1, math.ceil(mean)) if mean else 5
