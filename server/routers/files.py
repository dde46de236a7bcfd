"""`/v1/files`: upload a training archive (validated on upload), list, retrieve, delete."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ..archives import ArchiveError, extract_archive, remove_tree
from ..deps import (
    DataDep,
    SettingsDep,
    StoreDep,
    WorkersDep,
    idempotency,
    new_id,
    replayed,
    request_hash,
)
from ..errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from ..schemas import FileDeleted, FileObject, ListPage, error_responses, file_object, page
from ..store import AsyncStore

router = APIRouter(prefix="/v1/files", tags=["files"])

PURPOSES = ("fine-tune",)
# The form is read by hand (to stream the file to disk), so its schema is declared for the docs.
UPLOAD_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
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
    request: Request, store: StoreDep, workers: WorkersDep, settings: SettingsDep, data: DataDep
):
    """Multipart `file` + `purpose=fine-tune`: a .zip or .tar(.gz) in the fine-tuning dataset layout."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("upload files as multipart/form-data with fields file and purpose")
    form = await request.form(max_files=1, max_fields=8)
    purpose, upload = form.get("purpose"), form.get("file")
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

    file_id = new_id("file-")
    folder = data.upload(file_id)
    try:
        size, digest = await run_in_threadpool(
            save_upload, upload.file, folder / "upload", settings.max_upload_bytes
        )
        payload = request_hash({"sha256": digest, "purpose": purpose, "filename": upload.filename})
        prior = await replayed(request, store, payload)
        if prior is not None and (row := await store.get_file(prior)) is not None:
            remove_tree(folder)
            return file_object(row)
        root = await run_in_threadpool(
            extract_archive, folder / "upload", folder / "data", settings.max_extracted_bytes
        )
        clips = await run_in_threadpool(workers.check_dataset, root)
    except (ArchiveError, ValueError) as e:
        remove_tree(folder)
        raise InvalidRequest(f"{upload.filename}: {e}", param="file", code="invalid_file") from None
    except BaseException:
        remove_tree(folder)
        raise
    (folder / "upload").unlink()  # the unpacked copy is what training reads
    row = await store.insert_file(
        {
            "id": file_id,
            "filename": upload.filename or "upload",
            "purpose": purpose,
            "bytes": size,
            "path": str(root),
            "clips": clips,
        },
        idempotency=idempotency(request, payload),
    )
    return file_object(row)


@router.get("", response_model=ListPage[FileObject], responses=error_responses(400))
async def list_files(
    store: StoreDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(100, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
):
    rows, has_more = await store.list_files(after, limit, order, purpose)
    return page([file_object(r) for r in rows], has_more)


async def find_file(store: AsyncStore, file_id: str) -> dict:
    row = await store.get_file(file_id)
    if row is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return row


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404))
async def retrieve_file(file_id: str, store: StoreDep):
    return file_object(await find_file(store, file_id))


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
async def delete_file(file_id: str, store: StoreDep, data: DataDep):
    await find_file(store, file_id)
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
