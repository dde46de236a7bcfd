"""Prompt adherence: does a generated clip show the colour, shape and motion its prompt asks for?

    python benchmarks/prompt_adherence.py --json                 # the packaged megaslide-tiny
    python benchmarks/prompt_adherence.py --model runs/x/model --count 60 --json

One clip per prompt (every colour x shape x motion combination held out of training, then seen
ones, on a black background), each read back by the world's rule-based analyser
(`engine/native/world.py: analyse_clip`). Goals: colour >= 95%, motion >= 90%, shape >= 80%, and a default
clip in at most 10 s on the CPU (`seconds_per_clip`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.world import analyse_clip, benchmark_prompts, held_out
from megaslide.engine.request import VideoRequest
from megaslide.engine.sources import DEFAULT_MODEL

GOALS = {"colour": 0.95, "motion": 0.90, "shape": 0.80}


def adherence(
    pipe, count, steps=None, guidance=None, seed=0, background="black"
) -> tuple[list[dict], list[float]]:
    """One clip per benchmark prompt on `background`, read back by the analyser: (rows,
    seconds per clip)."""
    rows, seconds = [], []
    prompts = benchmark_prompts(count, background=background)
    for i, (prompt, colour, shape, motion) in enumerate(prompts):
        request = VideoRequest(prompt, steps=steps, guidance=guidance, seed=seed + i)
        start = time.perf_counter()
        frames = pipe.generate(request)
        seconds.append(time.perf_counter() - start)
        a = analyse_clip(frames, background)
        rows.append(
            {
                "prompt": prompt,
                "unseen_combination": held_out(colour, shape, motion),
                "colour": a.colour == colour,
                "shape": a.shape == shape,
                "motion": a.motion == motion,
                "read": {"colour": a.colour, "shape": a.shape, "motion": a.motion},
            }
        )
    return rows, seconds


def accuracy(subset: list[dict], attr: str) -> float | None:
    return sum(r[attr] for r in subset) / len(subset) if subset else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory or packaged name")
    ap.add_argument("--count", type=int, default=60, help="prompts (the held-out ones come first)")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    ap.add_argument("--guidance", type=float, help="guidance scale (default: the model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="compute dtype (default: the device's)")
    ap.add_argument(
        "--weights",
        default="raw",
        choices=("raw", "lossless", "fp8"),
        help="stream the blocks with their host store in this format (default: raw, resident)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    offload = "none" if args.weights == "raw" else "stream"
    pipe = open_pipeline(args.model, dtype=args.dtype, offload=offload, weights=args.weights)
    rows, seconds = adherence(pipe, args.count, args.steps, args.guidance, args.seed)
    unseen = [r for r in rows if r["unseen_combination"]]
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": args.weights,
        "prompts": len(rows),
        "unseen_prompts": len(unseen),
        "steps": args.steps or pipe.info.sampling.steps,
        "accuracy": {attr: accuracy(rows, attr) for attr in GOALS},
        "accuracy_unseen": {attr: accuracy(unseen, attr) for attr in GOALS},
        "goals": GOALS,
        "goals_met": {attr: accuracy(rows, attr) >= goal for attr, goal in GOALS.items()},
        "seconds_per_clip": sorted(seconds)[len(seconds) // 2],
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        acc = result["accuracy"]
        print(
            f"{len(rows)} prompts: colour {acc['colour']:.1%}, shape {acc['shape']:.1%}, motion {acc['motion']:.1%}; "
            f"{result['seconds_per_clip']:.2f} s per clip"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
