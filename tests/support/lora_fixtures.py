"""Tiny random LoRA adapters for the tiny Wan models of wan_fixtures.py, in each key layout people
share them in, written offline with safetensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

# The tiny transformer (wan_fixtures.transformer): dim 24 (2 heads x 12), ffn 32, text dim 32.
DIM, FFN = 24, 32
IMAGE = 16  # the tiny CLIP's width (wan_fixtures.IMAGE_DIM), what the image embedder takes
ATTN = ("q", "k", "v", "o")
DIFFUSERS_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"}
FFN_LAYERS = {"0": ("net.0.proj", DIM, FFN), "2": ("net.2", FFN, DIM)}


def _factors(g: torch.Generator, rank: int, n_in: int, n_out: int, std: float):
    down = torch.randn(rank, n_in, generator=g) * std
    up = torch.randn(n_out, rank, generator=g) * std
    return down, up


def layers(blocks: int = 2):
    """(original-Wan name, diffusers name, in, out) of every layer the adapters below touch."""
    out = []
    for i in range(blocks):
        for kind, ours in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            for o in ATTN:
                out.append(
                    (f"blocks.{i}.{kind}.{o}", f"blocks.{i}.{ours}.{DIFFUSERS_ATTN[o]}", DIM, DIM)
                )
        for o, (name, n_in, n_out) in FFN_LAYERS.items():
            out.append((f"blocks.{i}.ffn.{o}", f"blocks.{i}.ffn.{name}", n_in, n_out))
    return out


def write_peft(
    path: Path,
    *,
    rank: int = 4,
    seed: int = 0,
    std: float = 0.3,
    alpha=None,
    bias: bool = True,
    blocks: int = 2,
    only=None,
    time_embedder: bool = False,
    extra: dict | None = None,
    metadata_extra: dict | None = None,
) -> Path:
    """diffusers / PEFT layout: `transformer.<module>.lora_A.weight`; with `alpha`, the file's
    `lora_adapter_metadata` says so (as diffusers' save_lora_weights writes it). `time_embedder`
    adapts the timestep embedder too (which runs once per token with per-token timesteps);
    `extra` adds tensors as they are, `metadata_extra` header metadata as it is."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    targets = layers(blocks)
    if time_embedder:
        targets.append((None, "condition_embedder.time_embedder.linear_1", 16, DIM))
    for _, name, n_in, n_out in targets:
        if only is not None and not any(o in name for o in only):
            continue
        down, up = _factors(g, rank, n_in, n_out, std)
        state[f"transformer.{name}.lora_A.weight"] = down
        state[f"transformer.{name}.lora_B.weight"] = up
        if bias:
            state[f"transformer.{name}.lora_B.bias"] = torch.randn(n_out, generator=g) * 0.05
    state.update(extra or {})
    metadata = {"format": "pt"}
    if alpha is not None:
        targets = sorted({k.removeprefix("transformer.").split(".lora_")[0] for k in state})
        config = {"r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_bias": bias}
        metadata["lora_adapter_metadata"] = json.dumps(
            {f"transformer.{k}": v for k, v in config.items()}
        )
    metadata.update(metadata_extra or {})
    save_file(state, str(path), metadata=metadata)
    return path


def write_original(
    path: Path,
    *,
    rank: int = 4,
    seed: int = 1,
    std: float = 0.3,
    alpha=2.0,
    diff_b: bool = True,
    norm_diff: float = 0.0,
    blocks: int = 2,
    i2v: bool = False,
) -> Path:
    """Original Wan / ComfyUI layout: `diffusion_model.blocks.0.self_attn.q.lora_down.weight`,
    `.alpha`, `.diff_b`; `norm_diff` writes a norm-layer `.diff` of that value. `i2v` adds what
    Wan2.1-I2V adapters hold: the image cross-attention's `k_img` / `v_img` in every block and the
    image embedder's `img_emb.proj.1` / `.3` (without alphas: diffusers' converter takes none
    there)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    targets = layers(blocks)
    if i2v:
        targets += [
            (f"blocks.{i}.cross_attn.{o}", None, DIM, DIM)
            for i in range(blocks)
            for o in ("k_img", "v_img")
        ]
        for orig, n_in, n_out in (("img_emb.proj.1", IMAGE, IMAGE), ("img_emb.proj.3", IMAGE, DIM)):
            down, up = _factors(g, rank, n_in, n_out, std)
            state[f"diffusion_model.{orig}.lora_down.weight"] = down
            state[f"diffusion_model.{orig}.lora_up.weight"] = up
            if diff_b:
                state[f"diffusion_model.{orig}.diff_b"] = torch.randn(n_out, generator=g) * 0.05
    for orig, _, n_in, n_out in targets:
        down, up = _factors(g, rank, n_in, n_out, std)
        state[f"diffusion_model.{orig}.lora_down.weight"] = down
        state[f"diffusion_model.{orig}.lora_up.weight"] = up
        if alpha is not None:
            state[f"diffusion_model.{orig}.alpha"] = torch.tensor(float(alpha))
        if diff_b:
            state[f"diffusion_model.{orig}.diff_b"] = torch.randn(n_out, generator=g) * 0.05
    state["diffusion_model.blocks.0.norm3.diff"] = torch.full((DIM,), float(norm_diff))
    save_file(state, str(path))
    return path


def write_musubi(
    path: Path, *, rank: int = 4, seed: int = 2, std: float = 0.3, alpha=8.0, blocks: int = 2
) -> Path:
    """Kohya / musubi-tuner layout: `lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.alpha`."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for orig, _, n_in, n_out in layers(blocks):
        key = "lora_unet_" + orig.replace(".", "_")
        down, up = _factors(g, rank, n_in, n_out, std)
        state[f"{key}.lora_down.weight"] = down
        state[f"{key}.lora_up.weight"] = up
        state[f"{key}.alpha"] = torch.tensor(float(alpha))
    save_file(state, str(path))
    return path


def rewrite(path: Path, change) -> Path:
    """The file at `path` with `change(state)` applied to its tensors (metadata kept)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    change(state)
    save_file(state, str(path), metadata=metadata)
    return path


def hostile_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """Adapter files that must never become `ready`, by name, each with what its refusal says.
    The first seven once passed the server's upload check and then stopped every worker of the
    model as it read them (exceptions other than ValueError inside the converters)."""

    def alpha(n):  # the first `.alpha` as a tensor of n elements
        def change(state):
            state[next(k for k in sorted(state) if k.endswith(".alpha"))] = torch.ones(n)

        return change

    def first_factor(value=None, dtype=None):
        def change(state):
            key = next(k for k in sorted(state) if k.endswith(".lora_A.weight"))
            t = state[key].clone()
            if value is not None:
                t[0, 0] = value
            state[key] = t if dtype is None else t.to(dtype)

        return change

    p = folder
    deep = "[" * 100_000 + "]" * 100_000
    return {
        "meta_list": (
            write_peft(p / "a", metadata_extra={"lora_adapter_metadata": "[1]"}),
            "lora_adapter_metadata must be a JSON object",
        ),
        "alpha_list": (write_peft(p / "b", alpha=[1]), "lora_alpha [1] is not a finite number"),
        "deep_sampling": (
            write_peft(p / "c", metadata_extra={"megaslide.sampling": deep}),
            "megaslide.sampling metadata is not JSON (RecursionError)",
        ),
        "original_alpha2": (rewrite(write_original(p / "d"), alpha(2)), "must be one number"),
        "original_alpha0": (rewrite(write_original(p / "e"), alpha(0)), "must be one number"),
        "musubi_alpha2": (rewrite(write_musubi(p / "f"), alpha(2)), "must be one number"),
        "musubi_alpha0": (rewrite(write_musubi(p / "g"), alpha(0)), "must be one number"),
        "alpha_nan": (write_peft(p / "h", alpha="nan"), "lora_alpha 'nan' is not a finite number"),
        "many_steps": (
            write_peft(p / "i", metadata_extra={"megaslide.sampling": '{"steps": 1e9}'}),
            "steps=1000000000 exceeds",
        ),
        "rank0": (write_peft(p / "j", rank=0), "rank 0"),
        "nan_factor": (rewrite(write_peft(p / "k"), first_factor(math.nan)), "NaN or infinite"),
        "inf_factor": (rewrite(write_peft(p / "l"), first_factor(math.inf)), "NaN or infinite"),
        "int_factors": (
            rewrite(write_peft(p / "m"), first_factor(dtype=torch.int32)),
            "lora_A.weight is int32",
        ),
        "bool_factors": (
            rewrite(write_peft(p / "n"), first_factor(dtype=torch.bool)),
            "lora_A.weight is bool",
        ),
        "fp8_factors": (
            rewrite(write_peft(p / "o"), first_factor(dtype=torch.float8_e4m3fn)),
            "lora_A.weight is float8_e4m3fn",
        ),
    }
