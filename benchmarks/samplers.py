"""Samplers and guidance intervals: the passes and seconds each costs a video, and what it changes.

    python benchmarks/samplers.py --json                     # the packaged megaslide-tiny
    python benchmarks/samplers.py --model tiny-wan --json    # the trained tiny Wan (tiny_wan.py)
    python benchmarks/samplers.py --count 2 --steps 4 --json # a check, not a table

Every prompt of `prompt_adherence`'s list is sampled with the model's own scheduler and full
guidance (the reference), then once per setting (`SETTINGS`), from the same seed: guidance on
the first 75%, 60% and 50% of the steps only (`guidance_interval`), and the euler and consistency
samplers over timesteps spread evenly across the same steps, and over 8 and 4 of them. Per setting:
the model's row passes per clip (two rows a guided step, one otherwise: the work a guidance
interval saves; `passes` counts the steps that ran), the median wall time per clip, PSNR and
SSIM against the reference clip (mean over clips, and the worst clip), and, on the packaged model,
prompt adherence as `prompt_adherence` reads it (colour, shape, motion, their mean, in percentage
points, and its drop from the reference's).

Goal (issue 47): a guidance interval at >= 20% fewer row passes with adherence within 1 point
and PSNR >= 35 dB against full guidance on the packaged model (`meets_goal` per interval row).

The samplers over lists are for step-distilled models (a 4-step LoRA, rCM, DMD): neither model
here is distilled, so their few-step rows show what sampling an undistilled model so costs, not
what a distilled one gives. On the tiny Wan only the transformer is trained and its VAE is random
(tiny_wan.py): its frames are not the world's rendering, so adherence is not read there, and its
PSNR and SSIM measure how far a setting moves the pipeline's output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_cache import ATTRIBUTES, adherence, psnr, ssim  # noqa: E402

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.native.world import analyse_clip, benchmark_prompts  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.engine.sources import DEFAULT_MODEL  # noqa: E402

from tiny_wan import add_threads_arg, trained_tiny_wan  # noqa: E402

# Each setting changes the reference request by these fields; "steps" replaces the steps.
SETTINGS = (
    {"name": "guidance 0-0.75", "guidance_interval": (0, 0.75)},
    {"name": "guidance 0-0.6", "guidance_interval": (0, 0.6)},
    {"name": "guidance 0-0.5", "guidance_interval": (0, 0.5)},
    {"name": "euler", "sampler": "euler"},
    {"name": "consistency", "sampler": "consistency"},
    {"name": "euler 8 steps", "sampler": "euler", "steps": 8},
    {"name": "euler 4 steps", "sampler": "euler", "steps": 4},
    {"name": "consistency 4 steps", "sampler": "consistency", "steps": 4},
)
GOALS = {"row_pass_saving": 0.20, "adherence_drop_points": 1.0, "psnr_db": 35.0}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model directory, packaged name, or tiny-wan (trained here once, under --work)",
    )
    ap.add_argument("--work", default="runs/samplers", help="where the tiny Wan is trained")
    ap.add_argument("--count", type=int, default=24, help="prompts (the held-out ones first)")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload", choices=("none", "stream"), default="none")
    add_threads_arg(ap)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def sample(pipe, request: VideoRequest) -> tuple[np.ndarray, dict]:
    """One clip, and its passes, row passes and wall time."""
    start = time.perf_counter()
    state = pipe.prepare(pipe.resolve(request))
    while not state.done:
        pipe.denoise_step([state])
    frames = pipe.finish(state)
    cost = {"passes": state.passes, "row_passes": state.row_passes}
    return frames, {**cost, "seconds": time.perf_counter() - start}


def run_setting(pipe, prompts: list, requests: list[VideoRequest], read: bool):
    """Every request sampled: the clips, and each one's costs and (`read`) what the analyser
    reads in it."""
    clips, rows = [], []
    for request in requests:
        frames, row = sample(pipe, request)
        if read:
            a = analyse_clip(frames, "black")
            row["read"] = {"colour": a.colour, "shape": a.shape, "motion": a.motion}
        clips.append(frames)
        rows.append(row)
    return clips, rows


def summarise(name, clips, rows, reference, ref_rows, asked, read: bool) -> dict:
    """One setting's row: its cost against the reference's and its closeness to it."""
    psnrs = [psnr(c, r) for c, r in zip(clips, reference)]
    row_passes = float(np.mean([r["row_passes"] for r in rows]))
    ref_row_passes = float(np.mean([r["row_passes"] for r in ref_rows]))
    out = {
        "name": name,
        "passes_per_clip": float(np.mean([r["passes"] for r in rows])),
        "row_passes_per_clip": row_passes,
        "row_pass_saving": round(1 - row_passes / ref_row_passes, 9),  # 32 of 40: 0.2, not less
        "seconds_per_clip": float(np.median([r["seconds"] for r in rows])),
        "psnr_db": float(np.mean(psnrs)),
        "psnr_db_worst": float(min(psnrs)),
        "ssim": float(np.mean([ssim(c, r) for c, r in zip(clips, reference)])),
    }
    if read:
        out["adherence"] = adherence([r["read"] for r in rows], asked)
        ref = adherence([r["read"] for r in ref_rows], asked)
        out["adherence_drop_points"] = ref["mean"] - out["adherence"]["mean"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = list(os.getloadavg())
    model = args.model
    if model == "tiny-wan":
        model = str(trained_tiny_wan(Path(args.work) / "tiny-wan"))
    pipe = open_pipeline(model, offload=args.offload)
    read = pipe.info.family != "wan"  # the world's analyser reads our DiT's frames only
    prompts = list(benchmark_prompts(args.count))
    asked = [p[1:] for p in prompts]
    steps = args.steps or pipe.info.sampling.steps

    def requests(**changes) -> list[VideoRequest]:
        fields = {"steps": steps, **changes}
        return [
            VideoRequest(prompt, seed=args.seed + i, **fields)
            for i, (prompt, *_) in enumerate(prompts)
        ]

    reference, ref_rows = run_setting(pipe, prompts, requests(), read)
    results = [summarise("scheduler", reference, ref_rows, reference, ref_rows, asked, read)]
    for setting in SETTINGS:
        print(setting["name"], file=sys.stderr, flush=True)
        changes = {k: v for k, v in setting.items() if k != "name"}
        clips, rows = run_setting(pipe, prompts, requests(**changes), read)
        results.append(summarise(setting["name"], clips, rows, reference, ref_rows, asked, read))
    for r in results:
        if r["name"].startswith("guidance") and read:
            r["meets_goal"] = (
                r["row_pass_saving"] >= GOALS["row_pass_saving"]
                and r["adherence_drop_points"] <= GOALS["adherence_drop_points"]
                and r["psnr_db"] >= GOALS["psnr_db"]
            )
    result = {
        "model": args.model,
        "family": pipe.info.family,
        "prompts": len(prompts),
        "steps": steps,
        "guidance": pipe.info.sampling.guidance,
        "offload": args.offload,
        "goals": GOALS,
        "settings": results,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": torch.get_num_threads(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "load_average": {"start": load_start, "end": list(os.getloadavg())},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(f"{result['model']}: {result['prompts']} prompts, {result['steps']} steps")
    head = f"{'setting':22} {'passes':>6} {'rows':>6} {'saved':>6} {'s/clip':>7} {'PSNR':>6} {'worst':>6} {'SSIM':>6}"
    print(
        head
        + ("  adherence " + "/".join(ATTRIBUTES) if "adherence" in result["settings"][0] else "")
    )
    for r in result["settings"]:
        line = (
            f"{r['name']:22} {r['passes_per_clip']:6.1f} {r['row_passes_per_clip']:6.1f} "
            f"{r['row_pass_saving']:6.0%} {r['seconds_per_clip']:7.2f} {r['psnr_db']:6.1f} "
            f"{r['psnr_db_worst']:6.1f} {r['ssim']:6.3f}"
        )
        if "adherence" in r:
            a = r["adherence"]
            line += f"  {a['mean']:.1f} ({'/'.join(f'{a[k]:.0f}' for k in ATTRIBUTES)})"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
