"""MegaSlide model directories: `config.json` beside `model.safetensors` and `text_encoder.safetensors`.

Tensor names are the modules' own state-dict names, so block `i` of the DiT is every tensor whose
name starts with `blocks.{i}.` and can be read alone. `config.json` holds the architecture under
"model" and the sampling defaults under "sampling" (read by `sources.read_native_config`, which
also reads the older format that mixed the two). Each file is written atomically and
`config.json` last, so a directory with a config is complete. Models are opened by
`loader.open_pipeline`, which reads these files through safetensors' memory map.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_write, atomic_write_text
from ..sources import CONFIG_FILE, NATIVE_FORMAT
from .config import SamplingDefaults
from .dit import VideoDiT

MODEL_FILE, TEXT_FILE = "model.safetensors", "text_encoder.safetensors"


def save_model(
    path: str | os.PathLike,
    dit: VideoDiT,
    text_encoder: nn.Module,
    sampling: SamplingDefaults,
    *,
    dtype: torch.dtype | None = None,
    extra: dict | None = None,
) -> Path:
    """Write a model directory. `dtype` casts floating tensors (e.g. bf16 to halve the size);
    `extra` adds keys to `config.json`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in module.state_dict().items():
            t = t.detach().to("cpu")
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t.contiguous()
        return out

    for filename, module in ((MODEL_FILE, dit), (TEXT_FILE, text_encoder)):
        state = tensors(module)
        atomic_write(path / filename, functools.partial(_save_safetensors, state))
    config = {
        "format": NATIVE_FORMAT,
        "model": dit.config.to_dict(),
        "sampling": sampling.to_dict(),
        **(extra or {}),
    }
    atomic_write_text(path / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return path


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(state, path, metadata={"format": "pt"})
