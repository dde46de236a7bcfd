"""`/v1/files`: upload a training archive, list, retrieve, delete.

An upload returns as soon as the archive is on disk, with `status: uploaded`; it is unpacked and
validated afterwards (uploads.py) and becomes `processed` (with its clip count) or `error` (with
`status_details` naming the member at fault). Files belong to the key that uploaded them."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ..archives import remove_tree
from ..auth import Principal
from ..datadir import DataDir
from ..deps import (
    DataDep,
    PrincipalDep,
    SettingsDep,
    StoreDep,
    idempotent,
    new_id,
    request_hash,
)
from ..errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from ..plain_text import check_plain
from ..schemas import FileDeleted, FileObject, ListPage, error_responses, file_object, page
from ..store import AsyncStore

router = APIRouter(prefix="/v1/files", tags=["files"])

PURPOSES = ("fine-tune",)
MAX_FORM_FIELDS = 8  # the form's parser refuses more, before reading on
# The form is read by hand (to stream the file to disk), so its schema is declared for the docs.
UPLOAD_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "maxProperties": MAX_FORM_FIELDS,
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(PURPOSES)},
                    },
                }
            }
        },
    }
}


def save_upload(src, dst: Path, max_bytes: int) -> tuple[int, str]:
    """Copy an upload to disk, counting as it goes; returns (bytes, sha256)."""
    digest, size = hashlib.sha256(), 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb") as out:
        while chunk := src.read(1 << 20):
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(
                    f"the file is larger than this server's limit of {max_bytes} bytes",
                    param="file",
                )
            digest.update(chunk)
            out.write(chunk)
    return size, digest.hexdigest()


@router.post(
    "",
    response_model=FileObject,
    openapi_extra=UPLOAD_BODY_DOC,
    responses=error_responses(400, 409),
)
async def create_file(
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    data: DataDep,
    principal: PrincipalDep,
):
    """Multipart `file` + `purpose=fine-tune`: a .zip or .tar(.gz) in the fine-tuning dataset
    layout. Answers at once with `status: uploaded`; poll the file until it is `processed`."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("upload files as multipart/form-data with fields file and purpose")
    form = await request.form(max_files=1, max_fields=MAX_FORM_FIELDS)
    purpose, upload = form.get("purpose"), form.get("file")
    check_plain(purpose if isinstance(purpose, str) else None, "purpose")
    if not purpose:
        raise InvalidRequest(
            "Missing required parameter: purpose",
            param="purpose",
            code="missing_required_parameter",
        )
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose"
        )
    if not isinstance(upload, UploadFile):
        raise InvalidRequest(
            "Missing required parameter: file", param="file", code="missing_required_parameter"
        )
    check_plain(upload.filename, "file")

    file_id = new_id("file-")
    folder = data.upload(file_id)
    try:
        size, digest = await run_in_threadpool(
            save_upload, upload.file, folder / "upload", settings.max_upload_bytes
        )
        payload = request_hash({"sha256": digest, "purpose": purpose, "filename": upload.filename})
        async with idempotent(request, store, payload) as replay:
            if replay.replayed and (row := await store.get_file(replay.resource_id)) is not None:
                remove_tree(folder)
                return file_object(row)
            row = await store.insert_file(
                {
                    "id": file_id,
                    "filename": upload.filename or "upload",
                    "purpose": purpose,
                    "bytes": size,
                    "path": data.relative(folder / "data"),
                    "owner": principal.owner,
                },
                idempotency=replay.key,
            )
    except BaseException:
        remove_tree(folder)
        raise
    request.app.state.validator.wake()
    return file_object(row)


@router.get("", response_model=ListPage[FileObject], responses=error_responses(400))
async def list_files(
    store: StoreDep,
    principal: PrincipalDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(100, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
):
    rows, has_more = await store.list_files(after, limit, order, purpose, principal.sees)
    return page([file_object(r) for r in rows], has_more)


async def find_file(store: AsyncStore, file_id: str, principal: Principal) -> dict:
    """The file, if `principal` may see it; another key's answers 404 as if absent."""
    row = await store.get_file(file_id)
    if row is None or not principal.may_see(row["owner"]):
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return row


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404))
async def retrieve_file(file_id: str, store: StoreDep, principal: PrincipalDep):
    return file_object(await find_file(store, file_id, principal))


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
async def delete_file(
    file_id: str, request: Request, store: StoreDep, data: DataDep, principal: PrincipalDep
):
    """Delete an upload. A retry with the same Idempotency-Key gets the first answer."""
    async with idempotent(request, store, request_hash({"delete": file_id})) as replay:
        if replay.response is not None:  # a retry: the first answer, not a 404
            return replay.response
        await find_file(store, file_id, principal)
        answer = await _delete(store, data, file_id)
        await replay.answer(answer)
    return answer


async def _delete(store: AsyncStore, data: DataDir, file_id: str) -> FileDeleted:
    outcome = await store.delete_file(file_id)
    if outcome == "in_use":
        raise Conflict(
            f"file {file_id} is the training file of a queued or running fine-tuning job; "
            "cancel the job first",
            param="file_id",
            code="file_in_use",
        )
    if outcome == "missing":
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    await run_in_threadpool(shutil.rmtree, data.upload(file_id), True)
    return FileDeleted(id=file_id, deleted=True)
