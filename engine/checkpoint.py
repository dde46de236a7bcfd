"""Model directories: `config.json` beside `model.safetensors` and `text_encoder.safetensors`.

Tensor names are the modules' own state-dict names, so block `i` of the DiT is every tensor whose
name starts with `blocks.{i}.` and can be read alone (`read_tensors(path, prefix=...)`). Files are
opened through safetensors' memory map: a tensor is read from the page cache when asked for, so
loading never holds a second full copy of the model in RAM. Writes go to a temporary name and are
renamed into place, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .dit import DiTConfig, VideoDiT
from .text import BuiltinTextEncoder

FORMAT = "megaslide-model/1"
MODEL_FILE, TEXT_FILE, CONFIG_FILE = "model.safetensors", "text_encoder.safetensors", "config.json"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())  # the data must be on disk before the rename makes it visible
    os.replace(tmp, path)


def save_model(
    path: str | os.PathLike,
    dit: VideoDiT,
    text_encoder: BuiltinTextEncoder,
    *,
    dtype=None,
    extra=None,
):
    """Write a model directory. `dtype` casts floating tensors (e.g. bf16 to halve the size)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    def tensors(module):
        out = {}
        for name, t in module.state_dict().items():
            t = t.detach().to("cpu")
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t.contiguous()
        return out

    for filename, module in ((MODEL_FILE, dit), (TEXT_FILE, text_encoder)):
        _atomic_write(
            path / filename,
            lambda tmp, m=module: save_file(tensors(m), str(tmp), metadata={"format": "pt"}),
        )
    config = {"format": FORMAT, "model": dit.config.to_dict(), **(extra or {})}
    _atomic_write(
        path / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n")
    )


def read_config(path: str | os.PathLike) -> tuple[DiTConfig, dict]:
    """The model config and the whole `config.json` of a model directory."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no {CONFIG_FILE})")
    raw = json.loads(config_file.read_text())
    if raw.get("format") != FORMAT:
        raise ValueError(
            f"{config_file}: unsupported format {raw.get('format')!r}, expected {FORMAT!r}"
        )
    return DiTConfig.from_dict(raw["model"]), raw


def read_tensors(
    file: str | os.PathLike, prefix: str = "", device="cpu", dtype=None
) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file whose names start with `prefix` (the prefix is kept)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(file), framework="pt", device=str(device)) as f:
        for name in f.keys():
            if name.startswith(prefix):
                t = f.get_tensor(name)
                if t.data_ptr() % 64:
                    # Tensors at unaligned offsets of the file send CPU matmuls down a differently
                    # blocked path, so a loaded model would differ from the saved one in the last
                    # bit. A fresh allocation is aligned.
                    t = t.clone()
                out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def load_model(path: str | os.PathLike, *, device="cpu", dtype=None, **overrides):
    """Build the DiT and text encoder on the meta device, then fill them from the directory.

    `overrides` replace model config fields that do not change the weights (e.g. `attention="dsa"`).
    Returns `(dit, text_encoder, raw_config)`.
    """
    path = Path(path)
    config, raw = read_config(path)
    config = config.replace(**overrides) if overrides else config
    with torch.device("meta"):
        dit, text = VideoDiT(config), BuiltinTextEncoder(config.text)
    for module, filename in ((dit, MODEL_FILE), (text, TEXT_FILE)):
        state = read_tensors(path / filename, device=device, dtype=dtype)
        # assign=True adopts the loaded tensors as the parameters instead of copying into meta ones.
        module.load_state_dict(state, strict=True, assign=True)
    return dit.eval(), text.eval(), raw
