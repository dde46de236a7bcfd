"""`/v1/files`: upload a training archive, list, retrieve, delete.

An upload returns as soon as the archive is on disk, with `status: uploaded`; it is unpacked and
validated afterwards (uploads.py) and becomes `processed` (with its clip count) or `error` (with
`status_details` naming the member at fault). Files belong to the key that uploaded them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ..archives import remove_tree
from ..deps import DataDep, FilesDep, IdempotencyKeyDep, PrincipalDep, SettingsDep
from ..errors import InvalidRequest, PayloadTooLarge
from ..plain_text import check_plain
from ..schemas import FileDeleted, FileObject, ListPage, error_responses
from ..services.files import StagedFile
from ..services.jobs import new_id

router = APIRouter(prefix="/v1/files", tags=["files"])

# fine-tune: a training archive, validated after the upload; input: a first- or last-frame
# image or an input video for POST /v1/videos, checked by the request that names it.
PURPOSES = ("fine-tune", "input")
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
    files: FilesDep,
    settings: SettingsDep,
    data: DataDep,
    principal: PrincipalDep,
    key: IdempotencyKeyDep,
):
    """Multipart `file` + `purpose=fine-tune`: a .zip or .tar(.gz) in the fine-tuning dataset
    layout. Answers at once with `status: uploaded`; poll the file until it is `processed`.
    `purpose=input`: an image or a video a video request names by id (`processed` at once; the
    request checks it as it would an upload of its own)."""
    purpose, upload = await read_upload_form(request)
    file_id = new_id("file-")
    folder = data.upload(file_id)
    try:  # the archive streams to disk here, before the service records it
        size, digest = await run_in_threadpool(
            save_upload, upload.file, folder / "upload", settings.max_upload_bytes
        )
        staged = StagedFile(file_id, folder, upload.filename, purpose, size, digest)
        return await files.create(staged, principal, key)
    except BaseException:
        remove_tree(folder)
        raise


async def read_upload_form(request: Request) -> tuple[str, UploadFile]:
    """The upload's `purpose` and `file`, or a 400 saying which is missing or wrong."""
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
    return purpose, upload


@router.get("", response_model=ListPage[FileObject], responses=error_responses(400))
async def list_files(
    files: FilesDep,
    principal: PrincipalDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(100, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
):
    return await files.list(principal, purpose, after, limit, order)


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404))
async def retrieve_file(file_id: str, files: FilesDep, principal: PrincipalDep):
    return await files.retrieve(file_id, principal)


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
async def delete_file(
    file_id: str, files: FilesDep, principal: PrincipalDep, key: IdempotencyKeyDep
):
    """Delete an upload. A retry with the same Idempotency-Key gets the first answer."""
    return await files.delete(file_id, principal, key)
