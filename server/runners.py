"""The torch side of the worker: `VideoPipeline` for videos, the fine-tuning `Trainer`, MP4 output.

Only `worker.LocalEngine` imports this module, when the server starts, so building the app (and the
routers) needs no torch.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from megaslide.engine.checkpoint import read_config
from megaslide.engine.dit import DiTConfig, VideoDiT, get_preset
from megaslide.engine.models import default_model_source, packaged_models, resolve_model_path
from megaslide.engine.pipeline import GenerationRequest, VideoPipeline
from megaslide.engine.text import TOKEN_UNITS, count_tokens

from .client import ModelCard, VideoSpec
from .settings import Settings
from .worker import Backend, FinetuneJob, Trainer, VideoModel


def card_from_config(
    name: str, kind: str, source: str, config: DiTConfig, created: int, parent=None
) -> ModelCard:
    """What the HTTP layer needs to know of a model: defaults and limits, read from its config."""
    return ModelCard(
        name=name,
        kind=kind,
        created=created,
        source=source,
        parent=parent,
        frames=config.frames,
        height=config.height,
        width=config.width,
        fps=config.fps,
        steps=config.steps,
        guidance=config.guidance,
        max_frames=config.max_frames,
        max_size=config.max_size,
        patch=tuple(config.patch),
        max_prompt_tokens=config.text.max_len - 2,  # BOS and EOS take two tokens
        prompt_tokens=partial(count_tokens, tokenizer=config.text.tokenizer),
        prompt_unit=TOKEN_UNITS[config.text.tokenizer],
    )


class PipelineModel(VideoModel):
    """A `VideoPipeline` stepped by the worker, its DiT blocks optionally streamed (`stream`)."""

    def __init__(self, pipe: VideoPipeline, stream=None):
        self.pipe, self.stream = pipe, stream

    def prepare(self, spec: VideoSpec):
        return self.pipe.prepare(
            GenerationRequest(
                prompt=spec.prompt,
                negative_prompt=spec.negative_prompt,
                frames=spec.frames,
                height=spec.height,
                width=spec.width,
                steps=spec.steps,
                guidance=spec.guidance,
                seed=spec.seed,
                fps=spec.fps,
            )
        )

    def step(self, states: list) -> dict:
        if self.stream is None:
            self.pipe.denoise_step(states)
            return {}
        before = self.stream.stats()["h2d_bytes"]  # a counter: no device sync without timing
        self.pipe.denoise_step(states)
        return {"h2d_bytes": self.stream.stats()["h2d_bytes"] - before}

    def finish(self, state):
        return self.pipe.finish(state)


class TorchBackend(Backend):
    """Serves the models named in the settings on one device."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._configs: dict[str, DiTConfig] = {}
        if settings.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            self.device = settings.device
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: no CUDA device is available")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if settings.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        elif settings.dtype in dtypes:
            self.dtype = dtypes[settings.dtype]
        else:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(dtypes)}, got {settings.dtype!r}"
            )

    # --- models ------------------------------------------------------------------------------

    def cards(self) -> list[ModelCard]:
        started = int(time.time())
        cards = []
        if self.settings.preset:
            name = self.settings.preset
            cards.append(card_from_config(name, "preset", name, get_preset(name), started))
        for model in self.settings.models:
            path = resolve_model_path(model)
            name = model if model in packaged_models() else path.resolve().name
            config, _ = read_config(path)
            cards.append(
                card_from_config(name, "model", str(path), config, int(os.path.getmtime(path)))
            )
        if not cards:
            kind, source = default_model_source()
            if kind == "preset":
                cards.append(
                    card_from_config(source, "preset", source, get_preset(source), started)
                )
            else:
                name = Path(source).name
                cards.append(
                    card_from_config(name, "model", source, read_config(source)[0], started)
                )
        names = [c.name for c in cards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"two served models share the name {duplicates[0]!r}; rename one directory"
            )
        return cards

    def fine_tuned_card(self, name: str, parent: ModelCard, path: Path) -> ModelCard:
        config, _ = read_config(path)
        return card_from_config(
            name, "fine-tune", str(path), config, int(time.time()), parent=parent.name
        )

    def load(self, card: ModelCard) -> VideoModel:
        streamed = self.settings.offload == "stream"
        # A streamed model is built in host RAM; only its non-block tensors go to the device.
        device = "cpu" if streamed else self.device
        if card.kind == "preset":
            # seed 0, as `megaslide generate --preset` uses: the same request gives the same clip.
            pipe = VideoPipeline.from_preset(card.source, device=device, dtype=self.dtype)
        else:
            pipe = VideoPipeline.from_pretrained(card.source, device=device, dtype=self.dtype)
        pipe.name = card.name
        if not streamed:
            return PipelineModel(pipe)
        from megaslide.engine.streaming import stream_module

        pipe.text_encoder.to(self.device)
        handle = stream_module(
            pipe.dit,
            blocks=pipe.dit.blocks,
            device=self.device,
            gpu_budget_bytes=self.settings.gpu_budget,
        )
        return PipelineModel(pipe, handle)

    def _config(self, card: ModelCard) -> DiTConfig:
        if card.source not in self._configs:  # config.json is read once per model, not per request
            self._configs[card.source] = (
                get_preset(card.source) if card.kind == "preset" else read_config(card.source)[0]
            )
        return self._configs[card.source]

    def check_video(self, card: ModelCard, spec: VideoSpec) -> None:
        from megaslide.engine.autoencoder import build_autoencoder

        config = self._config(card)
        _, frames, height, width = build_autoencoder(config.autoencoder).latent_shape(
            spec.frames, spec.height, spec.width
        )
        # check_shape reads nothing but `self.config`, so no model needs to be built to ask it.
        VideoDiT.check_shape(SimpleNamespace(config=config), frames, height, width)

    # --- fine-tuning -------------------------------------------------------------------------

    def check_dataset(self, root: Path) -> int:
        from megaslide.engine.data import DatasetError, validate_dataset

        try:
            return len(validate_dataset(root))
        except DatasetError as e:
            raise ValueError(str(e)) from None

    def trainer(self, job: FinetuneJob) -> Trainer:
        from megaslide.engine.finetune import FinetuneConfig
        from megaslide.engine.finetune import Trainer as EngineTrainer

        base = job.base
        source = self._preset_weights(base.source) if base.kind == "preset" else base.source
        config = FinetuneConfig(
            data=str(job.data_dir),
            output=str(job.output_dir),
            model=source,
            epochs=job.epochs,
            lr=job.learning_rate,
            batch_size=job.batch_size,
            save_every=job.save_every,
            seed=job.seed,
            device=self.device,
            offload=self.settings.offload,
            frames=job.num_frames,
            height=job.height,
            width=job.width,
        )
        return EngineTrainer(config, resume=job.resume)

    def _preset_weights(self, preset: str) -> str:
        """The served preset's weights as a model directory, written once under the data directory.

        A fine-tune must start from the weights the server serves under that name (seed 0, as `load`
        draws them), not from a fresh draw with the run's own seed, which the trainer would make.
        """
        from megaslide.engine.checkpoint import save_model

        path = Path(self.settings.data_dir) / "presets" / preset
        if not (path / "config.json").is_file():  # save_model writes config.json last
            pipe = VideoPipeline.from_preset(preset, device="cpu", dtype=torch.float32)
            save_model(path, pipe.dit, pipe.text_encoder)
        return str(path)

    # --- output ------------------------------------------------------------------------------

    def save_video(self, frames, fps: int, mp4_path: Path, thumbnail_path: Path) -> None:
        from PIL import Image

        from megaslide.engine.video import write_mp4

        # The thumbnail is the first frame exactly as sampled (no codec round trip). It is written
        # before the MP4 so that once the MP4 exists both do.
        tmp = thumbnail_path.with_name(f".{thumbnail_path.name}.tmp")
        Image.fromarray(frames[0]).save(tmp, format="PNG")
        os.replace(tmp, thumbnail_path)
        write_mp4(mp4_path, frames, fps=fps)

    def error_code(self, exc: BaseException) -> str | None:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return "out_of_memory"
        return None

    def release_memory(self) -> None:
        if self.device.startswith("cuda"):
            # Cached blocks from the failed pass would otherwise look like a leak to the next job.
            torch.cuda.empty_cache()
