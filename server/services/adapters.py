"""LoRA adapters of the served base models: an upload is published to the shared storage for the
workers to take up; list, retrieve, delete. An uploaded adapter belongs to the key that uploaded
it; those registered at start (`--lora`) are everyone's."""

from __future__ import annotations

import contextlib
import json
import math
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from ..auth import Principal
from ..datadir import AdapterFolder, DataDir
from ..errors import Conflict, InvalidRequest, NotFound, QuotaExceeded
from ..protocol import ModelCard, WorkerClient, adapter_id, adapter_name
from ..schemas import AdapterDeleted, AdapterObject
from ..settings import Settings
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
    """The adapters of one server's base models, as its API's principals see them. An upload is
    stored under an id that names its owner (`adapter_id`), and shown to its owner by its name."""

    def __init__(
        self, store: AsyncStore, workers: WorkerClient, settings: Settings, data: DataDir
    ) -> None:
        self.store, self.workers, self.settings, self.data = store, workers, settings, data

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
        with the same key and file gets the first answer, not a 409. A key that is not an
        admin's keeps at most `max_adapters_per_key` adapters of `max_adapter_bytes_per_key`."""
        card, name = upload.card, upload.name
        folder = self.data.adapters(card.name)
        await run_in_threadpool(check_safetensors, upload.partial)
        adapter = adapter_id(principal.owner, name)
        s = self.settings
        quota = None if principal.admin else (s.max_adapters_per_key, s.max_adapter_bytes_per_key)

        async def work() -> AdapterObject:
            # The key's own adapter, or one registered at start (every key's): another key's
            # upload of the name is in its own namespace, neither a conflict nor a hint.
            if (
                any(a["name"] == adapter for a in card.adapters)
                or any(a["name"] == name and "sha256" not in a for a in card.adapters)
                or folder.file(adapter).exists()
            ):
                raise Conflict(
                    f"{card.name} already has an adapter named {name!r}",
                    param="name",
                    code="adapter_exists",
                )
            await run_in_threadpool(
                _publish, folder, adapter, upload.partial, principal.owner, sha256, quota
            )
            self.workers.wake()
            return AdapterObject(
                id=name,
                model=card.name,
                status="uploaded",
                owned_by=principal.owner,
                created_at=folder.record(adapter)["created_at"],
            )

        payload = {"sha256": sha256, "model": card.name, "name": name}
        return await answer_once(self.store, key, payload, AdapterObject, work)

    def list(self, principal: Principal, model: str | None) -> list[AdapterObject]:
        """The adapters of every served base model (or `model`'s) that `principal` may use:
        ready, uploaded or refused."""
        models = [model] if model else self._models()
        return [obj for m in models for _, obj in self._entries(m, principal)]

    def retrieve(self, model: str, name: str, principal: Principal) -> AdapterObject:
        return self._find(model, name, principal)[1]

    async def delete(
        self, model: str, name: str, principal: Principal, key: IdempotencyKey | None
    ) -> AdapterDeleted:
        """Delete an uploaded adapter (the workers unregister it); refused while a queued or
        running video applies it, and for adapters registered at start. A retry with the same
        key gets the first answer, not a 404. Works while no worker serves the model, too."""

        async def work() -> AdapterDeleted:
            adapter, found = self._find(model, name, principal)
            folder = self.data.adapters(found.model)
            if not folder.file(adapter).exists():
                raise Conflict(
                    f"adapter {name!r} was registered at the start of a worker (--lora); it is "
                    "removed by restarting without it",
                    param="name",
                    code="adapter_registered_at_start",
                )
            if users := await self.store.videos.naming_adapter(found.model, adapter):
                raise Conflict(
                    f"adapter {name!r} is applied by {len(users)} queued or running videos "
                    f"(first: {users[0]}); cancel them or wait",
                    param="name",
                    code="adapter_in_use",
                )
            await run_in_threadpool(folder.remove, adapter)
            self.workers.wake()
            return AdapterDeleted(id=found.id, model=found.model, deleted=True)

        return await answer_once(self.store, key, {"delete": [model, name]}, AdapterDeleted, work)

    def _registered(self, model: str) -> tuple[str, tuple[dict, ...]]:
        """A base model's name and the adapters its live workers registered. A model with
        uploads on the storage that no live worker serves now has none registered: its uploads
        are still listed and can be deleted (an upload that stopped the workers of an earlier
        version must not be stuck)."""
        card = self.workers.model(model)
        if card is not None and card.kind != "fine-tune":
            return card.name, card.adapters
        if NAME.fullmatch(model) and self.data.adapters(model).path.is_dir():
            return model, ()
        raise NotFound(f"no served base model named {model!r}", param="model")

    def _models(self) -> list[str]:
        """The served base models, then any others with uploads on the storage."""
        served = [c.name for c in self.workers.models() if c.kind != "fine-tune"]
        stored = self.data.adapter_models()
        return served + [m for m in stored if m not in served and NAME.fullmatch(m)]

    def _entries(self, model: str, principal: Principal) -> list[tuple[str, AdapterObject]]:
        """`model`'s adapters that `principal` may see, by id: those the workers registered
        (`ready`), then uploads they have not taken up yet (`uploaded`) or refused (`error`)."""
        name, registered = self._registered(model)
        folder = self.data.adapters(name)
        uploads = {adapter: folder.record(adapter) for adapter in folder.names()}
        ready = {  # an upload is ready until deleted, even while a worker still holds it
            a["name"]: a
            for a in registered
            if "sha256" not in a
            or (a["name"] in uploads and uploads[a["name"]]["sha256"] == a["sha256"])
        }
        out = [
            (
                adapter,
                AdapterObject(
                    id=_shown(adapter, a.get("owner"), principal),
                    model=name,
                    status="ready",
                    owned_by=a.get("owner"),
                    created_at=a.get("created_at"),
                    rank=a.get("rank"),
                    bytes=a.get("bytes"),
                    defaults=a.get("defaults") or {},
                ),
            )
            for adapter, a in ready.items()
            if principal.may_see(a.get("owner"))
        ]
        for adapter, record in uploads.items():
            if adapter in ready or not principal.may_see(record["owner"]):
                continue
            error = folder.error(adapter)
            obj = AdapterObject(
                id=_shown(adapter, record["owner"], principal),
                model=name,
                status="error" if error is not None else "uploaded",
                status_details=error,
                owned_by=record["owner"],
                created_at=record["created_at"],
            )
            out.append((adapter, obj))
        return out

    def _find(self, model: str, name: str, principal: Principal) -> tuple[str, AdapterObject]:
        """The adapter `principal` calls `name` (its own before one registered at start), by
        id; 404 when it sees none."""
        found = [(a, obj) for a, obj in self._entries(model, principal) if obj.id == name]
        found.sort(key=lambda f: f[1].owned_by != principal.owner)
        if not found:
            raise NotFound(f"{model} has no adapter named {name!r}", param="name")
        return found[0]


