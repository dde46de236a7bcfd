"""A tiny Wan trained here: the tests' tiny random Wan pipeline, fully fine-tuned with MegaSlide's own
trainer on the procedural world (engine/native/world.py), for benchmarks that want trained weights in
the Wan layout rather than random ones.

    python benchmarks/tiny_wan.py --out runs/tiny-wan --json

The result is a diffusers-layout pipeline directory (`WanPipeline.from_pretrained` loads it).
By default it trains 6000 steps, where its loss on clips it never saw still improves, slowly
(`heldout_loss`: the flow-matching loss of 64 clips of another world seed, at fixed flow times
and noise, recorded in `trained.json`). That matters for what the benchmarks read from it: a
model stopped early (600 steps: held-out loss 0.27, against 0.11 at the default 6000) has not
learnt the end of the schedule, where its guided output then grows and swings from step to
step, and step caches look far worse on it than on a trained one (docs/history.md).
Caution: only the transformer trains. The tiny VAE is random and stays frozen (as our trainer
keeps every Wan VAE), so decoded frames are that VAE's rendering of latents the transformer has
learned to denoise: figures computed on frames (PSNR, SSIM) measure how far a change moves the
pipeline's output, not how good the pictures look. A built directory is reused when its
`trained.json` says it was made with the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' tiny Wan builder

from megaslide.engine.family import TrainingShape  # noqa: E402
from megaslide.engine.native.world import write_dataset  # noqa: E402
from megaslide.engine.sampling.flow import noisy_sample, velocity_target  # noqa: E402
from megaslide.engine.sources import describe, resolve_source  # noqa: E402
from megaslide.engine.training.finetune import open_trainer  # noqa: E402
from megaslide.engine.training.finetune_spec import (  # noqa: E402
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
)
from megaslide.engine.wan.training import latent_cache  # noqa: E402

from wan_fixtures import build_tiny_wan  # noqa: E402

SHAPE = {"frames": 9, "height": 64, "width": 64}  # 3x8x8 latents: 6000 steps in minutes on a CPU
LAYERS = 4
STEPS, CLIPS = 6000, 48  # held-out loss 0.27 at 600 steps, 0.13 at 3000, 0.11 here
HELDOUT_SEED, HELDOUT_CLIPS = 10_000, 64  # a world the training never draws from
HELDOUT_TIMES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)


def trained_tiny_wan(
    out: Path,
    *,
    steps: int = STEPS,
    clips: int = CLIPS,
    lr: float = 2e-3,
    heldout_clips: int = HELDOUT_CLIPS,
) -> Path:
    """The pipeline directory of a tiny Wan trained `steps` optimizer steps at `out/model`
    (built once; reused while its settings match)."""
    out = Path(out)
    settings = {"steps": steps, "clips": clips, "lr": lr, "layers": LAYERS, **SHAPE}
    stamp = out / "trained.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("settings") == settings:
        return out / "model"
    base = build_tiny_wan(out / "base", layers=LAYERS, sampling={**SHAPE, "steps": 20})
    data = write_dataset(out / "world", clips, seed=0, **SHAPE)
    spec = FinetuneSpec(
        run=RunSpec(output=str(out / "run"), save_every=10**6),
        schedule=ScheduleSpec(steps=steps, lr_schedule="cosine", warmup_steps=10),
        optimizer=OptimizerSpec(lr=lr),
        clips=ClipSpec(**SHAPE, batch_size=4),
    )
    start = time.perf_counter()
    with open_trainer(base, data, spec) as trainer:
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        trainer.export(out / "model")
    seconds = time.perf_counter() - start
    record = {
        "settings": settings,
        "loss_first_10": sum(losses[:10]) / 10,
        "loss_last_10": sum(losses[-10:]) / 10,
        "train_s": seconds,
        "heldout_loss": heldout_loss(out / "model", out / "heldout", heldout_clips),
    }
    stamp.write_text(json.dumps(record, indent=2))
    return out / "model"


@torch.no_grad()
def heldout_loss(
    model: Path, work: Path, clips: int = HELDOUT_CLIPS, data: Path | None = None
) -> dict[str, float]:
    """The model's flow-matching loss (MSE of its flow prediction against `noise - x0`) on
    `clips` clips of a world seed training never uses (or the first `clips` of the dataset
    `data`, clips of `SHAPE`), encoded as training encodes its clips, at each of
    `HELDOUT_TIMES` with noise drawn from seed 0; and their mean."""
    from diffusers import WanTransformer3DModel

    info = describe(resolve_source(str(model)))
    if data is None:
        data = write_dataset(work / "world", clips, seed=HELDOUT_SEED, **SHAPE)
    cache = latent_cache(info, data, work, TrainingShape(**SHAPE))
    x0 = torch.stack([cache.files[f"latent.{i}"].float() for i in range(clips)])
    text = torch.stack([cache.embedding(str(i)) for i in range(clips)])
    transformer = WanTransformer3DModel.from_pretrained(model / "transformer").eval()
    generator = torch.Generator().manual_seed(0)
    out = {}
    for t in HELDOUT_TIMES:
        noise = torch.randn(x0.shape, generator=generator)
        times = torch.full((clips,), t)
        timestep = times * info.config.num_train_timesteps  # as training and sampling feed it
        v = transformer(noisy_sample(x0, noise, times), timestep, text, return_dict=False)[0]
        out[f"t={t}"] = torch.nn.functional.mse_loss(v, velocity_target(x0, noise)).item()
    out["mean"] = sum(out.values()) / len(out)
    return out


def add_threads_arg(ap: argparse.ArgumentParser) -> None:
    """`--threads`, the torch CPU threads of a benchmark of tiny models."""
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="CPU threads (1 on a machine other work keeps busy: a tiny model's many small "
        "parallel regions wait on a preempted thread)",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "tiny-wan"))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--clips", type=int, default=CLIPS)
    ap.add_argument("--heldout-clips", type=int, default=HELDOUT_CLIPS)
    ap.add_argument("--json", action="store_true")
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = trained_tiny_wan(
        Path(args.out), steps=args.steps, clips=args.clips, heldout_clips=args.heldout_clips
    )
    record = json.loads((Path(args.out) / "trained.json").read_text())
    if args.json:
        print(json.dumps({"model": str(path), **record}, indent=2))
    else:
        print(
            f"{path}: loss {record['loss_first_10']:.4f} -> {record['loss_last_10']:.4f} "
            f"in {record['train_s']:.0f} s; held-out {record['heldout_loss']['mean']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
