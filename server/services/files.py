"""Files: an uploaded training archive becomes a record, validated afterwards (uploads.py); list,
retrieve, delete. A file belongs to the key that uploaded it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from ..archives import remove_tree
from ..auth import Principal
from ..datadir import DataDir
from ..errors import Conflict, NotFound
from ..records import FileRecord
from ..schemas import FileDeleted, FileObject, file_object, page
from ..store import AsyncStore
from ..uploads import Validator
from .idempotency import IdempotencyKey, answer_once, create_once

INPUT_PURPOSE = "input"  # an image or video that video requests name by id


@dataclass(frozen=True)
class StagedFile:
    """An upload written to its folder (`folder/upload`) that no record names yet."""

    id: str
    folder: Path
    filename: str | None
    purpose: str
    bytes: int
    sha256: str


class Files:
    """The uploaded files of one server, as its API's principals see them."""

    def __init__(self, store: AsyncStore, data: DataDir, validator: Validator) -> None:
        self.store, self.data, self.validator = store, data, validator

    async def create(
        self, staged: StagedFile, principal: Principal, key: IdempotencyKey | None
    ) -> FileObject:
        """Record a staged upload, `uploaded` until the validator has looked inside; a retry with
        the same key and content gets the file its first request made (this copy is dropped)."""

        # A video's input is checked by each request that names it (videos.py), not here.
        ready = staged.purpose == INPUT_PURPOSE
        path = staged.folder / ("upload" if ready else "data")

        async def insert(idempotency) -> FileRecord:
            return await self.store.files.insert(
                {
                    "id": staged.id,
                    "filename": staged.filename or "upload",
                    "purpose": staged.purpose,
                    "bytes": staged.bytes,
                    "path": self.data.relative(path),
                    "owner": principal.owner,
                    "status": "processed" if ready else "uploaded",
                },
                idempotency=idempotency,
            )

        payload = {"sha256": staged.sha256, "purpose": staged.purpose, "filename": staged.filename}
        row, replayed = await create_once(self.store, key, payload, self.store.files.get, insert)
        if replayed:
            remove_tree(staged.folder)
        elif not ready:
            self.validator.wake()
        return file_object(row)

    async def find(self, file_id: str, principal: Principal) -> FileRecord:
        """The file's record, if `principal` may see it; another key's answers 404 as if absent."""
        row = await self.store.files.get(file_id)
        if row is None or not principal.may_see(row.owner):
            raise NotFound(f"No such File object: {file_id}", param="file_id")
        return row

    async def retrieve(self, file_id: str, principal: Principal) -> FileObject:
        return file_object(await self.find(file_id, principal))

    async def list(
        self,
        principal: Principal,
        purpose: str | None,
        after: str | None,
        limit: int,
        order: str,
    ) -> dict:
        rows, has_more = await self.store.files.page(after, limit, order, purpose, principal.sees)
        return page([file_object(r) for r in rows], has_more)

    async def delete(
        self, file_id: str, principal: Principal, key: IdempotencyKey | None
    ) -> FileDeleted:
        """Delete an upload, refused while a queued or running fine-tune trains on it; a retry
        with the same key gets the first answer, not a 404."""

        async def work() -> FileDeleted:
            await self.find(file_id, principal)
            outcome = await self.store.files.delete(file_id)
            if outcome == "in_use":
                raise Conflict(
                    f"file {file_id} is the training file of a queued or running fine-tuning "
                    "job; cancel the job first",
                    param="file_id",
                    code="file_in_use",
                )
            if outcome == "missing":
                raise NotFound(f"No such File object: {file_id}", param="file_id")
            await run_in_threadpool(shutil.rmtree, self.data.upload(file_id), True)
            return FileDeleted(id=file_id, deleted=True)

        return await answer_once(self.store, key, {"delete": file_id}, FileDeleted, work)
