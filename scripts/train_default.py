"""Train the embedded default model, `megaslide-tiny`, with MegaSlide's own fine-tuning mode.

    python scripts/train_default.py                # write the world, train both phases, package
    python scripts/train_default.py                # again after an interruption: continues where it stopped
    python benchmarks/step_cache.py --calibrate 8 --forecast none linear  # packaging drops the old step curve

The training set is the procedural world (engine/native/world.py): 10000 clips of coloured shapes moving
on a black background, with captions, none showing the held-out colour x shape x motion
combinations. Both phases are `megaslide finetune` runs in pixel space, with the built-in text
encoder (hashed word tokens) trained alongside: the first from random `megaslide-tiny` weights
(the tiny preset with 8x8 patches, predicting clean patches, with absolute positions) at flow
times next to pure noise, where it learns what each prompt implies, its direction of motion
included; the second fine-tunes the first's model with 3D-DSA self-attention over the whole path
(see PHASES; the comparison with dense attention is in docs/history.md, "How motion was learned").

The record (`training.json` beside the weights) holds each phase's command, steps, final loss and
training time, and the guidance scale the package samples with (see GUIDANCE).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ROOT / "engine" / "assets" / "models" / "megaslide-tiny"


# Two parts of one recipe, both from the same world. The first learns what a prompt alone implies:
# from random weights, with flow times only in [0.99, 1) ("prior"), where the input is all but
# pure noise and the best prediction is the mean clip of the prompt, which carries its colours,
# shapes and, only there, its direction of motion (see flow.sample_training_times). The second
# learns to denoise, with 3D-DSA self-attention, on times shifted toward the noisy end with a
# quarter still drawn from "prior", so the first phase's directions are kept.
PHASES = (
    {
        "name": "prior",
        "steps": 3000,
        "until": None,
        "lr": 1e-3,
        "schedule": "constant",
        "warmup": 200,
        "seed": 0,
        "times": "prior",
        "attention": "dense",
    },
    {
        "name": "denoise",
        "steps": 10000,
        "until": None,
        "lr": 1e-3,
        "schedule": "cosine",
        "warmup": 100,
        "seed": 1,
        "times": "noisy+prior",
        "attention": "dsa",
    },
)

# The packaged model's default guidance scale, chosen on prompts sampled with seeds the benchmark
# does not use (the benchmark's 60 prompts with seeds 1000-1059, then 2000-2059). Shape accuracy
# was 85/95% at 2, 90/90% at 2.5, 85/80% at 3 and 70/73% at 4 (the trained config's 4.0); colour
# and motion 97-100% at each.
GUIDANCE = 2.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--work", default=str(ROOT / "runs" / "megaslide-tiny"), help="checkpoints (and the world)"
    )
    ap.add_argument(
        "--world", help="training clips (default: <work>/world, written there if missing)"
    )
    ap.add_argument("--clips", type=int, default=10000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--attention", choices=("dense", "dsa"), help="one backend for every phase (comparisons)"
    )
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--phases", type=int, default=len(PHASES), help="run only the first N phases")
    ap.add_argument("--export-only", action="store_true", help="package the finished run and stop")
    ap.add_argument("--no-package", action="store_true", help="train only (comparison runs)")
    args = ap.parse_args(argv)

    from megaslide.engine.native.world import write_dataset

    work = Path(args.work)
    data = Path(args.world) if args.world else work / "world"
    if not (data / "metadata.jsonl").exists():
        print(f"writing {args.clips} clips to {data}", file=sys.stderr)
        write_dataset(data, args.clips, seed=0, backgrounds=("black",))
    commands = []
    for i, phase in enumerate(PHASES[: args.phases]):
        init = (
            ["--preset", "megaslide-tiny"]
            if i == 0
            else ["--model", str(work / PHASES[i - 1]["name"] / "model")]
        )
        command = [
            sys.executable,
            "-m",
            "megaslide.cli",
            "finetune",
            *init,
            "--data",
            str(data),
            "--output",
            str(work / phase["name"]),
            "--steps",
            str(phase["steps"]),
            *(["--until", str(phase["until"])] if phase["until"] else []),
            "--batch-size",
            str(args.batch_size),
            "--lr",
            str(phase["lr"]),
            "--lr-schedule",
            phase["schedule"],
            "--warmup-steps",
            str(phase["warmup"]),
            "--seed",
            str(phase["seed"]),
            "--save-every",
            str(args.save_every),
            "--frames",
            "16",
            "--size",
            "32x32",
            "--attention",
            args.attention or phase["attention"],
            "--time-sampling",
            phase["times"],
            "--resume",  # a part that was interrupted continues; a finished one stops at once
        ]
        commands.append(command)
        if not args.export_only:
            subprocess.run(command, check=True)
    if args.no_package:
        return 0
    return package(work, commands, args)


def package(work: Path, commands: list[list[str]], args) -> int:
    """Copy the last phase's final fp32 weights into the package, with the run's record."""
    from megaslide.engine.atomic import atomic_directory
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.native.checkpoint import save_model
    from megaslide.engine.training.finetune import list_checkpoints

    parts = []
    for phase, command in zip(PHASES, commands):
        output = work / phase["name"]
        step = list_checkpoints(output)[-1]["step"]
        lines = (output / "metrics.jsonl").read_text().splitlines()
        metrics = [m for m in map(json.loads, filter(str.strip, lines)) if m["step"] <= step]
        parts.append(
            {
                "command": shlex.join(
                    [
                        "megaslide",
                        *(
                            os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a
                            for a in command[3:]
                        ),
                    ]
                ),
                "steps": step,
                "final_loss_mean_of_last_50_steps": sum(m["loss"] for m in metrics[-50:])
                / len(metrics[-50:]),
                "train_seconds": round(sum(m["step_time_s"] for m in metrics), 1),
            }
        )
    pipe = open_pipeline(work / PHASES[len(commands) - 1]["name"] / "model")
    sampling = pipe.info.sampling.replace(guidance=GUIDANCE)  # the weights are unchanged
    record = {
        "clips": args.clips,
        "world_seed": 0,
        "phases": parts,
        "steps_total": sum(p["steps"] for p in parts),
        "train_seconds_total": round(sum(p["train_seconds"] for p in parts), 1),
        "guidance": GUIDANCE,
    }
    with atomic_directory(PACKAGED) as tmp:
        save_model(tmp, pipe.dit, pipe.text_encoder, sampling)
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
