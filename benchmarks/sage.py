"""8-bit attention (`attention="sage"`) against exact attention: accuracy on Wan-like heads and
the effect on videos.

Heads: q, k, v as Wan's self-attention makes them (`tests/support/sage_inputs.py`: RMS-normed
across heads, Wan's rotary positions, spatially smooth hidden states), with Wan2.1's head dim 128
over a 3 x 30 x 52 token grid (4,680 tokens: 3 latent frames of a 480x832 clip), two heads, bf16
inputs. Sharpness (`gain`) and an outlier offset on 8 channels of K (`k_offset`) vary. Each
output is compared with float64 SDPA on the same bf16 inputs: cosine similarity (SageAttention's
published measure, >= 0.999 the goal), max and mean absolute error; bf16 SDPA, 8-bit attention
without K smoothing and with one int8 scale per tile (128 queries, 64 keys: SageAttention's first
recipe, this one's before per-token scales) are given beside it. The PyTorch reference computes
the 8-bit recipe here (the Triton kernel equals it within rounding: tests/test_sage.py).
`ablation` says where the error comes from: each of the recipe's roundings alone (Q or smoothed K
to int8 per tile or per token, P or V to fp16), everything else exact in float64.

Videos: PSNR of frames sampled with `attention="sage"` against the same model, seed and request
with dense SDPA attention: the tiny random Wan of the tests (fp32 resident, and bf16 streamed with
fp8 weights, the combination users report black frames from), the trained tiny Wan at `--tiny-wan`
when given, and the packaged default model `megaslide-tiny`, which was trained with 3D-DSA: there
both sage and dense replace its own attention, and the PSNR of its own 3D-DSA against dense is
given for scale.

CPU only, `torch.set_num_threads(2)`: no timing is reported (the reference is not the kernel, and
no GPU has run the kernel).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' inputs and tiny Wan builder

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.kernels import sage_attention_reference  # noqa: E402
from megaslide.kernels.sage_reference import quantize_int8, smooth_keys, values_fp16  # noqa: E402

from sage_inputs import cosine, sdpa, wan_like_qkv  # noqa: E402
from wan_fixtures import build_tiny_wan, request  # noqa: E402

HEADS = dict(grid=(3, 30, 52), heads=2, d=128)
SETTINGS = [  # (gain, k_offset)
    (2.0, 0.0),
    (2.0, 10.0),
    (3.0, 0.0),
    (3.0, 10.0),
]


def errors(out: torch.Tensor, exact: torch.Tensor) -> dict:
    d = (out.double() - exact).abs()
    return {
        "cosine": round(cosine(out, exact), 6),
        "max_abs": float(f"{d.max().item():.3g}"),
        "mean_abs": float(f"{d.mean().item():.3g}"),
    }


def _int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x (B, N, H, D)` rounded to int8 with one scale per `group` tokens, back in float64."""
    x8, scale = quantize_int8(x, group, 1)  # (B, H, N, D), (B, H, N)
    return (x8.double() * scale.double()[..., None]).transpose(1, 2)


def _attend(q, k, v, p_fp16: bool = False) -> torch.Tensor:
    """Attention in float64 on `(B, N, H, D)`; `p_fp16` rounds the unnormalised probabilities to
    fp16 as the recipe's P V does."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    s = q @ k.mT / math.sqrt(q.shape[-1])  # (B, H, Nq, Nk)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    total = p.sum(-1, keepdim=True)
    if p_fp16:
        p = p.half().double()
    return ((p @ v) / total).transpose(1, 2)


def ablation(q, k, v, exact) -> dict:
    """Cosine against float64 SDPA with one of the recipe's roundings at a time."""
    ks = smooth_keys(k)  # changes no softmax: the exact attention is the same
    vh, vs = values_fp16(v)
    v16 = vh.double() * vs[:, None].double()
    tile_q, tile_k = 128, 64
    variants = {
        "q_int8_per_tile": lambda: _attend(_int8(q, tile_q), ks, v),
        "q_int8_per_token": lambda: _attend(_int8(q, 1), ks, v),
        "k_int8_per_tile": lambda: _attend(q, _int8(ks, tile_k), v),
        "k_int8_per_token": lambda: _attend(q, _int8(ks, 1), v),
        "p_fp16": lambda: _attend(q, ks, v, p_fp16=True),
        "v_fp16": lambda: _attend(q, ks, v16),
    }
    return {name: round(cosine(run(), exact), 6) for name, run in variants.items()}


