"""Which layers cost fp8 its decibels: fp8-round one kind of block linear at a time, measure PSNR.

`--weights fp8` rounds every 2-D `*.weight` of every streamed block (the denoiser's and the text
encoder's) to float8_e4m3fn with a power-of-two scale per row. Here a resident bf16 pipeline gets
the same rounding (`fp8_quantize` then `fp8_dequantize`, what the slot decode computes) on one
group of those weights at a time, and its frames are compared with the untouched pipeline's: the
groups are the denoiser's self-attention q/k/v and output, its cross-attention, its FFN, its
first and last blocks, and the text encoder's blocks; `all` is the whole format (a check of the
simulation against benchmarks/compression.py's figure). `bf16 vs fp32` is a yardstick of no fp8
at all: the untouched bf16 frames against the same pipeline's in fp32.

    python benchmarks/fp8_sensitivity.py --wan trained --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compression import psnr  # noqa: E402

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.native.world import benchmark_prompts  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.engine.streaming.weight_formats import fp8_dequantize, fp8_quantize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def linears(pipe) -> dict[str, torch.Tensor]:
    """Every weight the fp8 format rounds, by a name saying where it is."""
    found = {}
    for e, expert in enumerate(pipe.experts):
        for i, block in enumerate(expert.blocks):
            for name, p in block.named_parameters():
                if p.dim() == 2 and name.endswith("weight"):
                    found[f"expert{e}.blocks.{i}.{name}"] = p
    for i, block in enumerate(pipe.encoders.text_encoder.encoder.block):
        for name, p in block.named_parameters():
            if p.dim() == 2 and name.endswith("weight"):
                found[f"text.blocks.{i}.{name}"] = p
    return found


def groups(names: list[str], depth: int) -> dict[str, list[str]]:
    def denoiser(n: str) -> bool:
        return n.startswith("expert")

    return {
        "all": names,
        "denoiser": [n for n in names if denoiser(n)],
        "text encoder": [n for n in names if n.startswith("text.")],
        "self-attn q/k/v": [
            n for n in names if denoiser(n) and ".attn1.to_" in n and "to_out" not in n
        ],
        "self-attn out": [n for n in names if denoiser(n) and ".attn1.to_out" in n],
        "cross-attn": [n for n in names if denoiser(n) and ".attn2." in n],
        "ffn": [n for n in names if denoiser(n) and ".ffn." in n],
        "first block": [n for n in names if denoiser(n) and ".blocks.0." in n],
        "last block": [n for n in names if denoiser(n) and f".blocks.{depth - 1}." in n],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wan", default="trained", help="a Wan pipeline directory, or 'trained'")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--groups", nargs="*", help="only these groups (default: all of them)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    where = args.wan
    if where == "trained":
        from tiny_wan import trained_tiny_wan

        where = str(trained_tiny_wan(ROOT / "runs" / "tiny-wan"))
    pipe = open_pipeline(where, dtype="bfloat16")
    weights = linears(pipe)
    original = {n: p.detach().clone() for n, p in weights.items()}
    rounded = {n: fp8_dequantize(*fp8_quantize(p), p.dtype) for n, p in weights.items()}
    requests = [
        VideoRequest(prompt, steps=args.steps, seed=i)
        for i, (prompt, *_rest) in enumerate(benchmark_prompts(args.prompts))
    ]
    refs = [pipe.generate(r) for r in requests]
    depth = len(pipe.experts[0].blocks)
    rows = {}
    chosen = groups(list(weights), depth)
    if args.groups is not None:
        chosen = {g: n for g, n in chosen.items() if g in args.groups}
    if args.groups is None or "bf16 vs fp32" in args.groups:
        fp32 = open_pipeline(where, dtype="float32")
        db = [psnr(ref, fp32.generate(r)) for r, ref in zip(requests, refs)]
        rows["bf16 vs fp32"] = {"psnr_db_mean": float(np.mean(db)), "psnr_db_min": min(db)}
    for group, names in chosen.items():
        with torch.no_grad():
            for n in names:
                weights[n].copy_(rounded[n])
        db = [psnr(pipe.generate(r), ref) for r, ref in zip(requests, refs)]
        with torch.no_grad():
            for n in names:
                weights[n].copy_(original[n])
        params = sum(weights[n].numel() for n in names)
        rows[group] = {"psnr_db_mean": float(np.mean(db)), "psnr_db_min": min(db), "params": params}
        if not args.json:
            print(f"{group:16s} {rows[group]['psnr_db_mean']:6.1f} dB (min {min(db):5.1f})")
    if args.json:
        print(json.dumps({"model": where, "prompts": len(requests), "groups": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
