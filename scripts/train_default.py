"""Train the embedded default model, `megaslide-tiny`, with MegaSlide's own fine-tuning mode.

    python scripts/train_default.py                # generate the world, train, export into the package
    python scripts/train_default.py --resume       # continue an interrupted run (it runs in parts)

The training set is the procedural world (engine/world.py): clips of coloured shapes moving on a
black background, with captions, none showing the held-out colour x shape x motion combinations.
The run is `megaslide finetune` from random `megaslide-tiny` weights (the tiny preset with 8x8
patches, predicting clean patches) in pixel space, with the built-in text encoder trained
alongside. Flow times favour the noisy end: at moderate noise a clip's colour, shape and motion
are still visible in the input, so only near pure noise does the model need the prompt. Dense self-attention: at 32x32
pixels the token grid is 4x4 per frame, smaller than one 3D-DSA window, so 3D-DSA would be dense
attention anyway.

The record (`training.json` beside the weights) holds the command, seed, steps and final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ROOT / "engine" / "assets" / "models" / "megaslide-tiny"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "megaslide-tiny"), help="checkpoints (and the world)")
    ap.add_argument("--world", help="training clips (default: <work>/world, written there if missing)")
    ap.add_argument("--clips", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=16000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--attention", choices=("dense", "dsa"), default="dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export-only", action="store_true", help="package the newest checkpoint and stop")
    ap.add_argument("--no-package", action="store_true", help="train only (comparison runs)")
    args = ap.parse_args(argv)

    from megaslide.engine.world import write_dataset

    work = Path(args.work)
    data, output = Path(args.world) if args.world else work / "world", work / "run"
    if not (data / "metadata.jsonl").exists():
        print(f"writing {args.clips} clips to {data}", file=sys.stderr)
        write_dataset(data, args.clips, seed=args.seed, backgrounds=("black",))
    command = [
        sys.executable, "-m", "megaslide", "finetune", "--preset", "megaslide-tiny", "--data", str(data),
        "--output", str(output), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--lr", str(args.lr), "--lr-schedule", "cosine", "--warmup-steps", "200", "--seed", str(args.seed),
        "--save-every", str(args.save_every), "--frames", "16", "--size", "32x32", "--attention", args.attention,
        "--time-sampling", "noisy",
    ]  # fmt: skip
    if args.resume:
        command.append("--resume")
    start = time.time()
    if not args.export_only:
        subprocess.run(command, check=True)
    if args.no_package:
        return 0
    return package(output, args, command, time.time() - start)


def package(output: Path, args, command: list[str], seconds: float) -> int:
    """Copy the newest checkpoint's fp32 weights into the package, with the run's record."""
    from megaslide.engine.checkpoint import load_model, save_model
    from megaslide.engine.finetune import list_checkpoints

    ckpt = list_checkpoints(output)[-1]
    dit, text, _ = load_model(Path(ckpt["path"]) / "model")
    tmp = PACKAGED.with_name(PACKAGED.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, dit, text)
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = metrics[-50:]
    record = {
        "command": shlex.join(["megaslide", *(os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a
                                               for a in command[3:])]),
        "seed": args.seed,
        "steps": ckpt["step"],  # the newest checkpoint's step: a run may be stopped before --steps
        "planned_steps": args.steps,
        "clips": args.clips,
        "final_loss_mean_of_last_50_steps": sum(m["loss"] for m in last) / len(last),
        "train_seconds_this_part": round(seconds, 1),
        "train_seconds_total": round(sum(m["step_time_s"] for m in metrics), 1),
    }
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(PACKAGED, ignore_errors=True)
    tmp.rename(PACKAGED)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
