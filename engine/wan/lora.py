"""Wan LoRA files in every layout people share them, converted to one form (diffusers' names).

- original Wan / ComfyUI: `diffusion_model.blocks.0.self_attn.q.lora_down.weight` (or `lora_A`),
  `.alpha`, `diff_b` bias deltas, `head.head.diff`; a VACE model's `vace_blocks.0...` too (the
  same layers, and `before_proj` / `after_proj`: diffusers' `proj_in` / `proj_out`);
- Kohya / musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight` with `.alpha`;
- diffusers / PEFT: `transformer.blocks.0.attn1.to_q.lora_A.weight` (alphas, when not 1.0, in the
  file's `lora_adapter_metadata`, as diffusers writes it).

The first two go through diffusers' own converters (the ones `WanPipeline.load_lora_weights`
uses), so the factors are the very tensors diffusers would load. Its converter knows no VACE
blocks (`WanVACEPipeline.load_lora_weights` refuses an original-layout file that has them): their
layers are the blocks' own, so they go through the same converter under the blocks' names, and
the hints' projections are folded here the same way (`alpha / rank`, split between the factors
by powers of two as the converter splits it). What those converters drop
without a word (non-zero deltas on norm layers, full-weight `.diff` deltas, a time projection's
bias delta without its weight, DoRA magnitudes) is refused here instead, naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from ..lora import (
    Adapter,
    AdapterError,
    deltas_from_peft,
    json_object,
    read_adapter_file,
    sidecar_defaults,
)

PEFT_PREFIXES = ("transformer.", "base_model.model.")


def load_wan_adapter(name: str, path: str | Path) -> Adapter:
    """Read and convert a Wan LoRA file (any layout above); AdapterError naming the first key it
    cannot take. Fit to a particular model is checked when it is registered."""
    tensors, metadata = read_adapter_file(path)
    return Adapter(
        name,
        wan_deltas(tensors, metadata, source=str(path)),
        source=str(path),
        defaults=sidecar_defaults(path, metadata),
    )


def wan_deltas(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str], *, source: str = ""):
    """Deltas by diffusers module name from a Wan LoRA state dict in any of the layouts above."""
    where = f"{source}: " if source else ""
    dora = next((k for k in tensors if "dora_scale" in k or "magnitude_vector" in k), None)
    if dora is not None:
        raise AdapterError(f"{where}{dora}: DoRA adapters are not supported", key=dora)
    if any(k.startswith("diffusion_model.") for k in tensors) or any(
        k.startswith("lora_unet_") for k in tensors
    ):
        state = _convert_with_diffusers(tensors, where)
        alphas = None  # the converters fold each alpha into the factors
    else:
        state, alphas = _peft_state(tensors, metadata, where)
    try:
        return deltas_from_peft(state, alphas)
    except AdapterError as e:
        raise AdapterError(f"{where}{e}", key=e.key) from None


def _convert_with_diffusers(tensors: dict[str, torch.Tensor], where: str) -> dict:
    from diffusers.loaders.lora_conversion_utils import (
        _convert_musubi_wan_lora_to_diffusers,
        _convert_non_diffusers_wan_lora_to_diffusers,
    )

    original = any(k.startswith("diffusion_model.") for k in tensors)
    stray = next(
        (k for k in tensors if not k.startswith("diffusion_model." if original else "lora_unet_")),
        None,
    )
    if stray is not None:
        raise AdapterError(f"{where}{stray}: not a key of a Wan transformer's LoRA", key=stray)
    if original:
        _refuse_dropped(tensors, where)
    _check_alphas(tensors, where)
    vace: dict[str, torch.Tensor] = {}
    if original:
        vace = {k: v for k, v in tensors.items() if k.startswith(VACE_PREFIX)}
        tensors = {k: v for k, v in tensors.items() if k not in vace}
    try:
        converted = {}
        if not original:
            converted = _convert_musubi_wan_lora_to_diffusers(dict(tensors))
        elif tensors:
            converted = _convert_non_diffusers_wan_lora_to_diffusers(dict(tensors))
        if vace:
            converted.update(
                _convert_vace_blocks(vace, _convert_non_diffusers_wan_lora_to_diffusers)
            )
    except KeyError as e:
        key = str(e.args[0]) if e.args else "?"
        raise AdapterError(
            f"{where}{key} is missing (this layout needs both factors of every layer it adapts "
            "in every block)",
            key=key,
        ) from None
    except ValueError as e:
        raise AdapterError(f"{where}keys diffusers' Wan converter cannot place: {e}") from None
    except Exception as e:  # the converter's own assumptions about a file, broken by this one
        raise AdapterError(
            f"{where}diffusers' Wan converter cannot read this file ({type(e).__name__}: {e})"
        ) from None
    return {k.removeprefix("transformer."): v for k, v in converted.items()}


VACE_PREFIX = "diffusion_model.vace_blocks."
VACE_PROJECTIONS = {"before_proj": "proj_in", "after_proj": "proj_out"}


def _convert_vace_blocks(tensors: dict[str, torch.Tensor], convert) -> dict[str, torch.Tensor]:
    """An original-layout file's `vace_blocks.*` keys in diffusers' names: the attention and
    feed-forward layers through `convert` (diffusers' converter) under the blocks' names, the
    hints' `before_proj` / `after_proj` here. Keys it leaves are refused by the caller's
    except clauses as the converter's own are."""
    blocks, projections = {}, {}
    for key, value in tensors.items():
        index, rest = key.removeprefix(VACE_PREFIX).split(".", 1)
        layer = rest.split(".", 1)[0]
        if layer in VACE_PROJECTIONS:
            projections[f"vace_blocks.{index}.{VACE_PROJECTIONS[layer]}{rest[len(layer) :]}"] = (
                value
            )
        else:
            blocks[f"diffusion_model.blocks.{index}.{rest}"] = value
    out = {}
    if blocks:
        for key, value in convert(blocks).items():
            out["vace_" + key.removeprefix("transformer.")] = value
    for module in sorted({k.rsplit(".", 2)[0] for k in projections if ".lora_" in k}):
        down = projections.pop(f"{module}.lora_down.weight", None)
        down = projections.pop(f"{module}.lora_A.weight", down)
        up = projections.pop(f"{module}.lora_up.weight", None)
        up = projections.pop(f"{module}.lora_B.weight", up)
        if down is None or up is None:
            missing = "lora_down" if down is None else "lora_up"
            raise KeyError(f"{module}.{missing}.weight")
        alpha = projections.pop(f"{module}.alpha", None)
        if alpha is not None:
            scale_down, scale_up = _alpha_split(float(alpha), down.shape[0])
            down, up = down * scale_down, up * scale_up
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = down, up
    for key in [k for k in projections if k.endswith(".diff_b")]:
        out[key.removesuffix(".diff_b") + ".lora_B.bias"] = projections.pop(key)
    if projections:
        raise ValueError(f"VACE keys left over: {sorted(projections)}")
    return out


def _alpha_split(alpha: float, rank: int) -> tuple[float, float]:
    """`alpha / rank` as (down's factor, up's factor), powers of two moved from up to down
    while down's is under half of up's: the split diffusers' Wan converter makes."""
    down, up = alpha / rank, 1.0
    while down * 2 < up:
        down, up = down * 2, up / 2
    return down, up


def _check_alphas(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Each `.alpha` must be one finite number: the converters take it with `.item()` and fold
    it into the factors."""
    for key in sorted(k for k in tensors if k.endswith(".alpha")):
        t = tensors[key]
        if t.numel() != 1 or t.dtype == torch.bool or t.is_complex():
            raise AdapterError(
                f"{where}{key} must be one number, not a {t.dtype} tensor of shape "
                f"{tuple(t.shape)}",
                key=key,
            )
        if not math.isfinite(float(t)):
            raise AdapterError(f"{where}{key} is not a finite number", key=key)


def _refuse_dropped(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse the keys diffusers' converter would drop when they carry anything (zeros are
    dropped honestly: they change nothing)."""
    has_time_weight = any(
        k.startswith("diffusion_model.time_projection") and k.endswith(".weight") for k in tensors
    )
    for key in sorted(tensors):
        t = tensors[key]
        dropped = (
            (key.endswith((".diff", ".diff_b")) and "norm" in key)
            or ("time_projection" in key and not has_time_weight)
            or (key.endswith(".diff") and "head.head" not in key)
        )
        if dropped and bool(t.ne(0).any()):
            raise AdapterError(
                f"{where}{key}: full-weight and norm-layer deltas are not supported (only low-rank "
                "factors and bias deltas are applied)",
                key=key,
            )


def _peft_state(tensors, metadata, where) -> tuple[dict, dict | None]:
    """diffusers / PEFT keys without their prefix, and each module's alpha from the file's
    `lora_adapter_metadata` (diffusers' own record of its LoraConfig), when it has one."""
    prefixed = [p for p in PEFT_PREFIXES if any(k.startswith(p) for k in tensors)]
    prefix = prefixed[0] if prefixed else ""
    if prefix:
        stray = next((k for k in sorted(tensors) if not k.startswith(prefix)), None)
        if stray is not None:
            raise AdapterError(
                f"{where}{stray}: not a key of the transformer's LoRA (only the denoiser takes "
                "adapters)",
                key=stray,
            )
    state = {k.removeprefix(prefix): v for k, v in tensors.items()}
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return state, None
    config = json_object(raw, f"{where}lora_adapter_metadata")
    config = {k.removeprefix("transformer."): v for k, v in config.items()}
    for unsupported in ("use_rslora", "use_dora"):
        if config.get(unsupported):
            raise AdapterError(f"{where}{unsupported} adapters are not supported")
    lora_alpha = _alpha(config.get("lora_alpha"), "lora_alpha", where)
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise AdapterError(f"{where}lora_adapter_metadata: alpha_pattern must be a JSON object")
    alphas = {}
    for key in state:
        module = key.split(".lora_")[0]
        match = next((p for p in patterns if module == p or module.endswith("." + p)), None)
        alpha = lora_alpha
        if match is not None:
            alpha = _alpha(patterns[match], f"alpha_pattern {match!r}", where)
        if alpha is not None:
            alphas[module] = alpha
    return state, alphas


def _alpha(value, what: str, where: str) -> float | None:
    """An alpha from the metadata as a finite float (None: not given); AdapterError otherwise
    (a string such as "nan" included: JSON has numbers for numbers)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdapterError(f"{where}lora_adapter_metadata: {what} {value!r} is not a finite number")
    return float(value)
