"""`/v1/adapters`: upload a LoRA adapter for a served base model, list and retrieve adapters.

An upload returns as soon as the file is on the shared storage, with `status: uploaded`. Each
worker serving the model converts it from its key layout, checks it against the model and
registers it (its factors on the device), and publishes it with the model's card: the adapter
is then `ready` and a video request may name it in `loras`. A file that does not fit becomes
`error`, with `status_details` naming the first bad key.

An uploaded adapter belongs to the key that uploaded it: only that key (and admins) lists it,
names it in a request, or deletes it; another key's answers 404, as if absent. Adapters
registered at start (`--lora`) belong to no one: every key sees them, and they stay.

Jobs naming an adapter run only on workers that have registered it: a worker passes over a
queued video naming one it has not taken up yet (and scans for uploads at once), so a request
made as soon as one worker says `ready` never fails on another that has not looked yet.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ..auth import Principal
from ..datadir import AdapterFolder
from ..deps import (
    DataDep,
    PrincipalDep,
    SettingsDep,
    StoreDep,
    WorkersDep,
    idempotent,
    request_hash,
)
from ..errors import Conflict, InvalidRequest, NotFound
from ..protocol import ModelCard
from ..schemas import AdapterDeleted, AdapterObject, ListPage, error_responses
from .files import save_upload

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
UPLOAD_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "model", "name"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "model": {"type": "string"},
                        "name": {"type": "string", "pattern": NAME.pattern},
                    },
                }
            }
        },
    }
}


def _base(workers, model: str) -> ModelCard:
    card = workers.model(model)
    if card is None or card.kind == "fine-tune":
        raise NotFound(f"no served base model named {model!r}", param="model")
    return card


def _check_safetensors(path: Path) -> None:
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


@router.post(
    "",
    response_model=AdapterObject,
    openapi_extra=UPLOAD_BODY_DOC,
    responses=error_responses(400, 404, 409),
)
async def create_adapter(
    request: Request,
    settings: SettingsDep,
    data: DataDep,
    store: StoreDep,
    workers: WorkersDep,
    principal: PrincipalDep,
):
    """Multipart `file` (a LoRA in safetensors, any Wan key layout), `model` (a served base
    model) and `name`. Answers at once with `status: uploaded`; poll until it is `ready`. A
    retry with the same Idempotency-Key and file gets the first answer."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("upload adapters as multipart/form-data with file, model and name")
    form = await request.form(max_files=1, max_fields=8)
    upload, model, name = form.get("file"), form.get("model"), form.get("name")
    for field, value in (("model", model), ("name", name)):
        if not value or not isinstance(value, str):
            raise InvalidRequest(
                f"Missing required parameter: {field}",
                param=field,
                code="missing_required_parameter",
            )
    if not isinstance(upload, UploadFile):
        raise InvalidRequest(
            "Missing required parameter: file", param="file", code="missing_required_parameter"
        )
    if not NAME.fullmatch(name):
        raise InvalidRequest(
            f"name {name!r}: letters, digits, '_', '.' and '-', at most 64, starting with a "
            "letter or digit",
            param="name",
        )
    card = _base(workers, model)
    folder = data.adapters(card.name)
    partial = folder.partial(name)
    try:
        _, digest = await run_in_threadpool(
            save_upload, upload.file, partial, settings.max_upload_bytes
        )
        await run_in_threadpool(_check_safetensors, partial)
        payload = request_hash({"sha256": digest, "model": card.name, "name": name})
        async with idempotent(request, store, payload) as replay:
            if replay.response is not None:  # a retry: the first answer, not a 409
                return replay.response
            if any(a["name"] == name for a in card.adapters) or folder.file(name).exists():
                raise Conflict(
                    f"{card.name} already has an adapter named {name!r}",
                    param="name",
                    code="adapter_exists",
                )
            await run_in_threadpool(_publish, folder, name, partial, principal.owner, digest)
            answer = AdapterObject(
                id=name,
                model=card.name,
                status="uploaded",
                owned_by=principal.owner,
                created_at=folder.record(name)["created_at"],
            )
            await replay.answer(answer)
    finally:
        partial.unlink(missing_ok=True)
    workers.wake()
    return answer


@router.get("", response_model=ListPage[AdapterObject], responses=error_responses(404))
async def list_adapters(
    data: DataDep, workers: WorkersDep, principal: PrincipalDep, model: str | None = None
):
    """The adapters of every served base model (or `model`'s) that this key may use: ready,
    uploaded or refused."""
    cards = (
        [_base(workers, model)] if model else [c for c in workers.models() if c.kind != "fine-tune"]
    )
    items = [obj for c in cards for obj in _objects(c, data.adapters(c.name), principal)]
    return ListPage[AdapterObject](data=items)


@router.get("/{model}/{name}", response_model=AdapterObject, responses=error_responses(404))
async def retrieve_adapter(
    model: str, name: str, data: DataDep, workers: WorkersDep, principal: PrincipalDep
):
    card = _base(workers, model)
    return _find(card, data.adapters(card.name), name, principal)


@router.delete(
    "/{model}/{name}", response_model=AdapterDeleted, responses=error_responses(404, 409)
)
async def delete_adapter(
    model: str,
    name: str,
    request: Request,
    data: DataDep,
    store: StoreDep,
    workers: WorkersDep,
    principal: PrincipalDep,
):
    """Delete an uploaded adapter: the workers unregister it (its factors leave the device).
    Refused while a queued or running video applies it, and for adapters registered at start.
    A retry with the same Idempotency-Key gets the first answer."""
    async with idempotent(request, store, request_hash({"delete": [model, name]})) as replay:
        if replay.response is not None:  # a retry: the first answer, not a 404
            return replay.response
        card = _base(workers, model)
        folder = data.adapters(card.name)
        found = _find(card, folder, name, principal)
        if not folder.file(name).exists():
            raise Conflict(
                f"adapter {name!r} was registered at the start of a worker (--lora); it is "
                "removed by restarting without it",
                param="name",
                code="adapter_registered_at_start",
            )
        if users := await store.videos_naming_adapter(card.name, name):
            raise Conflict(
                f"adapter {name!r} is applied by {len(users)} queued or running videos (first: "
                f"{users[0]}); cancel them or wait",
                param="name",
                code="adapter_in_use",
            )
        await run_in_threadpool(folder.remove, name)
        answer = AdapterDeleted(id=found.id, model=card.name, deleted=True)
        await replay.answer(answer)
    workers.wake()
    return answer
