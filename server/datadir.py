"""The server's storage: every path of its on-disk layout, written down once.

<storage>/                (the data directory, unless --storage names a shared one)
  megaslide.db            the job store, when it is SQLite (the default)
  videos/<id>.mp4         finished videos, and <id>.png their first frame
  files/<id>/data/        an uploaded training set, unpacked (upload: the archive meanwhile)
  fine_tunes/<id>/        a fine-tuning run: metrics, checkpoints
  models/<id>/            the model a fine-tuning job exported, served as `ft:...`

With several hosts every one mounts the storage, perhaps at different paths: the job store keeps
paths relative to it (`relative`), and each host resolves them under its own mount (`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megaslide.engine.atomic import remove_stale


@dataclass(frozen=True)
class DataDir:
    """Paths under one data directory; folders are created when first asked for."""

    root: Path

    def __post_init__(self):
        # Absolute, so paths under it (a trainer's checkpoints, say) compare with it as written.
        object.__setattr__(self, "root", Path(self.root).absolute())

    def relative(self, path: Path) -> str:
        """How the job store records a path under the storage (one elsewhere stays absolute)."""
        path = Path(path).absolute()
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def resolve(self, stored: str) -> Path:
        """A path the job store recorded, on this host (absolute ones, from data directories
        of earlier versions, stay as they are)."""
        return self.root / stored

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

    def adapters(self, model: str) -> Path:
        """Where LoRA adapters uploaded for base model `model` live: `NAME.safetensors`, and
        `NAME.error` once a worker has refused one (what it said)."""
        return self._folder(f"adapters/{model}")

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

    def remove_stale(self, min_age_s: float) -> None:
        """Delete the temporary files a killed process left half-written, once older than
        `min_age_s` (another host may be writing the newer ones)."""
        remove_stale(self.videos, min_age_s=min_age_s)
