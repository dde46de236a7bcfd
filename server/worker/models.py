"""The models a worker serves: its base models' cards and loaded weights, the fine-tunes made from
them (loaded on demand, the most recent kept), and the LoRA adapters uploaded for them, which it
takes up as they come and routes jobs by."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from pathlib import Path

from megaslide.engine.interfaces import VideoModel
from megaslide.engine.request import RequestError, check_adapter_defaults

from ..datadir import AdapterFolder
from ..protocol import ModelCard, adapter_name, card_to_dict
from ..records import ModelRecord, VideoRecord
from .context import WorkerContext

log = logging.getLogger("megaslide.server")

MAX_LOADED_FINE_TUNES = 2  # fine-tuned models kept loaded beside the base ones (LRU)
ADAPTER_SCAN_S = 1.0  # how often a worker looks for uploaded LoRA adapters


class Models:
    """The cards and loaded models of one worker; base models load once (`load`), fine-tunes
    when a job first names them."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cards = {card.name: card for card in ctx.backend.cards()}
        self._loaded: dict[str, VideoModel] = {}
        self._loaded_ft: OrderedDict[str, VideoModel] = OrderedDict()
        self._ft_cards: dict[str, ModelCard] = {}
        # Fine-tunes served from their base's loaded model, kept as deltas over it: by name,
        # the base's name.
        self._deltas: dict[str, str] = {}
        self.last_adapter_scan = -ADAPTER_SCAN_S

    def load(self) -> None:
        """Load the base models (at the start of the worker's thread)."""
        for name, card in self.cards.items():
            log.info("loading model %s (%s)", name, card.source)
            self._loaded[name] = self.ctx.backend.load(card)

    def close(self) -> None:
        """Close every loaded model (a group of devices stops its processes now)."""
        for model in [*self._loaded.values(), *self._loaded_ft.values()]:
            model.close()
        self._loaded.clear()
        self._loaded_ft.clear()

    def published(self) -> list[dict]:
        """The base models' cards as the registry stores them."""
        return [card_to_dict(c) for c in self.cards.values()]

    def served(self) -> list[str]:
        """The model names this worker runs jobs for: its own, and fine-tunes made from them."""
        names = list(self.cards)
        for row in self.ctx.store.models.list():
            if row.parent in names:
                names.append(row.name)
        return names

    def card(self, name: str) -> ModelCard:
        """The card of a base model served here, or of a fine-tune made from one."""
        if name in self.cards:
            return self.cards[name]
        if name not in self._ft_cards:
            ctx = self.ctx
            row = next((r for r in ctx.store.models.list() if r.name == name), None)
            if row is None or row.parent not in self.cards:
                raise ValueError(f"model {name!r} is not served by worker {ctx.name}")
            parent = self.cards[row.parent]
            resolved = dataclasses.replace(row, path=str(ctx.data.resolve(row.path)))
            card = fine_tuned_card(resolved, parent)
            self._ft_cards[name] = ctx.backend.fine_tuned_card(name, parent, Path(card.source))
        return self._ft_cards[name]

    def video_model(self, name: str) -> VideoModel:
        """The loaded model that runs `name`'s videos: a base model; for a fine-tune, its base's
        when the fine-tune is (or can now be) kept as a delta over it (`runs_on`), else its own
        copy, loaded now, evicting the least recently used."""
        if name in self._loaded:
            return self._loaded[name]
        if name in self._deltas:
            return self._loaded[self._deltas[name]]
        if name in self._loaded_ft:
            self._loaded_ft.move_to_end(name)
            return self._loaded_ft[name]
        card = self.card(name)
        base = self._loaded.get(card.parent)
        if base is not None and self.ctx.backend.add_fine_tune(base, card):
            self._deltas[name] = card.parent
            return base
        model = self.ctx.backend.load(card)
        self._loaded_ft[name] = model
        while len(self._loaded_ft) > MAX_LOADED_FINE_TUNES:
            self._loaded_ft.popitem(last=False)
        return model

    def runs_on(self, name: str) -> str:
        """The model whose weight passes `name`'s videos share: a fine-tune kept as a delta
        runs on its base's (its rows join the base's batches), any other model on its own."""
        return self._deltas.get(name, name)

    def as_delta(self, name: str) -> bool:
        """Whether the fine-tune `name` is served as a delta over its base's loaded model."""
        return name in self._deltas

    # --- adapters ----------------------------------------------------------------------------

    def scan_adapters(self, in_use: set[str]) -> bool:
        """Now and then, at a step boundary: register the LoRA adapters uploaded for the base
        models served here (`DataDir.adapters`), unregister those deleted (once no running
        video applies them: `in_use`), and publish the cards when they changed. A file that
        does not fit gets its refusal written beside it. Never counts as work done."""
        if not self.ctx.backend.takes_adapters:
            return False  # left to the workers that do: a refusal here would be one for all
        if time.monotonic() - self.last_adapter_scan < ADAPTER_SCAN_S:
            return False
        self.last_adapter_scan = time.monotonic()
        ctx, changed = self.ctx, False
        for model, card in list(self.cards.items()):
            folder = ctx.data.adapters(model)
            uploaded = {name: folder.record(name) for name in folder.names()}
            for entry in card.adapters:
                name = entry["name"]
                if "sha256" not in entry or name in in_use:  # registered at start, or in use
                    continue
                if name not in uploaded or uploaded[name]["sha256"] != entry["sha256"]:
                    # Deleted, or deleted and uploaded again under the name.
                    ctx.backend.remove_adapter(card, self._loaded.get(model), name)
                    card = card.replace(adapters=tuple(a for a in card.adapters if a is not entry))
                    changed = True
                    log.info("adapter %s removed from %s", name, model)
            known = {a["name"] for a in card.adapters}
            for name, record in uploaded.items():
                if name in known or folder.error(name) is not None:
                    continue
                entry = self._take_up(card, folder, name)
                if entry is None:
                    continue
                card = card.replace(adapters=(*card.adapters, {**entry, **record}))
                changed = True
                log.info("adapter %s registered on %s", name, model)
            self.cards[model] = card
        if changed:
            ctx.store.workers.publish_cards(ctx.name, ctx.token, self.published())
        return False

    def _take_up(self, card: ModelCard, folder: AdapterFolder, name: str) -> dict | None:
        """Register the uploaded adapter `name` of `card`'s model and return its card entry, or
        write why not beside it and return None. Whatever the file holds, the worker goes on: any
        exception reading, converting, checking or registering it is that adapter's refusal (one
        key's upload must not stop a worker, nor stop it again at every restart)."""
        ctx, model = self.ctx, self._loaded.get(card.name)
        path = folder.file(name)
        try:
            entry = ctx.backend.add_adapter(card, model, name, path)
            try:
                check_adapter_defaults(entry.get("defaults") or {}, ctx.settings.max_steps)
            except RequestError:
                ctx.backend.remove_adapter(card, model, name)
                raise
        except Exception as exc:
            reason = refusal(exc, path, adapter_name(name), ctx.data.root)
            log.warning("adapter %s for %s refused: %s", name, card.name, reason)
            try:
                folder.refuse(name, reason)
            except OSError as e:  # the storage is full or gone: the next scan tries again
                log.warning("adapter %s: could not record its refusal: %s", name, e)
            return None
        return entry

    def runnable(self, row: VideoRecord) -> bool:
        """Whether this worker can take the queued video `row` now: not while it names an
        adapter uploaded here but not yet taken up (the scan runs at the next tick), or one
        another live worker has and this one does not. One that no worker has is taken, to
        fail naming the adapter. A worker whose backend takes no adapters leaves a video that names any to another live worker of its model."""
        names = {c["name"] for c in row.spec.get("loras") or ()}
        ctx = self.ctx
        if names and not ctx.backend.takes_adapters:
            # Left to a worker that takes adapters; with none live, taken here to fail naming why.
            return not any(
                w.name != ctx.name and not w.dead and any(c["name"] == row.model for c in w.models)
                for w in ctx.store.workers.live(ctx.settings.lease_s)
            )
        card = self.cards.get(row.model)
        missing = names - {a["name"] for a in card.adapters} if card is not None else set()
        if not missing:
            return True
        folder = ctx.data.adapters(row.model)
        if any(folder.file(n).exists() and folder.error(n) is None for n in missing):
            self.last_adapter_scan = -math.inf  # take it up at once
            return False
        elsewhere = {
            a["name"]
            for w in ctx.store.workers.live(ctx.settings.lease_s)
            if w.name != ctx.name and not w.dead
            for c in w.models
            if c["name"] == row.model
            for a in c.get("adapters") or ()
        }
        return not missing & elsewhere


def refusal(exc: BaseException, path: Path, shown: str, root: Path) -> str:
    """Why an adapter was refused, as its owner reads it: the file called by the adapter's name,
    and nothing of where the server keeps its storage."""
    text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    text = text.replace(str(path), shown).replace(str(root), "<storage>")
    return text[:2000]  # an exception may quote much of a hostile file


def fine_tuned_card(model: ModelRecord, parent: ModelCard) -> ModelCard:
    """The card of a fine-tuned model: its parent's limits under its own name."""
    return parent.replace(
        name=model.name,
        kind="fine-tune",
        parent=parent.name,
        source=model.path,
        created=model.created_at,
        owner=model.owner,
    )
