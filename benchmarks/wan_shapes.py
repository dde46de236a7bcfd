"""The published shapes of the Wan models, as config-only diffusers directories.

`write(name, path)` writes `model_index.json` and every component's `config.json` of a released
Wan pipeline (no weights, an empty tokenizer folder): enough for `megaslide info` and `megaslide
plan --model DIR`, which build on the meta device, and for benchmarks that draw random weights
of the real block shapes.

    python benchmarks/wan_shapes.py wan2.1-t2v-14b /tmp/wan14b
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

UMT5_XXL = {
    "_class_name": "UMT5EncoderModel",
    "architectures": ["UMT5EncoderModel"],
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "dense_act_fn": "gelu_new",
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-6,
    "model_type": "umt5",
    "num_heads": 64,
    "num_layers": 24,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}
VAE_2_1 = {
    "_class_name": "AutoencoderKLWan",
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
}
VAE_2_2 = {
    "_class_name": "AutoencoderKLWan",
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
}


def transformer(heads: int, ffn: int, layers: int, channels: int = 16) -> dict:
    return {
        "_class_name": "WanTransformer3DModel",
        "attention_head_dim": 128,
        "cross_attn_norm": True,
        "eps": 1e-6,
        "ffn_dim": ffn,
        "freq_dim": 256,
        "in_channels": channels,
        "num_attention_heads": heads,
        "num_layers": layers,
        "out_channels": channels,
        "patch_size": [1, 2, 2],
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 1024,
        "text_dim": 4096,
    }


def scheduler(shift: float) -> dict:
    return {
        "_class_name": "UniPCMultistepScheduler",
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "flow_shift": shift,
        "num_train_timesteps": 1000,
    }


MODELS = {
    "wan2.1-t2v-1.3b": dict(transformer=transformer(12, 8960, 30), vae=VAE_2_1, shift=3.0),
    "wan2.1-t2v-14b": dict(transformer=transformer(40, 13824, 40), vae=VAE_2_1, shift=5.0),
    "wan2.2-t2v-a14b": dict(
        transformer=transformer(40, 13824, 40), vae=VAE_2_1, shift=12.0, experts=2, boundary=0.875
    ),
    "wan2.2-ti2v-5b": dict(
        transformer=transformer(24, 14336, 30, channels=48), vae=VAE_2_2, shift=5.0, ti2v=True
    ),
}


def write(name: str, path: str | Path) -> Path:
    """A config-only directory of the released pipeline `name` (see MODELS) at `path`."""
    spec, path = MODELS[name], Path(path)
    experts = ("transformer", "transformer_2")[: spec.get("experts", 1)]
    index = {
        "_class_name": "WanPipeline",
        "boundary_ratio": spec.get("boundary"),
        "expand_timesteps": spec.get("ti2v", False),
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"]
        if len(experts) > 1
        else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    files = {
        "model_index.json": index,
        "text_encoder/config.json": UMT5_XXL,
        "vae/config.json": spec["vae"],
        "scheduler/scheduler_config.json": scheduler(spec["shift"]),
        **{f"{e}/config.json": spec["transformer"] for e in experts},
    }
    for relative, content in files.items():
        (path / relative).parent.mkdir(parents=True, exist_ok=True)
        (path / relative).write_text(json.dumps(content, indent=2) + "\n")
    (path / "tokenizer").mkdir(exist_ok=True)
    return path


if __name__ == "__main__":
    print(write(sys.argv[1], sys.argv[2]))
