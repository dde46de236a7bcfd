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
PSNR against fp32; and, once, the held-out loss of the model before fine-tuning (what the
fine-tunes moved, against which a format's difference is small or not).

`--model tiny-wan` runs the same measurement on the trained tiny Wan (benchmarks/tiny_wan.py:
diffusers layout, 4 blocks, 9x64x64 clips, built once under `--tiny-wan` and reused), fine-tuned
on the same kind of shifted clips at its own clip shape and flow-time sampling (logit-normal, as
it was trained); its held-out loss is tiny_wan.py's (`heldout_loss`: the transformer's loss on
the encoded held-out clips at t = 0.05 to 0.95). Its VAE is random and frozen, so PSNR compares
that VAE's renderings of the sampled latents.

Prompt adherence (packaged model only, `--adherence N`, default 18: every unseen combination
once): each fine-tuned model samples the first N prompts of `world.benchmark_prompts` (the unseen
combinations first) on the gray background the fine-tune trains on, read back by the world's
analyser (benchmarks/prompt_adherence.py: `adherence`); the model before fine-tuning is read the
same way, as the reference. The tiny Wan's frames are a random VAE's, which the analyser cannot
read.

Cautions: the fine-tunes are short (CPU-sized: 100 steps of 4 clips) and the model is tiny, so
the seed-to-seed spread is wide and a small systematic difference would not show; three seeds
give an interval, not a distribution. A bf16 master also trains under bf16 autocast where an
fp32 one computes in fp32 on the CPU, so a difference mixes the state format with the compute
precision, as it does in a real run. PSNR against fp32 measures how far a format moves the
sampled output, not how good the pictures are; the yardstick is how far two fp32 runs of
different seeds are apart (`fp32_cross_seed_psnr`).

Usage: python benchmarks/finetune_state_quality.py --json [--steps 100] [--seeds 0,1,2]
           [--states fp32,fp32/8bit,bf16-split/8bit,bf16-sr/8bit] [--adherence 18] [--quick]
       python benchmarks/finetune_state_quality.py --model tiny-wan --json [--steps N]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from prompt_adherence import GOALS, accuracy, adherence

from megaslide.engine.family import TrainingShape
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
from megaslide.engine.sources import DEFAULT_MODEL, describe, resolve_source
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
from megaslide.engine.wan.training import CACHE, latent_cache

from tiny_wan import HELDOUT_TIMES as WAN_HELDOUT_TIMES
from tiny_wan import SHAPE as WAN_SHAPE
from tiny_wan import add_threads_arg, trained_tiny_wan
from tiny_wan import heldout_loss as wan_heldout_loss

STATES = ["fp32", "fp32/8bit", "bf16-split/8bit", "bf16-sr/8bit"]
SHAPE = {"frames": 16, "height": 32, "width": 32}  # the packaged model's own clips
MODELS = ("megaslide-tiny", "tiny-wan")
TRAIN_SEED, HELDOUT_SEED = 1, 10_000  # world seeds: the held-out clips are never trained on
HELDOUT_TIMES = (0.3, 0.5, 0.7, 0.85, 0.95)  # a data-predicting model's velocity error
# grows as 1/t towards the clean end: times there would outweigh all others
TIME_SAMPLING = "noisy+prior"  # the packaged model's own (its training.json)
UNSEEN = [
    (c, s, m) for c in COLOURS for s in SHAPES for m in MOTIONS if held_out(c, s, m)
]  # the 18 combinations the packaged model's training never showed


@dataclass(frozen=True)
class Subject:
    """The model a run fine-tunes, at its own clip shape and flow-time sampling, and how its
    held-out loss is read: `heldout(model dir, data, work dir, clips) -> {time: loss, "mean"}`."""

    name: str
    model: str | Path
    shape: dict[str, int]
    time_sampling: str
    heldout_times: tuple[float, ...]
    heldout: Callable[[str | Path, Path, Path, int], dict[str, float]]
    prime: Callable[[Path, Path], None] | None = None  # (data, run output): before it trains


