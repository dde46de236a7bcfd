"""`client.files`: upload, list, retrieve and delete files (fine-tuning dataset archives)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Union

import httpx

from .._pagination import AsyncPaginator, SyncCursorPage
from .._polling import Watch
from .._progress import ProgressBar
from ..types import FileDeleted, FileObject

if TYPE_CHECKING:
    from .._base_client import AsyncAPIClient, SyncAPIClient

# A path, an open binary file, raw bytes, or (filename, bytes or binary file).
FileInput = Union[str, "os.PathLike[str]", IO[bytes], bytes, tuple[str, bytes | IO[bytes]]]


class FileWatch(Watch[FileObject]):
    """Polls GET /v1/files/{id} until the upload is validated (`processed`) or refused (`error`)."""

    def __init__(self, file_id: str, *, poll_interval_ms: int | None, max_wait: float | None):
        bar = ProgressBar(False, total=1, desc=f"file {file_id}")
        super().__init__(bar, poll_interval_ms=poll_interval_ms, max_wait=max_wait)

    def observe(self, response: httpx.Response) -> bool:
        self.result = FileObject.from_dict(response.json())
        return self.result.status != "uploaded"

    def still(self) -> str:
        return f"file {self.result.id} still being validated"


class Upload:
    """The multipart `files` mapping of an upload, made afresh by each call, one per attempt.

    A retry must send the whole file again: a path is reopened, a seekable file is rewound to
    where it stood at the call, and anything else is read into memory once. Used as a context
    manager, so that a file it opened is closed.
    """

    def __init__(self, file: FileInput, *, field: str = "file") -> None:
        self.field = field  # the form field the file goes in
        self._opened: IO[bytes] | None = None
        self._path: Path | None = None
        self._data: bytes | None = None
        self._stream: IO[bytes] | None = None
        if isinstance(file, (str, os.PathLike)):
            self._path = Path(file)
            if not self._path.is_file():
                raise FileNotFoundError(f"no such file: {self._path}")
            self.name = self._path.name
            return
        if isinstance(file, tuple):
            self.name, content = file
        elif isinstance(file, (bytes, bytearray)):
            self.name, content = "upload.bin", bytes(file)
        else:
            self.name = os.path.basename(getattr(file, "name", "") or "upload.bin")
            content = file
        if isinstance(content, (bytes, bytearray)):
            self._data = bytes(content)
        elif content.seekable():
            self._stream, self._start = content, content.tell()
        else:
            self._data = content.read()

    def __call__(self) -> Mapping[str, Any]:
        self.close()  # the previous attempt's handle
        if self._path is not None:
            stream = self._opened = open(self._path, "rb")
        elif self._stream is not None:
            stream = self._stream
            stream.seek(self._start)
        else:
            stream = io.BytesIO(self._data or b"")
        return {self.field: (self.name, stream, "application/octet-stream")}

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Uploads:
    """Several files of one multipart body, as `(form field, file)` pairs (a field may repeat:
    a list of files) or by field: each an `Upload`, made afresh by each call as one is."""

    def __init__(self, files: Mapping[str, FileInput] | Sequence[tuple[str, FileInput]]) -> None:
        pairs = files.items() if isinstance(files, Mapping) else files
        self.uploads = [Upload(file, field=field) for field, file in pairs]

    def __call__(self) -> list[tuple[str, Any]]:
        return [(k, v) for upload in self.uploads for k, v in upload().items()]

    def close(self) -> None:
        for upload in self.uploads:
            upload.close()

    def __enter__(self) -> Uploads:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
        with Upload(file) as upload:
            response = self._client.post(
                "/v1/files",
                data={"purpose": purpose},
                files=upload,
                idempotency_key=idempotency_key,
            )
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
        return self._client.get_page(
            "/v1/files", FileObject, purpose=purpose, after=after, limit=limit, order=order
        )

    def wait_for_processing(
        self, file_id: str, *, poll_interval_ms: int | None = 500, max_wait: float | None = None
    ) -> FileObject:
        """Wait until an upload is validated and return it: `status` is `processed` (ready to
        train on, `clips` counted) or `error` (`status_details` says why). `max_wait` (seconds)
        raises TimeoutError instead of waiting forever."""
        with FileWatch(file_id, poll_interval_ms=poll_interval_ms, max_wait=max_wait) as watch:
            return self._client.poll(lambda: self._client.get(f"/v1/files/{file_id}"), watch)

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
        with Upload(file) as upload:
            response = await self._client.post(
                "/v1/files",
                data={"purpose": purpose},
                files=upload,
                idempotency_key=idempotency_key,
            )
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
        return self._client.get_page(
            "/v1/files", FileObject, purpose=purpose, after=after, limit=limit, order=order
        )

    async def wait_for_processing(
        self, file_id: str, *, poll_interval_ms: int | None = 500, max_wait: float | None = None
    ) -> FileObject:
        """Wait until an upload is validated (see `Files.wait_for_processing`)."""
        with FileWatch(file_id, poll_interval_ms=poll_interval_ms, max_wait=max_wait) as watch:
            return await self._client.poll(lambda: self._client.get(f"/v1/files/{file_id}"), watch)

    async def delete(self, file_id: str) -> FileDeleted:
        return FileDeleted.from_dict((await self._client.delete(f"/v1/files/{file_id}")).json())
