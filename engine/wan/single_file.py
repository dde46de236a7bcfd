"""A Wan transformer from one safetensors file, as fine-tuned checkpoints are usually shared.

Layouts: the original Wan keys (`blocks.0.self_attn.q.weight`, `head.head.weight`), ComfyUI's
repackaging of them (`model.diffusion_model.` or `diffusion_model.` in front), and diffusers' own
names in one file. Original keys are renamed by diffusers' own converter
(`convert_wan_transformer_to_diffusers`), run over the key names only, so no tensor is read until
the loader asks for it: `SingleFileWeights` is a lazy mapping in diffusers' names, and the loader
fills each tensor straight into the host store (or the device), never holding a second copy.

fp8 "scaled" files (ComfyUI's `scaled_fp8`): a `float8_e4m3fn` / `float8_e5m2` weight with a
`scale_weight` beside it is upcast as `weight.float() * scale_weight` when it is read; input
scales (`scale_input`) belong to fp8 matmuls and are not needed once the weights are upcast.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ..host_store import SafetensorsFile
from .config import WanFormatError

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
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
        self.names = self._diffusers_names(names, prefix)

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
            t = t.to(torch.float32)
            if key in self.scales:
                scale = self.file[self.scales[key]].to(torch.float32)
                if scale.dim() == 1 and t.dim() > 1 and scale.numel() == t.shape[0]:
                    scale = scale.view(-1, *([1] * (t.dim() - 1)))  # one scale per output row
                t = t * scale
        return t

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
