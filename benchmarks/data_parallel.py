"""Fine-tuning in one process against the same run split over several: the weights, and step time.

    python benchmarks/data_parallel.py --json                               # cpu against cpu,cpu
    python benchmarks/data_parallel.py --devices cpu,cpu,cpu,cpu --json
    python benchmarks/data_parallel.py --devices cuda:0,cuda:1 --json       # two GPUs

Runs `--steps` optimizer steps of the same fine-tune (streamed, procedural clips) with
`open_trainer` on the first device and with `finetune_on_devices` over `--devices`, and reports
how far apart the final weights are (`off_by`: the norm of the difference over the norm of what
training moved, see tests/test_data_parallel.py), the median step time of each after the first
step (rank 0's `step_time_s`: its part of the step and the waits for the others), and the wall
time including start-up. On the CPU the single process gets every core (`--threads`: fewer) and
each rank an equal share of them, so the comparison is the same cores used two ways.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megaslide.engine.native.world import write_dataset
from megaslide.engine.parallel.data_parallel import finetune_on_devices
from megaslide.engine.parallel.ranks import parse_devices
from megaslide.engine.sources import resolve_source
from megaslide.engine.streaming.host_store import SafetensorsFile
from megaslide.engine.training.finetune import open_trainer
from megaslide.engine.training.finetune_spec import (
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
)


def exported(path: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(path.rglob("*.safetensors")):
        f = SafetensorsFile(file)
        found |= {f"{file.name}:{k}": f[k].clone() for k in f}
    return found


def step_times(output: Path) -> list[float]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step_time_s"] for line in lines]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--devices", default="cpu,cpu")
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--size", type=int, default=32, help="width and height in pixels")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--threads", type=int, help="CPU threads of the single process (default: every core)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    devices = parse_devices(args.devices)
    cpu = devices[0] == "cpu"
    cores = os.cpu_count() or 1
    source = resolve_source(preset=args.preset)
    with tempfile.TemporaryDirectory(prefix="megaslide-dp-") as tmp:
        root = Path(tmp)
        data = write_dataset(
            root / "data", 16, seed=0, frames=args.frames, height=args.size, width=args.size
        )
        spec = FinetuneSpec(
            run=RunSpec(output=str(root / "one"), save_every=10**6),
            schedule=ScheduleSpec(steps=args.steps),
            optimizer=OptimizerSpec(lr=1e-4),
            clips=ClipSpec(
                frames=args.frames, height=args.size, width=args.size, batch_size=args.batch_size
            ),
            runtime=RuntimeSpec(device=devices[0], offload="stream"),
        )

        threads_one = args.threads or cores
        if cpu:
            torch.set_num_threads(threads_one)
        start = time.perf_counter()
        with open_trainer(source, data, spec) as t:
            initial = exported(t.export(root / "initial"))
            t.run()
            one = exported(t.export())
        one_s = time.perf_counter() - start
        one_steps = step_times(root / "one")

        split_spec = spec.replace(run={"output": str(root / "split")}, runtime={"devices": devices})
        start = time.perf_counter()
        finetune_on_devices(source, data, split_spec, export=True, timeout_s=3600)
        split_s = time.perf_counter() - start
        split = exported(root / "split" / "model")
        split_steps = step_times(root / "split")

    moved = sum((one[k] - initial[k]).double().square().sum() for k in one).sqrt()
    diff = sum((split[k] - one[k]).double().square().sum() for k in one).sqrt()
    result = {
        "preset": args.preset,
        "devices": devices,
        "cores": cores,
        "load_average": os.getloadavg()[0],
        "frames": args.frames,
        "size": args.size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "threads_one": threads_one if cpu else None,
        "threads_per_rank": max(1, cores // len(devices)) if cpu else None,
        "off_by": (diff / moved).item(),
        "step_s_one": statistics.median(one_steps[1:] or one_steps),
        "step_s_split": statistics.median(split_steps[1:] or split_steps),
        "wall_s_one": one_s,
        "wall_s_split_with_startup": split_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>26}: {v}")
    return 0 if result["off_by"] <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
