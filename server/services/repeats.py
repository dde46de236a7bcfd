"""Repeated requests: a request equal to one of its tenant's finished videos in everything that
decides the pixels is answered with that video's MP4, and no pass of the model runs.

What decides the pixels is the resolved request (`ResolvedVideo`: every field counts but those
named in `NOT_PIXELS`, so a field added to it counts from the start), the files it names (first-
and last-frame images, an input video, VACE's reference images, control video and mask) by their
bytes, and the identity of the weights: the model's revision and each adapter's. `pixel_key` digests them; the store keeps the digest beside
each video and finds a finished one by it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from megaslide.engine.request import INPUT_FILE_LISTS, INPUT_FILES, ResolvedVideo

from ..datadir import DataDir
from ..protocol import ModelCard

# Fields of `ResolvedVideo` that leave the MP4 as it is. None so far: even `fps`, which changes
# no frame, is written into the MP4. The files (`INPUT_FILES`) count by the bytes stored rather
# than their paths (each upload is stored under its own video's id).
NOT_PIXELS: frozenset[str] = frozenset()

# What names a model's weights on its card: a directory's modification time, a preset's start
# (a preset's weights are drawn when its server starts), a fine-tune's registration.
MODEL_REVISION = ("name", "kind", "source", "created", "parent")
# What names an adapter's weights on its card: an uploaded one's file digest and upload time; one
# given at start, its file's modification time; either, its shape and sampling defaults.
ADAPTER_REVISION = ("sha256", "created_at", "modified_at", "rank", "modules", "bytes", "defaults")


def pixel_key(
    video: ResolvedVideo,
    card: ModelCard,
    *,
    digests: Mapping[str, str | list[str] | None],
    parent: ModelCard | None = None,
) -> str:
    """A digest of everything that decides `video`'s pixels on `card`'s weights (`parent`: the
    base model of a fine-tune); `digests` are the stored files' by field (`INPUT_FILES`; a
    list of them for each of `INPUT_FILE_LISTS`).
    `video.loras` name adapters by their ids on `card`."""
    fields = {f.name for f in dataclasses.fields(video)}
    request = {k: v for k, v in video.to_dict().items() if k in fields - NOT_PIXELS}
    for name in INPUT_FILES:
        if request.get(name) is not None:
            request[name] = digests[name]
    for name in INPUT_FILE_LISTS:  # several files: their digests in order
        if request.get(name):
            request[name] = digests[name]
    adapters = {a["id"] if "id" in a else a["name"]: a for a in card.adapters}
    weights = {
        "model": _revision(card),
        "parent": None if parent is None else _revision(parent),
        "adapters": [
            {k: adapters.get(c.name, {}).get(k) for k in ADAPTER_REVISION} for c in video.loras
        ],
    }
    text = json.dumps({"request": request, "weights": weights}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _revision(card: ModelCard) -> dict:
    return {k: getattr(card, k) for k in MODEL_REVISION}


def share_content(data: DataDir, source_id: str, video_id: str) -> bool:
    """Give `video_id` the MP4 and thumbnail of `source_id` under its own names; False (nothing
    left behind) when the source's MP4 is gone. A hard link shares the bytes, and either video's
    deletion or expiry removes only its own names; a copy stands in where the storage has no
    links."""
    made = []
    try:
        for src, dst in zip(data.video(source_id), data.video(video_id), strict=True):
            _link_or_copy(src, dst)
            made.append(dst)
    except FileNotFoundError:  # deleted or expired meanwhile: the request runs after all
        for path in made:
            path.unlink(missing_ok=True)
        return False
    return True


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except FileNotFoundError:
        raise
    except OSError:  # a file system without hard links, or one the storage spans
        shutil.copyfile(src, dst)
