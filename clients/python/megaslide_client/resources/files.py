"""`client.files`: upload, list, retrieve and delete files (fine-tuning dataset archives)."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Union

from .._pagination import AsyncCursorPage, AsyncPaginator, SyncCursorPage, list_params
from ..types import FileDeleted, FileObject

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient

# A path, an open binary file, raw bytes, or (filename, bytes or binary file).
FileInput = Union[str, "os.PathLike[str]", IO[bytes], bytes, tuple[str, bytes | IO[bytes]]]


def upload_factory(file: FileInput) -> Callable[[], Mapping[str, Any]]:
    """A function returning the multipart `files` mapping afresh for each attempt.

    A retry must send the whole file again: a path is reopened, a seekable file is rewound to
    where it stood at the call, and anything else is read into memory once.
    """
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        opened: list = []

        def from_path() -> Mapping[str, Any]:
            for f in opened:  # the previous attempt's handle
                f.close()
            opened[:] = [open(path, "rb")]
            return {"file": (path.name, opened[0], "application/octet-stream")}

        from_path.close = lambda: [f.close() for f in opened]  # type: ignore[attr-defined]
        return from_path
    if isinstance(file, tuple):
        name, content = file
    elif isinstance(file, (bytes, bytearray)):
        name, content = "upload.bin", bytes(file)
    else:
        name, content = os.path.basename(getattr(file, "name", "") or "upload.bin"), file
    if isinstance(content, (bytes, bytearray)):
        data = bytes(content)
        return lambda: {"file": (name, io.BytesIO(data), "application/octet-stream")}
    if content.seekable():
        start = content.tell()

        def rewound() -> Mapping[str, Any]:
            content.seek(start)
            return {"file": (name, content, "application/octet-stream")}

        return rewound
    data = content.read()
    return lambda: {"file": (name, io.BytesIO(data), "application/octet-stream")}


def _close(factory: Callable[[], Mapping[str, Any]]) -> None:
    close = getattr(factory, "close", None)
    if close is not None:
        close()


class Files:
    """Uploaded files."""

    def __init__(self, client: SyncAPIClient) -> None:
        self._client = client

    def create(
        self, *, file: FileInput, purpose: str = "fine-tune", idempotency_key: str | None = None
    ) -> FileObject:
        """Upload a file. For fine-tuning: a .zip or .tar(.gz) holding the dataset layout.

        The server checks the archive on upload; a bad member is a BadRequestError naming it.
        """
        factory = upload_factory(file)
        try:
            response = self._client.post(
                "/v1/files",
                data={"purpose": purpose},
                files=factory,
                idempotency_key=idempotency_key,
            )
        finally:
            _close(factory)
        return FileObject.from_dict(response.json())

    def retrieve(self, file_id: str) -> FileObject:
        return FileObject.from_dict(self._client.get(f"/v1/files/{file_id}").json())

    def list(
        self,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
    ) -> SyncCursorPage[FileObject]:
        """A page of files; iterating over it walks every following page too."""

        def fetch(cursor: str | None) -> SyncCursorPage[FileObject]:
            params = list_params(purpose=purpose, after=cursor, limit=limit, order=order)
            return SyncCursorPage(
                self._client.get("/v1/files", params=params).json(), FileObject, fetch
            )

        return fetch(after)

    def delete(self, file_id: str) -> FileDeleted:
        return FileDeleted.from_dict(self._client.delete(f"/v1/files/{file_id}").json())


class AsyncFiles:
    """Async twin of Files."""

    def __init__(self, client: AsyncAPIClient) -> None:
        self._client = client

    async def create(
        self, *, file: FileInput, purpose: str = "fine-tune", idempotency_key: str | None = None
    ) -> FileObject:
        """Upload a file (see `Files.create`)."""
        factory = upload_factory(file)
        try:
            response = await self._client.post(
                "/v1/files",
                data={"purpose": purpose},
                files=factory,
                idempotency_key=idempotency_key,
            )
        finally:
            _close(factory)
        return FileObject.from_dict(response.json())

    async def retrieve(self, file_id: str) -> FileObject:
        return FileObject.from_dict((await self._client.get(f"/v1/files/{file_id}")).json())

    def list(
        self,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
    ) -> AsyncPaginator[FileObject]:
        """`await` it for the first page, or `async for` over every file."""

        async def fetch(cursor: str | None) -> AsyncCursorPage[FileObject]:
            params = list_params(purpose=purpose, after=cursor, limit=limit, order=order)
            body = (await self._client.get("/v1/files", params=params)).json()
            return AsyncCursorPage(body, FileObject, fetch)

        return AsyncPaginator(lambda: fetch(after))

    async def delete(self, file_id: str) -> FileDeleted:
        return FileDeleted.from_dict((await self._client.delete(f"/v1/files/{file_id}")).json())