def shifted_dataset(root: Path, count: int, seed: int, shape: dict[str, int]) -> Path:
    """`count` one-object clips of `shape` on gray, each an unseen combination, in the dataset
    layout `write_dataset` writes (metadata.jsonl + MP4s)."""
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        colour, kind, motion = rng.choice(UNSEEN)
        obj = random_object(rng, *shape.values(), colour, kind, motion)
        spec = world.ClipSpec((obj,), "gray", **shape)
        name = f"clips/{i:05d}.mp4"
        write_mp4(root / name, render(spec), fps=8)
        lines.append(json.dumps({"file": name, "text": spec.caption(), "spec": asdict(spec)}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def finetune_spec(
    subject: Subject, output: Path, state: str, seed: int, steps: int, lr: float, batch: int
):
    return FinetuneSpec(
        run=RunSpec(output=str(output), save_every=10**6, seed=seed),
        schedule=ScheduleSpec(steps=steps, lr_schedule="cosine", warmup_steps=max(1, steps // 10)),
        optimizer=OptimizerSpec(lr=lr, state=state),
        clips=ClipSpec(**subject.shape, batch_size=batch, time_sampling=subject.time_sampling),
    )


@torch.no_grad()
def heldout_loss(model: str | Path, data: Path, work: Path, clips: int) -> dict[str, float]:
    """The flow-matching loss of the packaged model's fine-tune `model` (fp32, no autocast) on
    all `clips` clips of `data`, at each of `HELDOUT_TIMES` with noise drawn from seed 0; and
    their mean. The clips are read through a trainer's own data path (one batch of all of them,
    in the order seed 0 gives)."""
    spec = finetune_spec(PACKAGED, work, "fp32", 0, 1, 1e-9, clips)  # never steps
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


PACKAGED = Subject(
    "megaslide-tiny", DEFAULT_MODEL, SHAPE, TIME_SAMPLING, HELDOUT_TIMES, heldout_loss
)


def encoded_once(model: Path, shape: dict[str, int], store: Path) -> Callable[[Path, Path], None]:
    """A run's priming for a family with frozen encoders: the training clips are encoded once,
    into `store`, and each run's directory gets a copy, which its trainer reuses (the cache is
    keyed by the data and the encoders, which no run changes, not by the run)."""

    def prime(data: Path, run: Path) -> None:
        info = describe(resolve_source(str(model)))
        latent_cache(info, data, store, TrainingShape(**shape)).close()
        shutil.copytree(store / CACHE, run / CACHE)

    return prime


def tiny_wan(path: Path, work: Path, *, quick: bool = False) -> Subject:
    """The trained tiny Wan at `path` (built there once: minutes; a 2-step one if `quick`);
    clips encoded once under `work`."""
    if quick:
        model = trained_tiny_wan(path, steps=2, clips=4, heldout_clips=2)
    else:
        model = trained_tiny_wan(path)
    return Subject(
        "tiny-wan",
        model,
        WAN_SHAPE,
        ClipSpec.time_sampling,  # the default, which tiny_wan.py trains with
        WAN_HELDOUT_TIMES,
        # Every run's export has the base's encoders, so one encoding of the held-out clips
        # serves all of them.
        lambda model, data, _, clips: wan_heldout_loss(
            model, work / "heldout-latents", clips, data
        ),
        encoded_once(model, WAN_SHAPE, work / "latents"),
    )


def sample(pipe, prompts: list[str], steps: int | None) -> list[np.ndarray]:
    """One clip per prompt, sampling seed = its index, at the model's defaults."""
    requests = [VideoRequest(p, seed=i, steps=steps) for i, p in enumerate(prompts)]
    return [np.asarray(pipe.generate(r)) for r in requests]


def read_back(pipe, count: int, steps: int | None) -> dict | None:
    """Accuracy of colour, shape and motion read back from the first `count` benchmark
    prompts on gray (the unseen combinations first), sampled at seeds 0, 1, ...; with the
    prompts and what was read."""
    if not count:
        return None
    rows, seconds = adherence(pipe, count, steps, background="gray")
    return {
        **{attr: accuracy(rows, attr) for attr in GOALS},
        "unseen_prompts": sum(r["unseen_combination"] for r in rows),
        "seconds_per_clip": statistics.median(seconds),
        "rows": rows,
    }


def psnr(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """PSNR (dB, peak 255) over all frames of the clips, pooled."""
    diff = np.concatenate([(x.astype(np.float64) - y).ravel() for x, y in zip(a, b)])
    mse = float(np.mean(diff**2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def run(subject: Subject, state, seed, args, data, heldout, work: Path, prompts) -> dict:
    out = work / f"{state.replace('/', '_')}-s{seed}"
    spec = finetune_spec(subject, out / "run", state, seed, args.steps, args.lr, args.batch)
    if subject.prime:
        subject.prime(data, out / "run")
    start = time.perf_counter()
    with open_trainer(subject.model, data, spec) as trainer:
        losses = [trainer.train_step()["loss"] for _ in range(args.steps)]
        trainer.export(out / "model")
    seconds = time.perf_counter() - start
    windows = np.array_split(np.array(losses), min(args.points, len(losses)))
    pipe = open_pipeline(str(out / "model"), dtype="float32")
    return {
        "seed": seed,
        "train_loss_curve": [
            {"steps": f"{int(w0)}-{int(w0) + len(w) - 1}", "mean": float(w.mean())}
            for w0, w in zip(np.cumsum([0] + [len(w) for w in windows[:-1]]), windows)
        ],
        "heldout_loss": subject.heldout(out / "model", heldout, out / "eval", args.heldout_clips),
        "train_s": seconds,
        "adherence": read_back(pipe, args.adherence, args.sample_steps),
        "frames": sample(pipe, prompts, args.sample_steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--model", choices=MODELS, default=MODELS[0], help="what is fine-tuned")
    ap.add_argument(
        "--tiny-wan",
        default=str(Path(__file__).resolve().parents[1] / "runs" / "tiny-wan"),
        help="where the trained tiny Wan is built once and reused (tiny_wan.py --out)",
    )
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--clips", type=int, default=64, help="training clips")
    ap.add_argument("--heldout-clips", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=3, help="sampled videos per run, for PSNR")
    ap.add_argument("--sample-steps", type=int, help="denoising steps (default: the model's)")
    ap.add_argument(
        "--adherence",
        type=int,
        help="prompts read back per run, unseen combinations first (default: 18 for the "
        "packaged model, none for the tiny Wan, whose random VAE the analyser cannot read)",
    )
    ap.add_argument("--points", type=int, default=5, help="points of the training loss curve")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--states", default=",".join(STATES), help="formats (fp32 first)")
    ap.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 3 steps, 2 formats, 1 seed, 2 sampling steps",
    )
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.states = 3, "0", "fp32,bf16-sr/8bit"
        args.clips, args.heldout_clips, args.prompts, args.points = 8, 4, 1, 3
        args.sample_steps = 2
    packaged = args.model == "megaslide-tiny"
    if args.adherence is None:  # every unseen combination once (2 in a smoke run)
        args.adherence = (2 if args.quick else len(UNSEEN)) if packaged else 0
    if args.adherence and not packaged:
        ap.error("--adherence reads pixels of the world: the tiny Wan's VAE is random")
    seeds = [int(s) for s in args.seeds.split(",")]
    states = args.states.split(",")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        if packaged:
            subject = PACKAGED
        else:  # a smoke run builds a 2-step one of its own
            path = work / "tiny-wan" if args.quick else Path(args.tiny_wan)
            subject = tiny_wan(path, work, quick=args.quick)
        build_s = time.perf_counter() - t0
        data = shifted_dataset(work / "data", args.clips, TRAIN_SEED, subject.shape)
        heldout = shifted_dataset(work / "heldout", args.heldout_clips, HELDOUT_SEED, subject.shape)
        prompt_rng = random.Random(0)
        prompts = [caption_for(*prompt_rng.choice(UNSEEN), "gray") for _ in range(args.prompts)]
        # The model before fine-tuning, measured the same way: what the fine-tunes moved.
        heldout_before = subject.heldout(
            subject.model, heldout, work / "base-eval", args.heldout_clips
        )
        before = None
        if args.adherence:
            pipe = open_pipeline(str(subject.model), dtype="float32")
            before = read_back(pipe, args.adherence, args.sample_steps)
        runs = {
            s: [run(subject, s, seed, args, data, heldout, work, prompts) for seed in seeds]
            for s in states
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
        if args.adherence:  # accuracy per attribute: mean over the seeds, and each seed's
            entry["adherence"] = {
                attr: {
                    "mean": statistics.fmean(r["adherence"][attr] for r in rs),
                    "per_seed": [r["adherence"][attr] for r in rs],
                }
                for attr in GOALS
            }
        entry["runs"] = [{k: v for k, v in r.items() if k != "frames"} for r in rs]
        results[state] = entry
    cross = None
    if fp32 and len(fp32) > 1:  # the yardstick: how far apart two fp32 seeds sample
        cross = [psnr(a["frames"], b["frames"]) for a, b in zip(fp32, fp32[1:])]
    report = {
        "benchmark": "finetune_state_quality",
        "model": subject.name,
        "model_path": str(subject.model),
        "clip_shape": subject.shape,
        "time_sampling": subject.time_sampling,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "lr": args.lr,
        "lr_schedule": "cosine, 10% warmup",
        "batch": args.batch,
        "train_clips": args.clips,
        "heldout_clips": args.heldout_clips,
        "heldout_times": subject.heldout_times,
        "prompts": prompts,
        "sample_steps": args.sample_steps,
        "adherence_prompts": args.adherence,
        "heldout_loss_before_finetune": heldout_before,
        "adherence_before_finetune": before,
        "seeds": seeds,
        "fp32_cross_seed_psnr": cross,
        "model_build_s": build_s,
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
            if "adherence" in r:
                extra += "  read back " + ", ".join(
                    f"{attr} {a['mean']:.0%}" for attr, a in r["adherence"].items()
                )
            print(
                f"{state:16} {r['bytes_per_param']:5.2f} B/param  held-out {ho['mean']:.5f} "
                f"[{ho['min']:.5f}, {ho['max']:.5f}]{extra}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
