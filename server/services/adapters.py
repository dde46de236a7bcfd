"""LoRA adapters of the served base models: an upload is published to the shared storage for the
workers to take up; list, retrieve, delete. An uploaded adapter belongs to the key that uploaded
it; those registered at start (`--lora`) are everyone's."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from ..auth import Principal
from ..datadir import AdapterFolder, DataDir
from ..errors import Conflict, InvalidRequest, NotFound
from ..protocol import ModelCard, WorkerClient
from ..schemas import AdapterDeleted, AdapterObject
from ..store import AsyncStore
from .idempotency import IdempotencyKey, answer_once

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class AdapterUpload:
    """Where an upload of adapter `name` for `card`'s model is written before it is checked."""

    card: ModelCard
    name: str
    partial: Path


class Adapters:
    """The adapters of one server's base models, as its API's principals see them."""

    def __init__(self, store: AsyncStore, workers: WorkerClient, data: DataDir) -> None:
        self.store, self.workers, self.data = store, workers, data

    def base(self, model: str) -> ModelCard:
        """A served base model (not a fine-tune), or 404."""
        card = self.workers.model(model)
        if card is None or card.kind == "fine-tune":
            raise NotFound(f"no served base model named {model!r}", param="model")
        return card

    def stage(self, model: str, name: str) -> AdapterUpload:
        """Where to write an upload of `name` for `model`, once both are valid."""
        if not NAME.fullmatch(name):
            raise InvalidRequest(
                f"name {name!r}: letters, digits, '_', '.' and '-', at most 64, starting with a "
                "letter or digit",
                param="name",
            )
        card = self.base(model)
        return AdapterUpload(card, name, self.data.adapters(card.name).partial(name))

    async def create(
        self,
        upload: AdapterUpload,
        sha256: str,
        principal: Principal,
        key: IdempotencyKey | None,
    ) -> AdapterObject:
        """Publish a written upload as `uploaded`, for the workers to check and register; a retry
        with the same key and file gets the first answer, not a 409."""
        card, name = upload.card, upload.name
        folder = self.data.adapters(card.name)
        await run_in_threadpool(check_safetensors, upload.partial)

        async def work() -> AdapterObject:
            if any(a["name"] == name for a in card.adapters) or folder.file(name).exists():
                raise Conflict(
                    f"{card.name} already has an adapter named {name!r}",
                    param="name",
                    code="adapter_exists",
                )
            await run_in_threadpool(_publish, folder, name, upload.partial, principal.owner, sha256)
            self.workers.wake()
            return AdapterObject(
                id=name,
                model=card.name,
                status="uploaded",
                owned_by=principal.owner,
                created_at=folder.record(name)["created_at"],
            )

        payload = {"sha256": sha256, "model": card.name, "name": name}
        return await answer_once(self.store, key, payload, AdapterObject, work)

    def list(self, principal: Principal, model: str | None) -> list[AdapterObject]:
        """The adapters of every served base model (or `model`'s) that `principal` may use:
        ready, uploaded or refused."""
        cards = (
            [self.base(model)]
            if model
            else [c for c in self.workers.models() if c.kind != "fine-tune"]
        )
        return [obj for c in cards for obj in _objects(c, self.data.adapters(c.name), principal)]

    def retrieve(self, model: str, name: str, principal: Principal) -> AdapterObject:
        card = self.base(model)
        return _find(card, self.data.adapters(card.name), name, principal)

    async def delete(
        self, model: str, name: str, principal: Principal, key: IdempotencyKey | None
    ) -> AdapterDeleted:
        """Delete an uploaded adapter (the workers unregister it); refused while a queued or
        running video applies it, and for adapters registered at start. A retry with the same
        key gets the first answer, not a 404."""

        async def work() -> AdapterDeleted:
            card = self.base(model)
            folder = self.data.adapters(card.name)
            found = _find(card, folder, name, principal)
            if not folder.file(name).exists():
                raise Conflict(
                    f"adapter {name!r} was registered at the start of a worker (--lora); it is "
                    "removed by restarting without it",
                    param="name",
                    code="adapter_registered_at_start",
                )
            if users := await self.store.videos.naming_adapter(card.name, name):
                raise Conflict(
                    f"adapter {name!r} is applied by {len(users)} queued or running videos "
                    f"(first: {users[0]}); cancel them or wait",
                    param="name",
                    code="adapter_in_use",
                )
            await run_in_threadpool(folder.remove, name)
            self.workers.wake()
            return AdapterDeleted(id=found.id, model=card.name, deleted=True)

        return await answer_once(self.store, key, {"delete": [model, name]}, AdapterDeleted, work)


def check_safetensors(path: Path) -> None:
    """A safetensors file starts with its header's length and a JSON header: anything else is
    refused now rather than by the workers."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidRequest("the file is not a safetensors file (too short)", param="file")
        (n,) = struct.unpack("<Q", head)
        try:
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(
                "the file is not a safetensors file (no JSON header)", param="file"
            ) from None
    if not isinstance(header, dict) or not [k for k in header if k != "__metadata__"]:
        raise InvalidRequest("the safetensors file holds no tensors", param="file")


def _objects(card: ModelCard, folder: AdapterFolder, principal: Principal) -> list[AdapterObject]:
    """`card`'s adapters that `principal` may see: those the workers registered (`ready`), then
    uploads they have not taken up yet (`uploaded`) or refused (`error`)."""
    uploads = {name: folder.record(name) for name in folder.names()}
    ready = {  # an upload is ready until deleted, even while a worker still holds it
        a["name"]: a
        for a in card.adapters
        if "sha256" not in a or uploads.get(a["name"], {}).get("sha256") == a["sha256"]
    }
    out = [
        AdapterObject(
            id=name,
            model=card.name,
            status="ready",
            owned_by=a.get("owner"),
            created_at=a.get("created_at"),
            rank=a.get("rank"),
            bytes=a.get("bytes"),
            defaults=a.get("defaults") or {},
        )
        for name, a in ready.items()
        if principal.may_see(a.get("owner"))
    ]
    for name, record in uploads.items():
        if name in ready or not principal.may_see(record["owner"]):
            continue
        error = folder.error(name)
        out.append(
            AdapterObject(
                id=name,
                model=card.name,
                status="error" if error is not None else "uploaded",
                status_details=error,
                owned_by=record["owner"],
                created_at=record["created_at"],
            )
        )
    return out


def _find(card: ModelCard, folder: AdapterFolder, name: str, principal: Principal) -> AdapterObject:
    for obj in _objects(card, folder, principal):
        if obj.id == name:
            return obj
    raise NotFound(f"{card.name} has no adapter named {name!r}", param="name")


def _publish(folder: AdapterFolder, name: str, partial: Path, owner: str | None, sha256: str):
    """Make the upload the adapter `name` unless another upload took the name meanwhile."""
    try:
        folder.publish(name, partial, owner, sha256)
    except FileExistsError:
        raise Conflict(
            f"{folder.path.name} already has an adapter named {name!r}",
            param="name",
            code="adapter_exists",
        ) from None
