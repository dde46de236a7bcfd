"""Step caches: how many weight passes each policy and threshold saves, and what it costs.

    python benchmarks/step_cache.py --json                      # the packaged megaslide-tiny
    python benchmarks/step_cache.py --model runs/x/model --count 60 --json
    python benchmarks/step_cache.py --model runs/x/model --calibrate 8   # writes its step curve
    python benchmarks/step_cache.py --calibrate 8 --forecast none linear   # and per forecast
    python benchmarks/step_cache.py --forecast none linear --policies adaptive --thresholds 0.02

Every prompt of `prompt_adherence`'s list is sampled once without a cache (the reference) and
once per policy and threshold, streamed (`offload="stream"`), from the same seed. Per setting:
the weight passes per clip (a reused step runs no pass and moves no weights, so `speedup` =
steps / passes is also the saving in weight transfer), the bytes the streamer moved, the median
wall time per clip, PSNR and SSIM of each clip against its uncached clip (mean over clips, and the
worst clip), and prompt adherence as `prompt_adherence` reads it (colour, shape, motion, and
their mean, in percentage points, against the uncached clips' own). `--forecast` runs every
policy and threshold once per forecast named (what a reused step takes: `none`, the last
computed output; `linear` or `quadratic`, its extrapolation in flow time); `--thresholds`
replaces the thresholds of every policy run.

Goal: >= 1.8x fewer weight passes at PSNR >= 30 dB against uncached and adherence within
2 points; the adaptive policy better than the fixed one at equal speed (`at_equal_speed`: each
adaptive, first-block or forecasting setting's PSNR, mean and worst clip, minus the
output-change policy's without a forecast, interpolated at the same passes; where that is not run,
`at_equal_speed` is left out).

`--calibrate N` measures the model's step curve instead (`step_cache.calibrate`, which the
adaptive policy reads) on the last N prompts of the list, seeds 1000 + i, so that they share no
clip with the measured ones, and writes it into the model directory (`step_cache.json`): the
single reuses' clip errors without a forecast and, for each other forecast that `--forecast`
names, with it (`--calibrate 8 --forecast none linear`: the curve the packaged model ships).
An adaptive setting reads the errors of its own forecast where the curve has them, the plain
reuses' where not (`curve_forecast` in its JSON row says which).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import UTC, datetime

import numpy as np
import torch
import torch.nn.functional as F

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.world import analyse_clip, benchmark_prompts
from megaslide.engine.request import CACHE_FORECASTS, VideoRequest
from megaslide.engine.sampling.step_cache import CURVE_FILE, Adaptive, calibrate
from megaslide.engine.sources import DEFAULT_MODEL

THRESHOLDS = {
    "output-change": (0.02, 0.05, 0.1, 0.2),
    "adaptive": (0.003, 0.006, 0.01, 0.02, 0.04),
    "first-block": (0.1, 0.2, 0.3, 0.5),
}
QUICK_THRESHOLDS = dict.fromkeys(THRESHOLDS, (0.0, 100.0))  # the two extremes
GOALS = {"speedup": 1.8, "psnr_db": 30.0, "adherence_drop_points": 2.0}
PSNR_CAP = 100.0  # identical clips: infinite PSNR, counted as this
ATTRIBUTES = ("colour", "shape", "motion")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of uint8 clips `(F, H, W, 3)` over all their pixels."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return PSNR_CAP if mse == 0 else min(PSNR_CAP, 10 * math.log10(255**2 / mse))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004: an 11x11 Gaussian window of sigma 1.5, K1 0.01, K2 0.03) of
    uint8 clips `(F, H, W, 3)`, over every frame and colour channel."""
    x = torch.from_numpy(a).double().permute(0, 3, 1, 2).flatten(0, 1)[:, None]  # (F*3, 1, H, W)
    y = torch.from_numpy(b).double().permute(0, 3, 1, 2).flatten(0, 1)[:, None]
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :])[None, None]  # (1, 1, 11, 11)

    def blur(z):  # the window's weighted mean around each pixel, edges replicated
        return F.conv2d(F.pad(z, (5, 5, 5, 5), mode="replicate"), window)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return s.mean().item()