def heads(quick: bool) -> list[dict]:
    shape = dict(HEADS, grid=(2, 8, 12)) if quick else HEADS
    rows = []
    for gain, offset in SETTINGS:
        q, k, v = wan_like_qkv(**shape, gain=gain, k_offset=offset, seed=1, dtype=torch.bfloat16)
        exact = sdpa(q, k, v)
        probs = torch.softmax(
            q.double().transpose(1, 2) @ k.double().transpose(1, 2).mT / math.sqrt(shape["d"]), -1
        )
        bf16 = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v))
        ).transpose(1, 2)
        rows.append(
            {
                "gain": gain,
                "k_offset": offset,
                "median_top_probability": round(probs.amax(-1).median().item(), 3),
                "sage": errors(sage_attention_reference(q, k, v), exact),
                "sage_per_tile_scales": errors(
                    sage_attention_reference(q, k, v, groups=(128, 64)), exact
                ),
                "sage_unsmoothed": errors(sage_attention_reference(q, k, v, smooth=False), exact),
                "sdpa_bf16": errors(bf16, exact),
                "ablation": ablation(q, k, v, exact),
            }
        )
    return rows


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else round(10 * math.log10(255**2 / mse), 2)


def video_pair(source, clip: VideoRequest, others=("sage",), **options) -> dict:
    """PSNR of each attention in `others` against dense, same model, seed and request."""
    dense = open_pipeline(source, attention="dense", **options).generate(clip)
    row = {"frames": list(dense.shape)}
    for attention in others:
        video = open_pipeline(source, attention=attention, **options).generate(clip)
        frames = video.reshape(video.shape[0], -1).astype(np.float64)
        row[attention] = {
            "psnr_db": psnr(video, dense),
            "max_level_diff": int(np.abs(video.astype(int) - dense.astype(int)).max()),
            "darkest_frame_mean": round(float(frames.mean(axis=1).min()), 1),
        }
    return row


def videos(tiny_wan: Path | None, quick: bool) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_wan(Path(tmp) / "wan", layers=2)
        clip = request(32, frames=9, steps=2 if quick else 8)
        out["tiny_wan_random_fp32"] = video_pair(path, clip)
        out["tiny_wan_random_bf16_streamed_fp8"] = video_pair(
            path, clip, dtype="bfloat16", offload="stream", weights="fp8"
        )
    if tiny_wan is not None:
        clip = VideoRequest(prompt="a red ball rolls to the right", seed=1)  # its defaults
        if quick:
            clip = VideoRequest(prompt=clip.prompt, seed=1, steps=2)
        out["tiny_wan_trained"] = video_pair(tiny_wan, clip)
        out["tiny_wan_trained_bf16_streamed_fp8"] = video_pair(
            tiny_wan, clip, dtype="bfloat16", offload="stream", weights="fp8"
        )
    clip = VideoRequest(prompt="a red circle moves right", seed=1, steps=2 if quick else None)
    out["megaslide_tiny"] = video_pair(None, clip, others=("sage", "dsa"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny-wan", type=Path, help="a trained tiny Wan pipeline directory")
    ap.add_argument("--quick", action="store_true", help="small shapes and 2 steps (a check)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    result = {
        "device": "cpu",
        "timing": "none: the CPU runs the reference; the Triton kernel has not run on a GPU",
        "heads": {"shape": HEADS, "dtype": "bfloat16", "rows": heads(args.quick)},
        "videos": videos(args.tiny_wan, args.quick),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for row in result["heads"]["rows"]:
        print(
            f"gain {row['gain']} k_offset {row['k_offset']}: cosine sage "
            f"{row['sage']['cosine']}, per-tile scales {row['sage_per_tile_scales']['cosine']}, "
            f"unsmoothed {row['sage_unsmoothed']['cosine']}, "
            f"bf16 SDPA {row['sdpa_bf16']['cosine']}"
        )
    for name, row in result["videos"].items():
        print(name, {k: v for k, v in row.items() if k != "frames"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
