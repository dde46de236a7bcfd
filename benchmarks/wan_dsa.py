"""How far 3D-DSA moves an untrained Wan model's output from dense attention.

    python benchmarks/wan_dsa.py --json

A tiny random Wan pipeline (tests/support/wan_fixtures.py), one request sampled with dense self-attention
and again with 3D-DSA swapped in (no fine-tuning): the relative L2 distance of the first step's
velocity and of the final latents, and the mean and largest uint8 difference of the frames. The
model never saw local attention, so this is the gap a 3D-DSA fine-tune has to close
(`megaslide finetune --attention dsa`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' tiny Wan builder

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402

from wan_fixtures import build_tiny_wan  # noqa: E402

CASES = [  # (height, width, frames, tile, window): token grids (T, Y, X) of 64 and 320 tokens
    (64, 64, 13, (1, 2, 2), (3, 1, 1)),
    (128, 128, 17, (1, 2, 2), (3, 3, 3)),
]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def sample(pipe, request: VideoRequest) -> dict:
    state = pipe.prepare(pipe.resolve(request))
    first = pipe._forward(pipe.experts[0], [state], (0,))  # the first step's velocity
    while not state.done:
        pipe.denoise_step([state])
    return {"velocity": first, "latents": state.latents, "frames": pipe.finish(state)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_wan(Path(tmp) / "wan", layers=4)
        dense = open_pipeline(path)
        for h, w, frames, tile, window in CASES:
            request = VideoRequest(
                "a red circle moving left",
                height=h,
                width=w,
                frames=frames,
                steps=args.steps,
                seed=0,
            )
            slide = open_pipeline(path, attention="dsa", dsa_tile=tile, dsa_window=window)
            a, b = sample(slide, request), sample(dense, request)
            diff = np.abs(a["frames"].astype(int) - b["frames"].astype(int))
            rows.append(
                {
                    "clip": f"{w}x{h}x{frames}",
                    "token_grid": list(dense.config.token_grid(frames, h, w)),
                    "tile": list(tile),
                    "window": list(window),
                    "first_velocity_relative_l2": relative(a["velocity"], b["velocity"]),
                    "final_latents_relative_l2": relative(a["latents"], b["latents"]),
                    "frames_mean_abs_diff_uint8": float(diff.mean()),
                    "frames_max_abs_diff_uint8": int(diff.max()),
                }
            )
    print(json.dumps({"steps": args.steps, "cases": rows}, indent=2) if args.json else rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
