"""Where a model comes from, decided once: a preset's random weights, a model directory, or a
model shipped inside the package, and what that model is (`describe`), without torch.

`resolve_source(model, preset=...)` is the one place that turns what a user typed (`--model DIR`,
`--model NAME`, `--model NAME=DIR`, `--preset NAME`, or nothing: the packaged default model) into
a `ModelSource`. `describe(source)` reads the model's config (never its weights) into a
`ModelInfo`: its family, architecture, sampling defaults and the limits a request is checked
against. Two families read directories: MegaSlide's own (`config.json`) and diffusers-format Wan
pipelines (`model_index.json`, wan/config.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from .native.config import DiTConfig, SamplingDefaults, get_preset
from .native.tokens import TOKEN_UNITS, count_tokens
from .request import ModelLimits

if TYPE_CHECKING:
    from .wan.config import WanConfig

PACKAGED_DIR = Path(__file__).parent / "assets" / "models"
DEFAULT_MODEL = "megaslide-tiny"
FALLBACK_PRESET = "tiny"  # served when the package ships no default model

NATIVE_FORMAT = "megaslide-model/2"
LEGACY_FORMATS = ("megaslide-model/1",)  # sampling defaults mixed into "model"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from: a preset's seeded random init, or a directory."""

    kind: str  # "preset" | "directory"
    name: str  # how the model is called: the preset, packaged model or directory name
    preset: str | None = None
    path: Path | None = None
    seed: int = 0  # a preset's random weights are drawn from this seed

    def __str__(self) -> str:
        return f"preset {self.preset}" if self.kind == "preset" else str(self.path)


def packaged_models() -> dict[str, Path]:
    """Models shipped inside the package, by name."""
    if not PACKAGED_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(PACKAGED_DIR.iterdir()) if (p / CONFIG_FILE).is_file()}


def resolve_source(
    model: str | Path | None = None, *, preset: str | None = None, seed: int = 0
) -> ModelSource:
    """The model named by a `--model` value (directory or packaged name, optionally `NAME=DIR` to
    serve it under another name) or a `--preset`; with neither, the packaged default model (or
    the tiny preset when none ships). ValueError names what is wrong."""
    if model is not None and preset is not None:
        raise ValueError("give a model or a preset, not both")
    name, sep, rest = str(model).partition("=") if isinstance(model, str) else ("", "", "")
    if sep and name and "/" not in name and not Path(model).exists():
        if not rest:
            raise ValueError(f"--model {model}: give a directory after {name}=")
        return dataclasses.replace(resolve_source(rest, seed=seed), name=name)
    if preset is not None:
        get_preset(preset)  # an unknown name fails here, listing the presets
        return ModelSource("preset", preset, preset=preset, seed=seed)
    if model is None:
        packaged = packaged_models()
        if DEFAULT_MODEL not in packaged:
            return ModelSource("preset", FALLBACK_PRESET, preset=FALLBACK_PRESET, seed=seed)
        model = DEFAULT_MODEL
    packaged = packaged_models()
    if str(model) in packaged:
        return ModelSource("directory", str(model), path=packaged[str(model)])
    path = Path(model)
    if path.is_dir():
        if family_of(path) is None:
            raise ValueError(
                f"{path} is not a model directory (no {CONFIG_FILE}, nor a diffusers "
                "model_index.json)"
            )
        return ModelSource("directory", path.resolve().name, path=path)
    if path.exists():
        raise ValueError(f"{path} is not a model directory")
    known = ", ".join(packaged) or "none"
    raise ValueError(
        f"model {str(model)!r} not found: not a directory, nor a packaged model (packaged: {known})"
    )


def family_of(path: Path) -> str | None:
    """The family of a model directory, from the files that describe it; None if not a model."""
    if (path / CONFIG_FILE).is_file():
        return "megaslide"
    if (path / "model_index.json").is_file():
        return "wan"
    return None


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, read from its config alone: family, architecture, defaults and limits."""

    source: ModelSource
    family: str
    config: DiTConfig | WanConfig  # the family's own architecture config
    sampling: SamplingDefaults
    limits: ModelLimits
    extra: dict = field(default_factory=dict)  # other keys of the model's config.json

    @property
    def name(self) -> str:
        return self.source.name

    def __reduce__(self):
        # Pickled (to a process of a multi-device job) as its config: the limits hold closures,
        # and are a function of the config, so the receiving side derives them again.
        return (_rebuild_info, (self.source, self.family, self.config, self.sampling, self.extra))


def _rebuild_info(source, family, config, sampling, extra) -> ModelInfo:
    if family == "wan":
        from .wan.config import wan_limits

        return ModelInfo(
            source, family, config, sampling, wan_limits(config, sampling, source.path)
        )
    return ModelInfo(source, family, config, sampling, native_limits(config, sampling), extra)


def read_native_config(path: Path) -> tuple[DiTConfig, SamplingDefaults, dict]:
    """A MegaSlide model directory's architecture, sampling defaults and other config keys."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no {CONFIG_FILE})")
    raw = json.loads(config_file.read_text())
    fmt = raw.pop("format", None)
    if fmt in LEGACY_FORMATS:
        model = dict(raw.pop("model"))
        keys = SamplingDefaults.__dataclass_fields__
        raw["sampling"] = {k: model.pop(k) for k in list(model) if k in keys}
        raw["model"] = model
    elif fmt != NATIVE_FORMAT:
        raise ValueError(f"{config_file}: unsupported format {fmt!r}, expected {NATIVE_FORMAT!r}")
    config = DiTConfig.from_dict(raw.pop("model"))
    sampling = SamplingDefaults.from_dict(raw.pop("sampling", {}))
    return config, sampling, raw


def native_limits(config: DiTConfig, sampling: SamplingDefaults) -> ModelLimits:
    """A MegaSlide DiT's request limits, in pixel-space units, from its architecture."""
    st, sy, sx = config.vae_stride
    pt, ph, pw = config.patch
    causal = st > 1  # a causal VAE keeps the first frame alone: frames = st * k + 1

    def check_shape(frames: int, height: int, width: int) -> None:
        config.check_latent(*config.latent_shape(frames, height, width)[1:])

    return ModelLimits(
        max_frames=st * (config.max_frames - 1) + 1 if causal else config.max_frames,
        max_size=config.max_size * max(sy, sx),
        size_multiple=(ph * sy, pw * sx),
        frames_multiple=st * pt if causal else pt,
        frames_offset=1 if causal else 0,
        max_prompt_tokens=config.text.max_len - 2,  # BOS and EOS take two tokens
        prompt_unit=TOKEN_UNITS[config.text.tokenizer],
        count_tokens=partial(count_tokens, tokenizer=config.text.tokenizer),
        check_shape=check_shape,
    )


def describe(source: ModelSource, **overrides) -> ModelInfo:
    """Read a model's config (never its weights). `overrides` replace architecture fields that
    leave the weights' shapes alone, e.g. `attention="dsa"`."""
    if source.kind == "directory" and family_of(source.path) == "wan":
        from .wan.config import default_sampling, read_wan_config, wan_limits

        config = read_wan_config(source.path)
        config = config.replace(**overrides) if overrides else config
        sampling = default_sampling(config, source.path)
        return ModelInfo(source, "wan", config, sampling, wan_limits(config, sampling, source.path))
    if source.kind == "preset":
        preset = get_preset(source.preset)
        config, sampling, extra = preset.model, preset.sampling, {}
    else:
        config, sampling, extra = read_native_config(source.path)
    config = config.replace(**overrides) if overrides else config
    return ModelInfo(source, "megaslide", config, sampling, native_limits(config, sampling), extra)
