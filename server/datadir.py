"""The server's storage: every path of its on-disk layout, written down once.

<storage>/                (the data directory, unless --storage names a shared one)
  megaslide.db            the job store, when it is SQLite (the default)
  videos/<id>.mp4         finished videos, and <id>.png their first frame
  files/<id>/data/        an uploaded training set, unpacked (upload: the archive meanwhile)
  fine_tunes/<id>/        a fine-tuning run: metrics, checkpoints
  models/<id>/            the model a fine-tuning job exported, served as `ft:...`
  adapters/<model>/       LoRA adapters uploaded for a base model (see AdapterFolder)

With several hosts every one mounts the storage, perhaps at different paths: the job store keeps
paths relative to it (`relative`), and each host resolves them under its own mount (`resolve`).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from megaslide.engine.atomic import atomic_write_text, remove_abandoned, remove_stale
from megaslide.engine.request import ANIMATE_VIDEOS, MAX_REFERENCE_IMAGES

from .protocol import OWNER_MARK


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

    def adapters(self, model: str) -> AdapterFolder:
        """The LoRA adapters uploaded for base model `model`."""
        return AdapterFolder(self.root / "adapters" / model)

    def adapter_models(self) -> list[str]:
        """The base models that have an adapters folder, in name order."""
        root = self.root / "adapters"
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def video(self, video_id: str) -> tuple[Path, Path]:
        """Where a video's MP4 and thumbnail live."""
        folder = self.videos
        return folder / f"{video_id}.mp4", folder / f"{video_id}.png"

    def reference(self, video_id: str) -> Path:
        """Where an image-to-video request's first-frame image lives."""
        return self.videos / f"{video_id}.input.png"

    def last_frame(self, video_id: str) -> Path:
        """Where a first-last-frame request's last-frame image lives."""
        return self.videos / f"{video_id}.last.png"

    def input_video(self, video_id: str) -> Path:
        """Where a video-to-video request's input video lives (as uploaded)."""
        return self.videos / f"{video_id}.input.video"

    def control_video(self, video_id: str) -> Path:
        """Where a VACE request's control video lives (as uploaded)."""
        return self.videos / f"{video_id}.control.video"

    def mask_video(self, video_id: str) -> Path:
        """Where a VACE request's mask video lives (as uploaded)."""
        return self.videos / f"{video_id}.mask.video"

    def animate_video(self, video_id: str, name: str) -> Path:
        """Where a Wan Animate request's video `name` (pose_video, face_video, background_video,
        background_mask) lives (as uploaded)."""
        return self.videos / f"{video_id}.{name}.video"

    def reference_image(self, video_id: str, index: int) -> Path:
        """Where a VACE request's reference image `index` lives."""
        return self.videos / f"{video_id}.ref{index}.png"

    def video_files(self, video_id: str) -> tuple[Path, ...]:
        """Every file of a video, for deleting it."""
        return (
            *self.video(video_id),
            self.reference(video_id),
            self.last_frame(video_id),
            self.input_video(video_id),
            self.control_video(video_id),
            self.mask_video(video_id),
            *(self.reference_image(video_id, i) for i in range(MAX_REFERENCE_IMAGES)),
            *(self.animate_video(video_id, name) for name in ANIMATE_VIDEOS),
        )

    def upload(self, file_id: str) -> Path:
        """The folder of one uploaded file: `upload` (the archive), then `data/` (unpacked)."""
        return self.files / file_id

    def fine_tune(self, job_id: str) -> Path:
        return self._folder("fine_tunes") / job_id

    def fine_tuned_model(self, job_id: str) -> Path:
        return self._folder("models") / job_id

    def remove_stale(self, min_age_s: float) -> None:
        """Delete the temporary files a killed process left half-written: at once those no live
        writer holds, the rest once older than `min_age_s` (another host may be writing them)."""
        self.remove_abandoned()
        remove_stale(self.videos, min_age_s=min_age_s)

    def remove_abandoned(self) -> int:
        """Delete the temporary MP4s and PNGs whose writers died mid-write (no live writer, here
        or on another host, holds them); returns how many."""
        return remove_abandoned(self.videos)


ORPHAN_S = 60.0  # an adapter's record without its file for this long is an upload that died


@dataclass(frozen=True)
class AdapterFolder:
    """The LoRA adapters uploaded for one base model, each under its id (`protocol.adapter_id`:
    `OWNER~NAME`, so that each key has its own names). `NAME.json` (who uploaded it, when) is
    written before `NAME.safetensors` appears whole, so a worker that sees the adapter also sees
    its owner; `NAME.error` is what a worker said when it refused the file. Deleting removes the
    safetensors first: from then on no worker takes it up."""

    path: Path

    def file(self, name: str) -> Path:
        return self.path / f"{name}.safetensors"

    def partial(self, name: str) -> Path:
        """Where an upload is written before it is whole (one place per upload)."""
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path / f".{name}.{secrets.token_hex(4)}.partial"

    def names(self) -> list[str]:
        """The adapters uploaded here, in name order."""
        return sorted(p.stem for p in self.path.glob("*.safetensors"))

    def publish(self, name: str, partial: Path, owner: str | None, sha256: str) -> None:
        """Make the whole upload at `partial` the adapter `name`, owned by `owner`. The record
        is created exclusively first: it claims the name (FileExistsError when taken, so of two
        uploads racing for one name only one wins) and is on disk before any worker can see
        the safetensors."""
        record = json.dumps({"owner": owner, "created_at": int(time.time()), "sha256": sha256})
        path = self.path / f"{name}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if self.file(name).exists() or time.time() - path.stat().st_mtime < ORPHAN_S:
                raise
            path.unlink()  # an upload that died between its record and its file
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())  # the owner must be on disk before the file is visible
        partial.rename(self.file(name))  # the workers see only whole files

    def record(self, name: str) -> dict:
        """`owner`, `created_at` and `sha256` of an uploaded adapter (None each for one uploaded
        before adapters had owners, or whose record cannot be read: a damaged record must not
        stop the listing or a worker's scan)."""
        found = {"owner": None, "created_at": None, "sha256": None}
        try:
            record = json.loads((self.path / f"{name}.json").read_text())
        except (OSError, ValueError, RecursionError):
            record = None
        if isinstance(record, dict):
            found.update((k, record[k]) for k in found if isinstance(record.get(k), str | int))
        if OWNER_MARK in name:  # the id names its owner, whatever the record says
            found["owner"] = name.rpartition(OWNER_MARK)[0]
        return found

    def error(self, name: str) -> str | None:
        """Why a worker refused the adapter, or None."""
        try:
            return (self.path / f"{name}.error").read_text(errors="replace")
        except FileNotFoundError:
            return None

    def refuse(self, name: str, reason: str) -> None:
        atomic_write_text(self.path / f"{name}.error", reason)

    def remove(self, name: str) -> None:
        for suffix in (".safetensors", ".error", ".json"):
            (self.path / f"{name}{suffix}").unlink(missing_ok=True)
