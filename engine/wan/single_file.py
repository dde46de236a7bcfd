"""A Wan transformer from one safetensors file, as fine-tuned checkpoints are usually shared.

Layouts: the original Wan keys (`blocks.0.self_attn.q.weight`, `head.head.weight`), ComfyUI's
repackaging of them (`model.diffusion_model.` or `diffusion_model.` in front), and diffusers' own
names in one file. Original keys are renamed by diffusers' own converter
(`convert_wan_transformer_to_diffusers`), run over the key names only, so no tensor is read until
the loader asks for it: `SingleFileWeights` is a lazy mapping in diffusers' names, and the loader
fills each tensor straight into the host store (or the device), never holding a second copy.

fp8 files (ComfyUI's `scaled_fp8`, or plain fp8 ones): a `float8_e4m3fn` / `float8_e5m2` weight,
with a `scale_weight` beside it (one value, or one per output row) or without (a scale of 1), is
upcast as `weight.float() * scale_weight` when it is read. `stored_fp8` hands it over as it is
stored instead (`weight_formats.Fp8Weight`): the `fp8` host store keeps those bytes and scale and
decodes them with that same product, so the frames are bitwise the upcast ones. Input scales
(`scale_input`) belong to fp8 matmuls; the model computes in its own dtype and needs none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ..streaming.host_store import SafetensorsFile
from ..streaming.weight_formats import FP8_DTYPES as FP8
from ..streaming.weight_formats import Fp8Weight
from .config import WanFormatError

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
MARKERS = ("scaled_fp8",)  # ComfyUI's marker tensor: says the file is scaled, holds no weight


class SingleFileWeights(Mapping):
    """One transformer's weights in diffusers' names, read lazily from a single file."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise WanFormatError(f"transformer file {path} not found")
        self.path = path
        try:
            self.file = SafetensorsFile(path)
        except Exception as e:  # safetensors' own error types vary across versions
            raise WanFormatError(f"{path}: not a readable safetensors file ({e})") from None
        keys = [k for k in self.file if k.rsplit(".", 1)[-1] not in MARKERS]
        prefix = next((p for p in PREFIXES if all(k.startswith(p) for k in keys)), "")
        self.scales: dict[str, str] = {}  # weight key -> its scale_weight key
        names = []
        for key in keys:
            if key.endswith((".scale_weight", ".scale_input")):
                continue
            base = key.removesuffix(".weight")
            if f"{base}.scale_weight" in self.file:
                self.scales[key] = f"{base}.scale_weight"
            names.append(key)
        stray = next(
            (
                k
                for k in keys
                if k.endswith(".scale_weight")
                and k.removesuffix(".scale_weight") + ".weight" not in self.file
            ),
            None,
        )
        if stray is not None:
            raise WanFormatError(f"{path}: {stray} scales no weight in the file")
        for key, scale_key in self.scales.items():
            self._check_scale(key, scale_key)
        self.names = self._diffusers_names(names, prefix)

    def _check_scale(self, key: str, scale_key: str) -> None:
        """WanFormatError unless `scale_key`'s shape is one scale, or one per output row of
        `key` (read from the header: nothing is loaded)."""
        weight, scale = self.file.locate(key), self.file.locate(scale_key)
        if weight is None or scale is None:
            return  # a dtype torch does not know: reading it fails with safetensors' own error
        n = math.prod(scale.shape)
        rows = weight.shape[0] if weight.shape else 1
        if n == 1 or (scale.shape[0] == rows and n == rows):
            return
        raise WanFormatError(
            f"{self.path}: {scale_key} has shape {list(scale.shape)}: a scale_weight is one value "
            f"or one per output row of {key} {list(weight.shape)}"
        )

    def _diffusers_names(self, keys: list[str], prefix: str) -> dict[str, str]:
        """diffusers name -> key in the file."""
        short = {k.removeprefix(prefix): k for k in keys}
        if any(".attn1." in k or k.startswith("condition_embedder.") for k in short):
            return short  # already diffusers' names
        odd = next((k for k in short if k.startswith(("face_adapter", "motion_encoder"))), None)
        if odd is not None:
            raise WanFormatError(
                f"{self.path}: {short[odd]}: Wan-Animate checkpoints are not supported"
            )
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        # The converter renames keys and moves values; handed names as values, it returns the map.
        renamed = convert_wan_transformer_to_diffusers({k: k for k in short})
        return {new: short[old] for new, old in renamed.items()}

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """WanFormatError naming the first key of the file that matches no weight of the model,
        or the first weight the file lacks (`expected`: the model's names and shapes)."""
        unexpected = sorted(k for k in self.names if k not in expected)
        if unexpected:
            k = unexpected[0]
            raise WanFormatError(
                f"{self.path}: {self.names[k]} (diffusers: {k}) matches no weight of this "
                f"transformer ({len(unexpected)} such keys)"
            )
        missing = sorted(k for k in expected if k not in self.names)
        if missing:
            raise WanFormatError(
                f"{self.path} lacks {missing[0]} ({len(missing)} weights missing): is it a "
                "checkpoint of this model?"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self.names[name]
        t = self.file[key]
        if t.dtype in FP8:
            # Upcast on load: compute runs in the model's dtype, the scale restores the range.
            return self._fp8(key, t).dequantize(torch.float32)
        return t

    def stored_fp8(self, name: str) -> Fp8Weight | None:
        """Weight `name` as the file stores it when that is fp8 (with its scale), else None."""
        key = self.names[name]
        extent = self.file.locate(key)
        if extent is None or extent.dtype not in FP8:
            return None
        return self._fp8(key, self.file[key])

    def _fp8(self, key: str, q: torch.Tensor) -> Fp8Weight:
        scale = torch.ones((), dtype=torch.float32)  # a plain fp8 file: the values themselves
        if key in self.scales:
            scale = self.file[self.scales[key]].to(torch.float32)
            # One value, or one per output row (checked when the file was opened).
            scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1)
        return Fp8Weight(q, scale, f"{self.path}: {key}")

    def locate(self, name: str):
        """Where weight `name` lies in the file as stored (the disk tier), or None when it is
        converted on load (fp8, scaled)."""
        key = self.names[name]
        extent = self.file.locate(key)
        if extent is None or extent.dtype in FP8 or key in self.scales:
            return None
        return extent

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
