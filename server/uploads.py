"""Uploaded training archives, validated after their upload returns (OpenAI files' `status`:
uploaded -> processed | error), so a large dataset never holds a request open.

Every API host runs a `Validator` in its lifespan: it claims an upload waiting for validation
(a lease in the job store, so a host that dies mid-way leaves it to another, or to its own
restart), unpacks it, checks the dataset in a worker thread, and records the clip count or what is
wrong. Then only the unpacked copy is kept (what training reads); a failed upload keeps nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import anyio

from .archives import ArchiveError, extract_archive, remove_tree
from .datadir import DataDir
from .settings import Settings
from .store import UNAVAILABLE, JobStore

log = logging.getLogger("megaslide.server")

POLL_S = 2.0  # how often a host looks for uploads it was not told about (another host's)
LEASE_S = 600.0  # one validation; a host silent for this long is presumed dead


class Validator:
    """Validates the store's pending uploads, one at a time, in this process."""

    def __init__(
        self,
        settings: Settings,
        store: JobStore,
        data: DataDir,
        check_dataset: Callable[[Path], int],
    ):
        self.settings, self.store, self.data = settings, store, data
        self.check_dataset = check_dataset
        self._wake = anyio.Event()

    def wake(self) -> None:
        """A new upload: look now rather than at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled (the lifespan's end)."""
        while True:
            try:
                busy = await anyio.to_thread.run_sync(self.validate_one)
            except UNAVAILABLE:
                log.exception("upload validation: the job store fails; retrying")
                busy = False
            if not busy:
                with anyio.move_on_after(POLL_S):
                    await self._wake.wait()
                self._wake = anyio.Event()

    def validate_one(self) -> bool:
        """Validate one pending upload, if any; False when there was none."""
        row = self.store.files.claim_validation(LEASE_S)
        if row is None:
            return False
        folder = self.data.upload(row.id)
        try:
            root = extract_archive(
                folder / "upload", folder / "data", self.settings.max_extracted_bytes
            )
            clips = self.check_dataset(root)
        except (ArchiveError, ValueError) as e:
            error = f"{row.filename}: {e}"
        except Exception as e:  # noqa: BLE001 - the upload fails, the validator goes on
            log.exception("validating upload %s", row.id)
            error = f"{row.filename}: could not be validated ({type(e).__name__}: {e})"
        else:
            (folder / "upload").unlink(missing_ok=True)  # training reads the unpacked copy
            path = self.data.relative(root)
            if not self.store.files.finish_validation(row.id, clips=clips, path=path):
                remove_tree(folder)  # deleted while it was being validated
            return True
        remove_tree(folder)
        self.store.files.finish_validation(row.id, error=error)
        return True
