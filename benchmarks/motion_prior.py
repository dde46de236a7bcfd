"""Motion prior: does a model's prediction from pure noise carry the prompt's direction of motion?

    python benchmarks/motion_prior.py --json                      # the packaged megaslide-tiny
    python benchmarks/motion_prior.py --model runs/x/model --json

From an input that is all noise, the best prediction of the clean clip is the mean clip of the
prompt. A direction of motion lives only in how that mean depends on frame and position jointly
(a left-moving object is on the right early and on the left late), so it is the part a model learns
last, and a model without it draws objects moving whichever way the noise suggests. For each
one-object prompt (colour x shape x direction) this compares the model's predicted clean clip at
flow time t with the world's own mean clips, rendered by `engine/native/world.py`: `mu_d` for the prompt's
direction and `mu_any`, the mean over the four directions. The score is the projection

    score = <pred - mu_any, mu_d - mu_any> / |mu_d - mu_any|^2

1 when the prediction is the direction's mean, 0 when the direction word is ignored, negative when
it points the other way. `drift_px` is the centroid's travel in the predicted mean clip, from the
first to the last quarter of the frames, as (dy, dx) per direction.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import numpy as np
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.family import DiTPipeline
from megaslide.engine.native.world import (
    COLOURS,
    SHAPES,
    ClipSpec,
    caption_for,
    random_object,
    render,
)
from megaslide.engine.sources import DEFAULT_MODEL
from megaslide.engine.video import frames_to_float

DIRECTIONS = ("left", "right", "up", "down")


def mean_clip(
    colour: str, shape: str, motion: str, samples: int, rng: random.Random, sampling
) -> torch.Tensor:
    """The world's mean one-object clip `(3, F, H, W)` in [-1, 1] for a caption, on black, at
    the model's default clip shape (`sampling`)."""
    F, H, W = sampling.frames, sampling.height, sampling.width
    clips = (
        render(ClipSpec((random_object(rng, F, H, W, colour, shape, motion),), "black", F, H, W))
        for _ in range(samples)
    )
    return sum(frames_to_float(clip) for clip in clips) / samples  # (3, F, H, W)


def centroid_drift(clip: torch.Tensor) -> tuple[float, float]:
    """(dy, dx) in pixels of the brightness-weighted centroid, first quarter of frames to last."""
    w = (clip + 1).clamp_min(0).sum(0)  # (F, H, W): light above the black background
    F, H, W = w.shape
    mass = w.sum((1, 2)).clamp_min(1e-6)  # (F,)
    ys = (w * torch.arange(H).view(1, H, 1)).sum((1, 2)) / mass
    xs = (w * torch.arange(W).view(1, 1, W)).sum((1, 2)) / mass
    k = max(1, F // 4)
    return float(ys[-k:].mean() - ys[:k].mean()), float(xs[-k:].mean() - xs[:k].mean())


@torch.no_grad()
def predicted_clean_clip(
    pipe: DiTPipeline, prompt: str, t: float, noises: int, seed: int
) -> torch.Tensor:
    """The model's clean clip `(C, F, H, W)` from pure noise presented as flow time t (as the
    sampler's first steps see it), averaged over `noises` draws."""
    c, s = pipe.config, pipe.info.sampling
    ctx, mask = pipe.text_encoder.encode([prompt] * noises)  # (n, L, text_dim)
    g = torch.Generator().manual_seed(seed)
    shape = (noises, c.in_channels, s.frames, s.height, s.width)
    noise = torch.randn(shape, generator=g)  # (n, C, F, H, W)
    v = pipe.dit(noise, torch.full((noises,), t), ctx, mask).float()  # (n, C, F, H, W) velocity
    return (noise - t * v).mean(0)  # x_t - t * (noise - x0) = x0 when x_t is on the path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory or packaged name")
    ap.add_argument(
        "--times", type=float, nargs="+", default=[1.0, 0.9], help="flow times to probe"
    )
    ap.add_argument(
        "--colours", type=int, default=len(COLOURS), help="first N colours of the world"
    )
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="first N shapes of the world")
    ap.add_argument("--samples", type=int, default=200, help="world clips per mean clip")
    ap.add_argument("--noises", type=int, default=4, help="noise draws per prediction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    pipe = open_pipeline(args.model)
    rng = random.Random(args.seed)
    result = {"model": args.model, "samples": args.samples, "noises": args.noises, "times": {}}
    prompts = [
        (colour, shape)
        for colour in list(COLOURS)[: args.colours]
        for shape in SHAPES[: args.shapes]
    ]
    means = {
        (c, s, d): mean_clip(c, s, d, args.samples, rng, pipe.info.sampling)
        for c, s in prompts
        for d in DIRECTIONS
    }
    for t in args.times:
        scores = {d: [] for d in DIRECTIONS}
        drifts = {d: [] for d in DIRECTIONS}
        for i, (colour, shape) in enumerate(prompts):
            mu_any = sum(means[colour, shape, d] for d in DIRECTIONS) / len(DIRECTIONS)
            for d in DIRECTIONS:
                pred = predicted_clean_clip(
                    pipe, caption_for(colour, shape, d), t, args.noises, args.seed + i
                )
                target = means[colour, shape, d] - mu_any
                scores[d].append(float(((pred - mu_any) * target).sum() / target.square().sum()))
                drifts[d].append(centroid_drift(pred))
        result["times"][str(t)] = {
            "score": float(np.mean([s for d in DIRECTIONS for s in scores[d]])),
            "score_by_direction": {d: float(np.mean(scores[d])) for d in DIRECTIONS},
            "drift_px": {
                d: [round(float(v), 2) for v in np.mean(drifts[d], axis=0)] for d in DIRECTIONS
            },
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for t, r in result["times"].items():
            print(
                f"t={t}: direction score {r['score']:.3f} (1 = the prompt's mean clip, 0 = direction ignored)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
