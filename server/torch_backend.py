"""The engine behind the worker: models opened by `open_pipeline`, fine-tunes by `open_trainer`.

Only `megaslide serve` builds this backend (the worker never imports it), so the app, the routers
and the scheduler run without torch.
"""

from __future__ import annotations

import io
import logging
import os
import time
from pathlib import Path

import torch

from megaslide.engine.atomic import atomic_write_bytes
from megaslide.engine.interfaces import TrainingRun, VideoModel
from megaslide.engine.loader import open_pipeline, resolve_device, resolve_dtype
from megaslide.engine.parallel.multidevice import parse_devices
from megaslide.engine.parallel.rank_group import RankGroup, RanksDown
from megaslide.engine.placement import Placement
from megaslide.engine.planner import check_host_memory
from megaslide.engine.sources import ModelInfo, ModelSource, describe, resolve_source
from megaslide.engine.training.finetune import open_trainer

from .backend import Backend, FinetuneJob, VideoWriter
from .protocol import ModelCard
from .settings import Settings

log = logging.getLogger("megaslide.server")


class TorchBackend(Backend):
    """Serves the models named in the settings on one device, or each video split over several
    (`settings.devices`: a `RankGroup` of processes per loaded model)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        if settings.engine_threads is not None:
            # Process-wide, and only the engine computes with torch here: the API's threads
            # keep the cores the engine leaves them.
            torch.set_num_threads(settings.engine_threads)
        # ValueError naming a device that is not there, before anything loads.
        self.devices = parse_devices(settings.devices) if settings.devices else []
        # Fine-tunes run here, on the first of several devices.
        self.device = (
            torch.device(self.devices[0]) if self.devices else resolve_device(settings.device)
        )
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.placement = settings.placement
        self._infos: dict[str, ModelInfo] = {}  # by served name: what `load` opens
        started = int(time.time())
        sources = [resolve_source(preset=settings.preset)] if settings.preset else []
        sources += [resolve_source(model) for model in settings.models]
        if not sources:
            sources = [resolve_source()]  # the packaged default model
        files = transformer_files(settings.transformers, [s.name for s in sources])
        self._cards = [
            self._register(describe(s, **files.get(s.name, {})), started) for s in sources
        ]
        for card in self._cards:  # HostMemoryError now, in one line, not a worker killed later
            self.check_host_memory(self._infos[card.name])
        names = [c.name for c in self._cards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"two served models share the name {duplicates[0]!r}; rename one directory"
            )
        self._adapters = self._load_adapters(settings.loras)
        self._cards = [
            c.replace(adapters=tuple(_given_at_start(a, c.name) for a in self._adapters[c.name]))
            for c in self._cards
        ]

    def _load_adapters(self, specs: list[str]) -> dict:
        """`--lora [MODEL:]NAME=FILE` converted and checked against each model it names (on the
        meta device: a file that does not fit is named now, before any weights load)."""
        from megaslide.engine.loader import load_adapter

        adapters: dict[str, list] = {c.name: [] for c in self._cards}
        for spec in specs:
            target, name, path = parse_lora_spec(spec)
            if target is not None and target not in adapters:
                raise ValueError(f"--lora {spec}: no served model is named {target!r}")
            for model in [target] if target else list(adapters):
                if any(a.name == name for a in adapters[model]):
                    raise ValueError(f"--lora {spec}: {model} already has an adapter {name!r}")
                adapter = load_adapter(self._infos[model], name, path)
                adapters[model].append(adapter)
        return adapters

    def _register(self, info: ModelInfo, created: int, kind=None, parent=None) -> ModelCard:
        self._infos[info.name] = info
        source = info.source
        if kind is None:
            kind = "preset" if source.kind == "preset" else "model"
            if source.kind == "directory":
                created = int(os.path.getmtime(source.path))
        return ModelCard(
            name=info.name,
            kind=kind,
            created=created,
            source=source.preset if source.kind == "preset" else str(source.path),
            limits=info.limits,
            defaults=info.sampling,
            parent=parent,
        )

    def check_host_memory(self, info: ModelInfo) -> None:
        """The planner's refusal of a model whose weights the host cannot hold, as `load` would
        open it (several devices share one host copy of the streamed blocks)."""
        check_host_memory(
            info, self.placement.on(self.device.type), dtype_bytes=self.dtype.itemsize
        )

    @property
    def device_name(self) -> str:
        return ",".join(self.devices) if self.devices else str(self.device)

    # --- models ------------------------------------------------------------------------------

    def cards(self) -> list[ModelCard]:
        return list(self._cards)

    def fine_tuned_card(self, name: str, parent: ModelCard, path: Path) -> ModelCard:
        info = describe(ModelSource("directory", name, path=Path(path)))
        return self._register(info, int(time.time()), kind="fine-tune", parent=parent.name)

    def load(self, card: ModelCard) -> VideoModel:
        info = self._infos[card.name]
        if self.devices:
            # The ranks stay up, the model open in each, until the group is closed or dropped.
            placement = self.placement.replace(devices=tuple(self.devices))
            model = RankGroup(
                info, placement, dtype=self.dtype, threads=self.settings.engine_threads
            )
        else:
            model = open_pipeline(info, self.placement.on(str(self.device)), dtype=self.dtype)
            if self.placement.compile and self.settings.compile_warm_up:
                model.warm_up()  # the compile at the default shape, before any request waits
            # Its states keep each step's clean-clip prediction, for the previews the worker
            # sends (a group of ranks keeps none: its states live in the rank processes).
            model.keep_predictions = self.settings.preview_every > 0
        for adapter in self._adapters.get(card.name, ()):  # on every rank of a RankGroup
            model.register_adapter(adapter)
        return model

    def add_fine_tune(self, model, card: ModelCard) -> bool:
        from megaslide.engine.deltas import read_delta, write_delta

        tuned = describe(ModelSource("directory", card.name, path=Path(card.source)))
        dtype = model.compute_dtype
        try:
            # Mapped: held in RAM while it fits there, served from its file beyond.
            delta = read_delta(tuned.source.path, dtype, mapped=True)
            if delta is None:
                write_delta(tuned, model.info, dtype)  # beside its files, for the next worker
                delta = read_delta(tuned.source.path, dtype, mapped=True)
            registered = model.add_fine_tune(card.name, delta)
        except (ValueError, OSError) as exc:  # DeltaError; a base drawn from a preset has no files
            log.warning("fine-tune %s loads whole: %s", card.name, exc)
            return False
        log.info(
            "fine-tune %s served as a %d-byte delta over %s, from %s",
            card.name,
            delta.nbytes,
            model.name,
            "RAM" if registered.get("tier") == "ram" else "its file",
        )
        return True

    def add_adapter(self, card: ModelCard, model, name: str, path: Path) -> dict:
        from megaslide.engine.loader import load_adapter

        if any(a["name"] == name for a in card.adapters):
            raise ValueError(f"{card.name} already has an adapter {name!r}")
        adapter = load_adapter(self._infos[card.name], name, path)
        # One this backend took up before (for an earlier worker on it) is replaced.
        self.remove_adapter(card, None, name)
        if model is not None:
            model.register_adapter(adapter, replace=True)
        self._adapters.setdefault(card.name, []).append(adapter)
        return adapter.card() | {"base": card.name}

    def remove_adapter(self, card: ModelCard, model, name: str) -> None:
        if model is not None:
            model.remove_adapter(name)
        self._adapters[card.name] = [a for a in self._adapters.get(card.name, ()) if a.name != name]

    # --- fine-tuning -------------------------------------------------------------------------

    def check_dataset(self, root: Path) -> int:
        return check_dataset(root, self.settings)

    def trainer(self, job: FinetuneJob) -> TrainingRun:
        placement = Placement(device=str(self.device), offload=self.settings.offload)
        spec = job.spec.replace(runtime={"placement": placement})
        # A fine-tune starts from the weights served under the base model's name: a preset's are
        # drawn from its own seed, whatever the run's seed is.
        return open_trainer(self._infos[job.base.name], job.data_dir, spec, resume=job.resume)

    # --- output ------------------------------------------------------------------------------

    def save_video(self, frames, fps: int, mp4_path: Path, thumbnail_path: Path) -> None:
        from PIL import Image

        from megaslide.engine.video import write_mp4

        # The thumbnail is the first frame exactly as sampled (no codec round trip). It is written
        # before the MP4 so that once the MP4 exists both do.
        png = io.BytesIO()
        Image.fromarray(frames[0]).save(png, format="PNG")
        atomic_write_bytes(thumbnail_path, png.getvalue())
        write_mp4(mp4_path, frames, fps=fps)

    def open_video(self, fps: int, mp4_path: Path, thumbnail_path: Path) -> VideoWriter:
        return Mp4ClipWriter(fps, mp4_path, thumbnail_path)

    def error_code(self, exc: BaseException) -> str | None:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return "out_of_memory"
        return None

    def is_fatal(self, exc: BaseException) -> bool:
        if isinstance(exc, RanksDown):  # a rank failed and the group would not start again
            return True
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return False
        accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
        # Any other CUDA runtime error is sticky: the context answers every later call with it.
        return isinstance(exc, accelerator_error) or (
            isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
        )

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            # Cached blocks from the failed pass would otherwise look like a leak to the next job.
            torch.cuda.empty_cache()


class Mp4ClipWriter(VideoWriter):
    """A clip's MP4 encoded on a thread of its own as its chunks come (`engine.video.Mp4Writer`),
    while the worker decodes the next and, once the clip is decoded, goes on denoising: the same
    frames in the same order as `save_video` of the whole clip, so the same file. The
    thumbnail is the first frame exactly as sampled, written in `close` before the MP4 is
    published, and removed again if the MP4 then fails."""

    def __init__(self, fps: int, mp4_path: Path, thumbnail_path: Path):
        from megaslide.engine.video import Mp4Writer

        self.thumbnail_path = thumbnail_path
        self.first = None  # the clip's first frame, for the thumbnail
        # No bound on the chunks waiting: the worker keeps every chunk anyway (a full disk has
        # the clip written again), so a bound would save no memory and only hold the worker's
        # loop, and the next denoising steps, to the encoder's pace.
        self.mp4 = Mp4Writer(mp4_path, fps=fps, depth=None)

    def add(self, chunk) -> None:
        if self.first is None and len(chunk):
            self.first = chunk[0].copy()  # the chunk may be a view of a batch's decoded frames
        self.mp4.add(chunk)

    def close(self) -> None:
        from PIL import Image

        if self.first is None:
            self.mp4.abort()
            raise ValueError("no frames to write")
        png = io.BytesIO()
        Image.fromarray(self.first).save(png, format="PNG")
        try:
            atomic_write_bytes(self.thumbnail_path, png.getvalue())
            self.mp4.close()
        except BaseException:
            self.mp4.abort()
            self.thumbnail_path.unlink(missing_ok=True)  # no thumbnail without its MP4
            raise

    def abort(self) -> None:
        self.mp4.abort()


def _given_at_start(adapter, base: str) -> dict:
    """The card of an adapter given at start (`--lora`): its file's modification time names its
    revision, as an upload's digest does (a video made with the file before it was rewritten
    does not answer a request made after: services/repeats.py)."""
    return adapter.card() | {"base": base, "modified_at": int(os.path.getmtime(adapter.source))}


def transformer_files(specs: list[str], names: list[str]) -> dict[str, dict]:
    """`--transformer NAME=FILE` entries as `describe` overrides by served model name."""
    files: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--transformer {spec!r}: expected NAME=FILE")
        if name not in names:
            raise ValueError(f"--transformer {spec}: no served model is named {name!r}")
        files.setdefault(name, []).append(path)
    return {name: {"transformer_files": tuple(paths)} for name, paths in files.items()}


def parse_lora_spec(spec: str) -> tuple[str | None, str, Path]:
    """ "[MODEL:]NAME=FILE" -> (model or None, name, file); ValueError naming what is wrong."""
    head, sep, path = spec.partition("=")
    model, _, name = head.rpartition(":")
    if not sep or not name or not path:
        raise ValueError(f"--lora {spec!r}: expected NAME=FILE or MODEL:NAME=FILE")
    if not Path(path).is_file():
        raise ValueError(f"--lora {spec}: {path} not found")
    return model or None, name, Path(path)


def check_dataset(root: Path, settings: Settings) -> int:
    """An unpacked training set's clip count, or ValueError naming what is wrong with it, within
    the settings' bounds on what one upload may cost."""
    from megaslide.engine.training.data import DatasetError, DatasetLimits, validate_dataset

    limits = DatasetLimits(
        max_clips=settings.max_dataset_clips,
        max_line_bytes=settings.max_metadata_line_bytes,
        max_frames=settings.max_dataset_frames,
        max_pixels=settings.max_image_pixels,
    )
    try:
        return len(validate_dataset(root, limits=limits))
    except DatasetError as e:
        raise ValueError(e.summary()) from None
