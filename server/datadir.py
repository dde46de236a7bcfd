"""The server's data directory: every path of its on-disk layout, written down once.

<data-dir>/
  megaslide.db            the job store (SQLite, WAL)
  server.lock             held by the one server using this directory
  videos/<id>.mp4         finished videos, and <id>.png their first frame
  files/<id>/data/        an uploaded training set, unpacked (upload: the archive meanwhile)
  fine_tunes/<id>/        a fine-tuning run: metrics, checkpoints
  models/<id>/            the model a fine-tuning job exported, served as `ft:...`
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megaslide.engine.atomic import remove_stale


@dataclass(frozen=True)
class DataDir:
    """Paths under one data directory; folders are created when first asked for."""

    root: Path

    @property
    def db(self) -> Path:
        return self.root / "megaslide.db"

    @property
    def lock(self) -> Path:
        return self.root / "server.lock"

    def _folder(self, name: str) -> Path:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @property
    def videos(self) -> Path:
        return self._folder("videos")

    @property
    def files(self) -> Path:
        return self._folder("files")

    def video(self, video_id: str) -> tuple[Path, Path]:
        """Where a video's MP4 and thumbnail live."""
        folder = self.videos
        return folder / f"{video_id}.mp4", folder / f"{video_id}.png"

    def reference(self, video_id: str) -> Path:
        """Where an image-to-video request's first-frame image lives."""
        return self.videos / f"{video_id}.input.png"

    def video_files(self, video_id: str) -> tuple[Path, ...]:
        """Every file of a video, for deleting it."""
        return (*self.video(video_id), self.reference(video_id))

    def upload(self, file_id: str) -> Path:
        """The folder of one uploaded file: `upload` (the archive), then `data/` (unpacked)."""
        return self.files / file_id

    def fine_tune(self, job_id: str) -> Path:
        return self._folder("fine_tunes") / job_id

    def fine_tuned_model(self, job_id: str) -> Path:
        return self._folder("models") / job_id

    def remove_stale(self) -> None:
        """Delete the temporary files a killed process left half-written."""
        remove_stale(self.videos)
