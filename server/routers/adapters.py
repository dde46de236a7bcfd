"""`/v1/adapters`: upload a LoRA adapter for a served base model, list and retrieve adapters.

An upload returns as soon as the file is on the shared storage, with `status: uploaded`. Each
worker serving the model converts it from its key layout, checks it against the model and
registers it (its factors on the device), and publishes it with the model's card: the adapter
is then `ready` and a video request may name it in `loras`. A file that does not fit becomes
`error`, with `status_details` naming the first bad key. Adapters registered at start
(`--lora`) are listed too. Adapters belong to the model, not to a key: every tenant sees them.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ..deps import DataDep, SettingsDep, WorkersDep
from ..errors import Conflict, InvalidRequest, NotFound
from ..protocol import ModelCard
from ..schemas import AdapterObject, ListPage, error_responses
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


def _objects(card: ModelCard, folder: Path) -> list[AdapterObject]:
    ready = {a["name"]: a for a in card.adapters}
    out = [
        AdapterObject(
            id=name,
            model=card.name,
            status="ready",
            rank=a.get("rank"),
            bytes=a.get("bytes"),
            defaults=a.get("defaults") or {},
        )
        for name, a in ready.items()
    ]
    if folder.is_dir():
        for path in sorted(folder.glob("*.safetensors")):
            if path.stem in ready:
                continue
            error = path.with_suffix(".error")
            failed = error.is_file()
            out.append(
                AdapterObject(
                    id=path.stem,
                    model=card.name,
                    status="error" if failed else "uploaded",
                    status_details=error.read_text() if failed else None,
                )
            )
    return out


@router.post(
    "",
    response_model=AdapterObject,
    openapi_extra=UPLOAD_BODY_DOC,
    responses=error_responses(400, 404, 409),
)
async def create_adapter(
    request: Request, settings: SettingsDep, data: DataDep, workers: WorkersDep
):
    """Multipart `file` (a LoRA in safetensors, any Wan key layout), `model` (a served base
    model) and `name`. Answers at once with `status: uploaded`; poll until it is `ready`."""
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
    target = folder / f"{name}.safetensors"
    if any(a["name"] == name for a in card.adapters) or target.exists():
        raise Conflict(f"{card.name} already has an adapter named {name!r}", param="name")
    partial = folder / f".{name}.partial"
    try:
        await run_in_threadpool(save_upload, upload.file, partial, settings.max_upload_bytes)
        await run_in_threadpool(_check_safetensors, partial)
        partial.rename(target)  # the workers see only whole files
    finally:
        partial.unlink(missing_ok=True)
    workers.wake()
    return AdapterObject(id=name, model=card.name, status="uploaded")


@router.get("", response_model=ListPage[AdapterObject], responses=error_responses(404))
async def list_adapters(data: DataDep, workers: WorkersDep, model: str | None = None):
    """Every served base model's adapters (or `model`'s): ready, uploaded or refused."""
    cards = (
        [_base(workers, model)] if model else [c for c in workers.models() if c.kind != "fine-tune"]
    )
    items = [obj for c in cards for obj in _objects(c, data.root / "adapters" / c.name)]
    return ListPage[AdapterObject](data=items)


@router.get("/{model}/{name}", response_model=AdapterObject, responses=error_responses(404))
async def retrieve_adapter(model: str, name: str, data: DataDep, workers: WorkersDep):
    card = _base(workers, model)
    for obj in _objects(card, data.root / "adapters" / card.name):
        if obj.id == name:
            return obj
    raise NotFound(f"{model} has no adapter named {name!r}", param="name")
