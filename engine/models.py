"""Where models come from: a directory, a model shipped inside the package, or a preset's random weights."""

from __future__ import annotations

from pathlib import Path

from .dit import PRESETS

PACKAGED_DIR = Path(__file__).parent / "assets" / "models"
DEFAULT_MODEL = "megaslide-tiny"


def packaged_models() -> dict[str, Path]:
    """Models shipped inside the package, by name."""
    if not PACKAGED_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(PACKAGED_DIR.iterdir()) if (p / "config.json").is_file()}


def resolve_model_path(model: str) -> Path:
    """A model directory from a path or the name of a packaged model; ValueError when neither."""
    packaged = packaged_models()
    if model in packaged:
        return packaged[model]
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ValueError(f"{model} is not a model directory (no config.json)")
    known = ", ".join(packaged) or "none"
    raise ValueError(
        f"model {model!r} not found: not a directory, nor a packaged model (packaged: {known})"
    )


def default_model_source() -> tuple[str, str]:
    """`("model", path)` for the packaged default model when shipped, else `("preset", "tiny")`."""
    packaged = packaged_models()
    if DEFAULT_MODEL in packaged:
        return "model", str(packaged[DEFAULT_MODEL])
    return "preset", "tiny"


__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "default_model_source",
    "packaged_models",
    "resolve_model_path",
]