# What the engine takes a LoRA factor in (`lora.FACTOR_DTYPES`), by safetensors' names and item
# sizes; an `.alpha` (one number) may be any real type.
FACTOR_DTYPES = {"F16": 2, "BF16": 2, "F32": 4}
ALPHA_DTYPES = {**FACTOR_DTYPES, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
JSON_METADATA = ("lora_adapter_metadata", "megaslide.sampling")  # metadata entries holding JSON
MAX_HEADER_BYTES = 100_000_000
MAX_DIMS = 4  # a LoRA factor is a matrix (a convolution's, 4-d); bounds the work of its size


def check_safetensors(path: Path) -> None:
    """A safetensors file of LoRA factors, as far as it can be told without reading the tensors:
    its header's length, then a JSON header (no deeper than the parser recurses) whose every
    tensor has a factor's dtype, a shape with elements and bytes within the file, and whose
    metadata are strings (those holding JSON, JSON objects). Anything else is refused now, with
    a 400, rather than by the workers."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidRequest("the file is not a safetensors file (too short)", param="file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise InvalidRequest(
                "the file is not a safetensors file (its header length is wrong)", param="file"
            )
        header = _json(f.read(n), "its safetensors header")
    if not isinstance(header, dict):
        raise InvalidRequest("the file is not a safetensors file (no JSON header)", param="file")
    _check_metadata(header.pop("__metadata__", {}))
    if not header:
        raise InvalidRequest("the safetensors file holds no tensors", param="file")
    for key, info in header.items():
        _check_tensor(key, info, size - 8 - n)


def _json(raw: bytes | str, what: str):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest(f"the file is refused: {what} is not JSON", param="file") from None
    except RecursionError:  # the parser's guard against a stack overflow: 400, not 500
        raise InvalidRequest(
            f"the file is refused: {what} is nested too deeply", param="file"
        ) from None


def _check_metadata(metadata) -> None:
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidRequest(
            "the safetensors file's __metadata__ must map names to strings", param="file"
        )
    for entry in JSON_METADATA:
        if entry in metadata and not isinstance(_json(metadata[entry], f"its {entry}"), dict):
            raise InvalidRequest(
                f"the safetensors file's {entry} metadata must be a JSON object", param="file"
            )


def _check_tensor(key: str, info, data_bytes: int) -> None:
    """A tensor's header entry: a factor's dtype (any number for an `.alpha`), a shape with at
    least one element (one, for an `.alpha`), and offsets spanning its bytes inside the file."""
    shown = key[:200]
    if not isinstance(info, dict):
        raise InvalidRequest(f"{shown}: not a tensor entry", param="file")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    alpha = key.endswith(".alpha")
    sizes = ALPHA_DTYPES if alpha else FACTOR_DTYPES
    if not isinstance(dtype, str) or dtype not in sizes:
        allowed = "a number" if alpha else ", ".join(FACTOR_DTYPES)
        raise InvalidRequest(
            f"{shown}: dtype {str(dtype)[:20]}; it must be {allowed}", param="file"
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(map(_count, shape)):
        raise InvalidRequest(
            f"{shown}: its shape is not a list of at most {MAX_DIMS} sizes", param="file"
        )
    elements = math.prod(shape)
    if elements == 0 or (alpha and elements != 1):
        need = "one number" if alpha else "at least one element (a factor of rank 0?)"
        raise InvalidRequest(f"{shown}: shape {shape}; it must hold {need}", param="file")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_count(o) for o in offsets)
        or offsets[1] - offsets[0] != elements * sizes[dtype]
        or offsets[1] > data_bytes
    ):
        raise InvalidRequest(f"{shown}: its data_offsets do not fit the file", param="file")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(adapter: str, owner: str | None, principal: Principal) -> str:
    """The id an adapter is shown under: its name to its owner (and for one registered at
    start), its full id to an admin looking at another key's."""
    return adapter_name(adapter) if owner in (None, principal.owner) else adapter


_PUBLISHING = threading.Lock()  # a key's quota is checked and its upload published as one step


def _publish(
    folder: AdapterFolder,
    adapter: str,
    partial: Path,
    owner: str | None,
    sha256: str,
    quota: tuple[int, int] | None,
) -> None:
    """Make the upload the adapter `adapter` unless another upload took the id meanwhile, or
    the owner would hold more than its `quota` (adapters, bytes) with it."""
    with _PUBLISHING:
        if quota is not None:
            _check_quota(folder.path.parent, owner, partial.stat().st_size, *quota)
        try:
            folder.publish(adapter, partial, owner, sha256)
        except FileExistsError:
            raise Conflict(
                f"{folder.path.name} already has an adapter named {adapter_name(adapter)!r}",
                param="name",
                code="adapter_exists",
            ) from None


def _check_quota(root: Path, owner: str | None, size: int, count: int, nbytes: int) -> None:
    """QuotaExceeded when `owner`'s uploads under `root` (every model's) and one more of
    `size` bytes would be more than `count` adapters or `nbytes` bytes."""
    sizes = []
    for path in root.glob(f"*/{adapter_id(owner, '*')}.safetensors"):
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
            sizes.append(path.stat().st_size)
    if len(sizes) + 1 > count:
        raise QuotaExceeded(
            f"this API key keeps {len(sizes)} adapters, as many as it may "
            f"(max_adapters_per_key={count}); delete one first",
            param="file",
        )
    if sum(sizes) + size > nbytes:
        raise QuotaExceeded(
            f"this API key's adapters would take {sum(sizes) + size} bytes, more than it may "
            f"keep (max_adapter_bytes_per_key={nbytes}); delete some first",
            param="file",
        )
