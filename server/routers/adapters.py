"""`/v1/adapters`: upload a LoRA adapter for a served base model, list and retrieve adapters.

An upload returns as soon as the file is on the shared storage, with `status: uploaded`. Each
worker serving the model converts it from its key layout, checks it against the model and
registers it (its factors on the device), and publishes it with the model's card: the adapter
is then `ready` and a video request may name it in `loras`. A file that does not fit becomes
`error`, with `status_details` naming the first bad key.

An uploaded adapter belongs to the key that uploaded it: only that key (and admins) lists it,
names it in a request, or deletes it; another key's answers 404, as if absent. Names are per
key (two keys may each have a `style`), and a key keeps at most `max_adapters_per_key` uploads
of `max_adapter_bytes_per_key` bytes (429). Adapters registered at start (`--lora`) belong to
no one: every key sees them, and they stay.

Jobs naming an adapter run only on workers that have registered it: a worker passes over a
queued video naming one it has not taken up yet (and scans for uploads at once), so a request
made as soon as one worker says `ready` never fails on another that has not looked yet.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ..deps import AdaptersDep, IdempotencyKeyDep, PrincipalDep, SettingsDep
from ..errors import InvalidRequest
from ..schemas import AdapterDeleted, AdapterObject, ListPage, error_responses
from ..services.adapters import NAME
from .files import save_upload

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

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


@router.post(
    "",
    response_model=AdapterObject,
    openapi_extra=UPLOAD_BODY_DOC,
    responses=error_responses(400, 404, 409, 429),
)
async def create_adapter(
    request: Request,
    adapters: AdaptersDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    key: IdempotencyKeyDep,
):
    """Multipart `file` (a LoRA in safetensors, any Wan key layout), `model` (a served base
    model) and `name`. Answers at once with `status: uploaded`; poll until it is `ready`. A
    retry with the same Idempotency-Key and file gets the first answer."""
    upload, model, name = await read_upload_form(request)
    staged = adapters.stage(model, name)
    try:  # the file streams to disk here, before the service checks and publishes it
        _, digest = await run_in_threadpool(
            save_upload, upload.file, staged.partial, settings.max_upload_bytes
        )
        return await adapters.create(staged, digest, principal, key)
    finally:
        staged.partial.unlink(missing_ok=True)


async def read_upload_form(request: Request) -> tuple[UploadFile, str, str]:
    """The upload's `file`, `model` and `name`, or a 400 saying which is missing."""
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
    return upload, model, name


@router.get("", response_model=ListPage[AdapterObject], responses=error_responses(404))
async def list_adapters(adapters: AdaptersDep, principal: PrincipalDep, model: str | None = None):
    """The adapters of every served base model (or `model`'s) that this key may use: ready,
    uploaded or refused."""
    return ListPage[AdapterObject](data=adapters.list(principal, model))


@router.get("/{model}/{name}", response_model=AdapterObject, responses=error_responses(404))
async def retrieve_adapter(model: str, name: str, adapters: AdaptersDep, principal: PrincipalDep):
    return adapters.retrieve(model, name, principal)


@router.delete(
    "/{model}/{name}", response_model=AdapterDeleted, responses=error_responses(404, 409)
)
async def delete_adapter(
    model: str, name: str, adapters: AdaptersDep, principal: PrincipalDep, key: IdempotencyKeyDep
):
    """Delete an uploaded adapter: the workers unregister it (its factors leave the device).
    Refused while a queued or running video applies it, and for adapters registered at start.
    A retry with the same Idempotency-Key gets the first answer."""
    return await adapters.delete(model, name, principal, key)
