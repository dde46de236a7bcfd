"""The workers as an API host sees them: whatever the store's registry lists as alive.

A worker (worker.py) registers itself, its device and the model cards it serves, and renews that
with a heartbeat; an API host reads the registry to list models, answer `/readyz`, and add up the
workers' metrics. `Fleet` is that view for an API-only host (`megaslide serve --no-worker`);
`EmbeddedWorker` extends it with a worker in the API's own process (`megaslide serve`), and
`ChildWorkerFleet` with a worker in a child process (`megaslide serve --worker-process`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from .metrics import Totals
from .protocol import ModelCard, WorkerClient, card_from_dict
from .settings import Settings
from .store import JobStore

log = logging.getLogger("megaslide.server")

VIEW_TTL_S = 0.5  # how long a read of the registry serves before the next one


class Fleet(WorkerClient):
    """The live workers of a job store, read from its registry (cached for `VIEW_TTL_S`)."""

    def __init__(self, settings: Settings, check_dataset: Callable[[Path], int]):
        self.settings = settings
        self.store: JobStore | None = None
        self._check_dataset = check_dataset
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._workers: list[dict] = []
        self._cards: dict[str, ModelCard] = {}  # by (name, json) of the published card

    async def start(self, store: JobStore) -> None:
        self.store = store

    async def shutdown(self) -> None:
        pass

    # --- the registry ------------------------------------------------------------------------

    def _view(self, fresh: bool = False) -> list[dict]:
        """The live workers' rows, re-read when older than `VIEW_TTL_S` (or `fresh`)."""
        with self._lock:
            if fresh or time.monotonic() - self._read_at > VIEW_TTL_S:
                self._workers = self.store.live_workers(self.settings.lease_s)
                self._read_at = time.monotonic()
            return self._workers

    def live_workers(self) -> list[dict]:
        keys = ("name", "host", "device", "capacity", "ready", "dead")
        return [
            {**{k: row[k] for k in keys}, "models": [c["name"] for c in row["models"]]}
            for row in self._view()
        ]

    def _card(self, published: dict) -> ModelCard:
        key = repr(sorted(published.items()))
        if key not in self._cards:
            self._cards[key] = card_from_dict(published)
        return self._cards[key]

    def base_cards(self, fresh: bool = False) -> list[ModelCard]:
        """The base models live workers serve (or load), each name once (the first
        registered), with the adapters any of them has registered: a job naming one waits for
        a worker that has it (see `Worker._runnable`). Jobs for a model whose worker is still
        loading wait in the queue."""
        cards: dict[str, ModelCard] = {}
        for row in self._view(fresh):
            if not row["dead"]:
                for published in row["models"]:
                    card = self._card(published)
                    first = cards.setdefault(card.name, card)
                    known = {a["name"] for a in first.adapters}
                    if more := tuple(a for a in card.adapters if a["name"] not in known):
                        cards[card.name] = first.replace(adapters=(*first.adapters, *more))
        return list(cards.values())

    def models(self, fresh: bool = False) -> list[ModelCard]:
        bases = {card.name: card for card in self.base_cards(fresh)}
        fine_tuned = []
        for row in self.store.models() if self.store is not None else []:
            parent = bases.get(row["parent"]) or next(
                (c for c in fine_tuned if c.name == row["parent"]), None
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
        return any(row["ready"] and not row["dead"] for row in self._view())

    @property
    def dead(self) -> str | None:
        return None  # no worker runs in this process

    @property
    def metrics(self) -> Totals:
        return Totals(row["metrics"] for row in self._view() if row["metrics"])

    def check_dataset(self, root: Path) -> int:
        return self._check_dataset(root)

    def wake(self) -> None:
        pass  # workers elsewhere poll the store

    def retry_after(self) -> int:
        mean = self.metrics.mean("video_seconds")
        return max(1, math.ceil(mean)) if mean else 5


class ChildWorkerFleet(Fleet):
    """`Fleet` and the worker it looks after: `main()` (what `megaslide worker` runs) in a spawned
    child process, started with the API and stopped at its shutdown.

    The child has its own interpreter, so the engine's Python and the API's event loop never wait
    on one lock (benchmarks/api_load.py: under 20 clients polling back to back the engine keeps
    3.7x the pace it keeps as a thread of the API's process). A child that dies is started
    again, under the same worker name, so it takes back the jobs the dead one held: after
    `RESTART_DELAY_S`, doubled for each death in a row that came within `STEADY_S` of its start
    (a crash loop, say a model that fails to load) up to `MAX_RESTART_DELAY_S`. One that exits
    with a code in `keep_down` (stopped, or refused to start) is not started again.
    """

    RESTART_DELAY_S = 2.0
    MAX_RESTART_DELAY_S = 60.0
    STEADY_S = 60.0  # a child that lived this long died of something other than its start
    STOP_TIMEOUT_S = 120.0  # SIGTERM: videos requeue at a step boundary, a fine-tune checkpoints

    def __init__(
        self,
        settings: Settings,
        check_dataset: Callable[[Path], int],
        main: Callable[[], None],
        keep_down: Collection[int] = (0,),
    ):
        super().__init__(settings, check_dataset)
        self._main = main  # pickled into the child: a module-level function or a partial of one
        self._keep_down = set(keep_down)
        self._spawn = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.process: multiprocessing.process.BaseProcess | None = None
        self._watcher = threading.Thread(target=self._watch, name="worker-process", daemon=True)

    async def start(self, store: JobStore) -> None:
        await super().start(store)
        self._watcher.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._stop)

    def _watch(self) -> None:
        delay = self.RESTART_DELAY_S
        while True:
            with self._lock:
                if self._stopping.is_set():
                    return
                self.process = self._spawn.Process(target=self._main, name="megaslide-worker")
                self.process.start()
                started = time.monotonic()
            self.process.join()
            code = self.process.exitcode
            if self._stopping.is_set() or code in self._keep_down:
                return
            if time.monotonic() - started >= self.STEADY_S:
                delay = self.RESTART_DELAY_S
            log.warning("the worker process exited with %s; restarting it in %g s", code, delay)
            self._stopping.wait(delay)
            delay = min(2 * delay, self.MAX_RESTART_DELAY_S)

    def _stop(self) -> None:
        with self._lock:
            self._stopping.set()
            process = self.process
        if process is not None and process.is_alive():
            process.terminate()
            process.join(self.STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        if self._watcher.is_alive():
            self._watcher.join()


def fine_tuned_card(row: dict, parent: ModelCard) -> ModelCard:
    """The card of a fine-tuned model (a `models` row): its parent's limits under its own name."""
    return parent.replace(
        name=row["name"],
        kind="fine-tune",
        parent=parent.name,
        source=row["path"],
        created=row["created_at"],
        owner=row.get("owner"),
    )


__all__ = ["Fleet", "fine_tuned_card"]