def adherence(reads: list[dict], asked: list[tuple]) -> dict:
    """Percent of clips whose colour, shape and motion read as asked, and their mean."""
    out = {
        attr: 100 * sum(r[attr] == a[k] for r, a in zip(reads, asked)) / len(reads)
        for k, attr in enumerate(ATTRIBUTES)
    }
    out["mean"] = sum(out[a] for a in ATTRIBUTES) / len(ATTRIBUTES)
    return out


def sample(pipe, request: VideoRequest):
    """One clip: its frames, the passes it ran, the bytes streamed and the wall time."""
    video = pipe.resolve(request)
    before = pipe.h2d_bytes()
    start = time.perf_counter()
    state = pipe.prepare(video)
    while not state.done:
        pipe.denoise_step([state])
    frames = pipe.finish(state)
    seconds = time.perf_counter() - start
    passes = state.passes
    return frames, passes, pipe.h2d_bytes() - before, seconds


def interpolate(x: float, xs: list[float], ys: list[float]) -> float | None:
    """Piecewise-linear y at x over points sorted by x; None outside their range."""
    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


CALIBRATION_SEED = 1000


def write_curve(args) -> int:
    """Measure the model's step curve on prompts the benchmark does not use; write it beside the
    model's weights."""
    pipe = open_pipeline(args.model, offload="none")
    prompts = benchmark_prompts(60)[-args.calibrate :]
    requests = [
        VideoRequest(p[0], steps=args.steps, seed=CALIBRATION_SEED + i)
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    curve = calibrate(pipe, requests, args.forecast)
    path = pipe.info.source.path / CURVE_FILE
    path.write_text(json.dumps(curve.to_json(), indent=1) + "\n")
    print(
        f"{path}: {len(requests)} prompts, forecasts {', '.join(curve.forecasts)}, in "
        f"{time.perf_counter() - start:.0f} s",
        file=sys.stderr,
    )
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory or packaged name")
    ap.add_argument("--count", type=int, default=60, help="prompts (the held-out ones first)")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload", choices=("none", "stream"), default="stream")
    ap.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; 1 on a busy machine)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="thresholds 0 and 100 only (a check, not a table)"
    )
    ap.add_argument(
        "--policies", nargs="+", choices=tuple(THRESHOLDS), help="only these (default: all)"
    )
    ap.add_argument(
        "--thresholds", nargs="+", type=float, help="these for every policy (default: each its own)"
    )
    ap.add_argument(
        "--forecast",
        nargs="+",
        choices=CACHE_FORECASTS,
        default=["none"],
        help="run every setting with each of these forecasts; with --calibrate, measure the "
        "curve of each (default: none)",
    )
    ap.add_argument("--calibrate", type=int, metavar="N", help="write the model's step curve")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.calibrate:
        return write_curve(args)

    load_start = list(os.getloadavg())
    pipe = open_pipeline(args.model, offload=args.offload)
    prompts = list(benchmark_prompts(args.count))
    asked = [p[1:] for p in prompts]
    steps = args.steps or pipe.info.sampling.steps
    reference, ref_rows = run_prompts(pipe, prompts, args, None)
    ref_adherence = adherence([r["read"] for r in ref_rows], asked)
    results = []
    for setting in settings_grid(args):
        if setting["policy"] == "off":
            clips, rows = reference, ref_rows
        else:
            print(
                f"{setting['policy']} {setting['threshold']} {setting['forecast']}",
                file=sys.stderr,
                flush=True,
            )
            clips, rows = run_prompts(pipe, prompts, args, setting)
        adh = adherence([r["read"] for r in rows], asked)
        if setting["policy"] == "adaptive" and pipe.step_curve is not None:
            # Which single reuses' errors it read: its forecast's, or the plain ones without.
            policy = Adaptive(setting["threshold"], pipe.step_curve, setting["forecast"])
            setting = {**setting, "curve_forecast": policy.curve_forecast}
        results.append(summarise(setting, clips, rows, reference, steps, adh, ref_adherence))
    compare(results)
    result = {
        "model": args.model,
        "prompts": len(prompts),
        "steps": steps,
        "offload": args.offload,
        "step_curve": pipe.step_curve is not None,
        "step_curve_forecasts": list(pipe.step_curve.forecasts) if pipe.step_curve else [],
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


def run_prompts(pipe, prompts: list, args, cache) -> tuple[list, list[dict]]:
    """Every prompt sampled with `cache` (None: off): the clips, and each one's passes, bytes
    moved, seconds and what the analyser reads in it."""
    clips, rows = [], []
    for i, (prompt, *_) in enumerate(prompts):
        request = VideoRequest(prompt, steps=args.steps, seed=args.seed + i, cache=cache)
        frames, passes, moved, seconds = sample(pipe, request)
        a = analyse_clip(frames, "black")
        clips.append(frames)
        rows.append(
            {
                "passes": passes,
                "h2d_bytes": moved,
                "seconds": seconds,
                "read": {"colour": a.colour, "shape": a.shape, "motion": a.motion},
            }
        )
    return clips, rows


def settings_grid(args) -> list[dict]:
    """The settings to run: the cache off first, then each chosen policy, threshold, forecast."""
    settings = [{"policy": "off", "threshold": None, "forecast": "none"}]
    grid = QUICK_THRESHOLDS if args.quick else THRESHOLDS
    chosen = args.policies or tuple(grid)
    settings += [
        {"policy": p, "threshold": t, "forecast": f}
        for f in args.forecast
        for p, ts in grid.items()
        if p in chosen
        for t in args.thresholds or ts
    ]
    return settings


def summarise(setting, clips, rows, reference, steps: int, adh: dict, ref_adherence: dict) -> dict:
    """One setting's row of the table: speed, closeness to the uncached clips, adherence."""
    psnrs = [psnr(c, r) for c, r in zip(clips, reference)]
    passes = float(np.mean([r["passes"] for r in rows]))
    return {
        **setting,
        "passes_per_clip": passes,
        "speedup": steps / passes,
        "h2d_bytes_per_clip": float(np.mean([r["h2d_bytes"] for r in rows])),
        "seconds_per_clip": float(np.median([r["seconds"] for r in rows])),
        "psnr_db": float(np.mean(psnrs)),
        "psnr_db_worst": float(min(psnrs)),
        "ssim": float(np.mean([ssim(c, r) for c, r in zip(clips, reference)])),
        "adherence": adh,
        "adherence_drop_points": ref_adherence["mean"] - adh["mean"],
    }


def compare(results: list[dict]) -> None:
    """Marks the rows that meet the goals, and adds each row's PSNR gain over the fixed
    threshold's curve at the same number of passes."""
    for r in results:
        r["meets_goal"] = (
            r["speedup"] >= GOALS["speedup"]
            and r["psnr_db"] >= GOALS["psnr_db"]
            and r["adherence_drop_points"] <= GOALS["adherence_drop_points"]
        )
    fixed = [r for r in results if r["policy"] == "output-change" and r["forecast"] == "none"]
    for r in results:
        if r["policy"] != "off" and r not in fixed and fixed:
            for key, gain in (("psnr_db", "psnr_gain"), ("psnr_db_worst", "worst_psnr_gain")):
                other = interpolate(
                    r["passes_per_clip"],
                    [f["passes_per_clip"] for f in fixed],
                    [f[key] for f in fixed],
                )
                r[f"{gain}_at_equal_speed_db"] = None if other is None else r[key] - other


def print_table(result: dict) -> None:
    print(f"{result['model']}: {result['prompts']} prompts, {result['steps']} steps")
    for r in result["settings"]:
        gain = r.get("psnr_gain_at_equal_speed_db")
        print(
            f"{r['policy']:>13} {r['threshold'] if r['threshold'] is not None else '':>6} "
            f"{r['forecast']:>9} "
            f"passes {r['passes_per_clip']:5.2f} ({r['speedup']:.2f}x) "
            f"{r['seconds_per_clip']:.3f} s  PSNR {r['psnr_db']:5.2f} dB "
            f"(worst {r['psnr_db_worst']:5.2f})  SSIM {r['ssim']:.3f}  adherence "
            f"{r['adherence']['mean']:5.1f} ({-r['adherence_drop_points']:+.1f})"
            + (f"  vs fixed at equal speed {gain:+.2f} dB" if gain is not None else "")
            + ("  GOAL" if r["meets_goal"] else "")
        )


if __name__ == "__main__":
    sys.exit(main())
