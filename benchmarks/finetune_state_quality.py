"""Training quality of the optimizer state formats on real fine-tunes of the packaged model.

`megaslide-tiny` (a 1.3M-parameter DiT, 4 blocks, pixel space, 16x32x32 clips) is fine-tuned
with MegaSlide's own trainer (`open_trainer`) on a shifted data set: one object on a gray
background, always in one of the colour x shape x motion combinations its training held out
(`world.held_out`), so the fine-tune must learn pairings the model never saw. Every format runs
the same steps, learning rate (1e-4, cosine: below half a bf16 spacing of most weights, the
regime where a naive bf16 master loses updates), the model's own flow-time sampling
("noisy+prior") and data; a seed is the run's seed (batch order, flow times, noise, dropped
captions, bf16-sr's rounding). Per run it records the training loss (means over a few windows
of the schedule) and, at the end, a held-out loss: the flow-matching loss of the exported fp32
values on clips of the same distribution from another world seed, at fixed flow times and noise
(`HELDOUT_TIMES`), computed in fp32 for every format. Each run also samples a few videos
(unseen prompts, fixed sampling seeds); a compact format's are compared with the fp32 run of the
same seed by PSNR.

Reported per format: held-out loss per seed and as mean [min, max], whether that interval lies
within the fp32 seeds' [min, max], its difference from the fp32 run of the same seed, and the
PSNR against fp32.

Cautions: the fine-tunes are short (CPU-sized: 100 steps of 4 clips) and the model is tiny, so
the seed-to-seed spread is wide and a small systematic difference would not show; three seeds
give an interval, not a distribution. A bf16 master also trains under bf16 autocast where an
fp32 one computes in fp32 on the CPU, so a difference mixes the state format with the compute
precision, as it does in a real run. PSNR against fp32 measures how far a format moves the
sampled output, not how good the pictures are; the yardstick is how far two fp32 runs of
different seeds are apart (`fp32_cross_seed_psnr`).

Usage: python benchmarks/finetune_state_quality.py --json [--steps 100] [--seeds 0,1,2]
           [--states fp32,fp32/8bit,bf16-split/8bit,bf16-sr/8bit] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native import world
from megaslide.engine.native.world import (
    COLOURS,
    MOTIONS,
    SHAPES,
    caption_for,
    held_out,
    random_object,
    render,
)
from megaslide.engine.request import VideoRequest
from megaslide.engine.sampling.flow import noisy_sample, velocity_target
from megaslide.engine.sources import DEFAULT_MODEL
from megaslide.engine.training.finetune import open_trainer
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
)
from megaslide.engine.training.state_format import StateFormat
from megaslide.engine.video import write_mp4

STATES = ["fp32", "fp32/8bit", "bf16-split/8bit", "bf16-sr/8bit"]
SHAPE = {"frames": 16, "height": 32, "width": 32}  # the packaged model's own clips
TRAIN_SEED, HELDOUT_SEED = 1, 10_000  # world seeds: the held-out clips are never trained on
HELDOUT_TIMES = (0.3, 0.5, 0.7, 0.85, 0.95)  # a data-predicting model's velocity error
# grows as 1/t towards the clean end: times there would outweigh all others
TIME_SAMPLING = "noisy+prior"  # the packaged model's own (its training.json)
UNSEEN = [
    (c, s, m) for c in COLOURS for s in SHAPES for m in MOTIONS if held_out(c, s, m)
]  # the 18 combinations the packaged model's training never showed


def shifted_dataset(root: Path, count: int, seed: int) -> Path:
    """`count` one-object clips on gray, each an unseen combination, in the dataset layout
    `write_dataset` writes (metadata.jsonl + MP4s)."""
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        colour, shape, motion = rng.choice(UNSEEN)
        obj = random_object(rng, *SHAPE.values(), colour, shape, motion)
        spec = world.ClipSpec((obj,), "gray", **SHAPE)
        name = f"clips/{i:05d}.mp4"
        write_mp4(root / name, render(spec), fps=8)
        lines.append(json.dumps({"file": name, "text": spec.caption(), "spec": asdict(spec)}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def finetune_spec(output: Path, state: str, seed: int, steps: int, lr: float, batch: int):
    return FinetuneSpec(
        run=RunSpec(output=str(output), save_every=10**6, seed=seed),
        schedule=ScheduleSpec(steps=steps, lr_schedule="cosine", warmup_steps=max(1, steps // 10)),
        optimizer=OptimizerSpec(lr=lr, state=state),
        clips=ClipSpec(**SHAPE, batch_size=batch, time_sampling=TIME_SAMPLING),
    )


@torch.no_grad()
def heldout_loss(model: Path, data: Path, work: Path, clips: int) -> dict[str, float]:
    """The flow-matching loss of `model` (fp32, no autocast) on all `clips` clips of `data`, at
    each of `HELDOUT_TIMES` with noise drawn from seed 0; and their mean. The clips are read
    through a trainer's own data path (one batch of all of them, in the order seed 0 gives)."""
    spec = finetune_spec(work, "fp32", 0, 1, 1e-9, clips)  # never steps
    with open_trainer(model, data, spec) as trainer:
        batch = next(trainer.loader)
        x0 = trainer.data.x0(batch).float()  # (B, C, F, H, W)
        condition = trainer.data.condition(batch, [False] * clips)
        step = trainer.blockwise
        net, io = step.model, step.blocks_io
        lo, hi = net.time_range
        generator = torch.Generator().manual_seed(0)
        out = {}
        for t in HELDOUT_TIMES:
            noise = torch.randn(x0.shape, generator=generator)
            times = torch.full((clips,), lo + (hi - lo) * t)
            h, carried, static = net.prologue(noisy_sample(x0, noise, times), times, condition)
            for i in range(len(net.blocks)):
                io.load(i)
                h = net.block(i, h, carried, static)  # (B, N, D)
                io.release(i)
            v = net.epilogue(h, carried, static)  # (B, C, F, H, W)
            out[f"t={t}"] = torch.nn.functional.mse_loss(v, velocity_target(x0, noise)).item()
    out["mean"] = statistics.fmean(out.values())
    return out


