"""A tiny Wan trained here: the tests' tiny random Wan pipeline, fully fine-tuned with MegaSlide's own
trainer on the procedural world (engine/world.py), for benchmarks that want trained weights in
the Wan layout rather than random ones.

    python benchmarks/tiny_wan.py --out runs/tiny-wan --steps 300 --json

The result is a diffusers-layout pipeline directory (`WanPipeline.from_pretrained` loads it).
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

from megaslide.engine.finetune import open_trainer  # noqa: E402
from megaslide.engine.finetune_spec import (  # noqa: E402
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
)
from megaslide.engine.world import write_dataset  # noqa: E402

from wan_fixtures import build_tiny_wan  # noqa: E402

SHAPE = {"frames": 9, "height": 64, "width": 64}  # 3x8x8 latents: a few hundred steps on a CPU
LAYERS = 4


def trained_tiny_wan(out: Path, *, steps: int = 300, clips: int = 48, lr: float = 2e-3) -> Path:
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
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    record = {
        "settings": settings,
        "loss_first_10": first,
        "loss_last_10": last,
        "train_s": time.perf_counter() - start,
    }
    stamp.write_text(json.dumps(record, indent=2))
    return out / "model"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "tiny-wan"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--clips", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = trained_tiny_wan(Path(args.out), steps=args.steps, clips=args.clips)
    record = json.loads((Path(args.out) / "trained.json").read_text())
    if args.json:
        print(json.dumps({"model": str(path), **record}, indent=2))
    else:
        print(
            f"{path}: loss {record['loss_first_10']:.4f} -> {record['loss_last_10']:.4f} "
            f"in {record['train_s']:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