def sample(model: Path, prompts: list[str], steps: int | None) -> list[np.ndarray]:
    """One clip per prompt, sampling seed = its index, at the model's defaults (fp32)."""
    pipe = open_pipeline(str(model), dtype="float32")
    requests = [VideoRequest(p, seed=i, steps=steps) for i, p in enumerate(prompts)]
    return [np.asarray(pipe.generate(r)) for r in requests]


def psnr(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """PSNR (dB, peak 255) over all frames of the clips, pooled."""
    diff = np.concatenate([(x.astype(np.float64) - y).ravel() for x, y in zip(a, b)])
    mse = float(np.mean(diff**2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def run(state, seed, args, data, heldout, work: Path, prompts) -> dict:
    out = work / f"{state.replace('/', '_')}-s{seed}"
    spec = finetune_spec(out / "run", state, seed, args.steps, args.lr, args.batch)
    start = time.perf_counter()
    with open_trainer(DEFAULT_MODEL, data, spec) as trainer:
        losses = [trainer.train_step()["loss"] for _ in range(args.steps)]
        trainer.export(out / "model")
    seconds = time.perf_counter() - start
    windows = np.array_split(np.array(losses), min(args.points, len(losses)))
    return {
        "seed": seed,
        "train_loss_curve": [
            {"steps": f"{int(w0)}-{int(w0) + len(w) - 1}", "mean": float(w.mean())}
            for w0, w in zip(np.cumsum([0] + [len(w) for w in windows[:-1]]), windows)
        ],
        "heldout_loss": heldout_loss(out / "model", heldout, out / "eval", args.heldout_clips),
        "train_s": seconds,
        "frames": sample(out / "model", prompts, args.sample_steps),
        "model": out / "model",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--clips", type=int, default=64, help="training clips")
    ap.add_argument("--heldout-clips", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=3, help="sampled videos per run, for PSNR")
    ap.add_argument("--sample-steps", type=int, help="denoising steps (default: the model's)")
    ap.add_argument("--points", type=int, default=5, help="points of the training loss curve")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--states", default=",".join(STATES), help="formats (fp32 first)")
    ap.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 3 steps, 2 formats, 1 seed, 2 sampling steps",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.states = 3, "0", "fp32,bf16-sr/8bit"
        args.clips, args.heldout_clips, args.prompts, args.points = 8, 4, 1, 3
        args.sample_steps = 2
    seeds = [int(s) for s in args.seeds.split(",")]
    states = args.states.split(",")
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        data = shifted_dataset(work / "data", args.clips, TRAIN_SEED)
        heldout = shifted_dataset(work / "heldout", args.heldout_clips, HELDOUT_SEED)
        prompt_rng = random.Random(0)
        prompts = [caption_for(*prompt_rng.choice(UNSEEN), "gray") for _ in range(args.prompts)]
        runs = {
            s: [run(s, seed, args, data, heldout, work, prompts) for seed in seeds] for s in states
        }

    fp32 = runs.get("fp32")
    ref = [r["heldout_loss"]["mean"] for r in fp32] if fp32 else None
    results = {}
    for state, rs in runs.items():
        values = [r["heldout_loss"]["mean"] for r in rs]
        entry = {
            "bytes_per_param": StateFormat.parse(state).bytes_per_param(),
            "heldout_loss": {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
            },
        }
        if ref and state != "fp32":
            entry["within_fp32_spread"] = min(ref) <= min(values) and max(values) <= max(ref)
            # Paired with the fp32 run of the same seed: far below the seed-to-seed spread
            # where the format changes little.
            entry["heldout_minus_fp32_same_seed"] = [v - f for v, f in zip(values, ref)]
            entry["psnr_vs_fp32_same_seed"] = [
                psnr(r["frames"], f["frames"]) for r, f in zip(rs, fp32)
            ]
        entry["runs"] = [{k: v for k, v in r.items() if k not in ("frames", "model")} for r in rs]
        results[state] = entry
    cross = None
    if fp32 and len(fp32) > 1:  # the yardstick: how far apart two fp32 seeds sample
        cross = [psnr(a["frames"], b["frames"]) for a, b in zip(fp32, fp32[1:])]
    report = {
        "benchmark": "finetune_state_quality",
        "model": DEFAULT_MODEL,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "lr": args.lr,
        "lr_schedule": "cosine, 10% warmup",
        "batch": args.batch,
        "train_clips": args.clips,
        "heldout_clips": args.heldout_clips,
        "heldout_times": HELDOUT_TIMES,
        "prompts": prompts,
        "sample_steps": args.sample_steps,
        "seeds": seeds,
        "fp32_cross_seed_psnr": cross,
        "seconds": time.perf_counter() - t0,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.steps} steps, lr {args.lr}, seeds {seeds}; fp32 seed-to-seed PSNR {cross}")
        for state, r in results.items():
            ho = r["heldout_loss"]
            extra = ""
            if "psnr_vs_fp32_same_seed" in r:
                extra = f"  within fp32 spread: {r['within_fp32_spread']}  PSNR " + ", ".join(
                    f"{p:.1f}" for p in r["psnr_vs_fp32_same_seed"]
                )
            print(
                f"{state:16} {r['bytes_per_param']:5.2f} B/param  held-out {ho['mean']:.5f} "
                f"[{ho['min']:.5f}, {ho['max']:.5f}]{extra}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
