"""One denoising step of a preset, streamed, timed against what the planner predicts for it.

    python benchmarks/preset_step.py --json                 # megaslide-105b, fp8, 3D-DSA, 480p, CUDA
    python benchmarks/preset_step.py --tiny --json          # the tiny preset on the CPU

The seed's headline: the `megaslide-105b` preset (about 105B parameters) with its blocks streamed
from host RAM in `--weights fp8` (about 105 GB of host store: it fits a 128 GB machine), 3D-DSA
self-attention, one 480x832, 81-frame clip with guidance (a CFG pair of rows). The preset's
weights are random, drawn by the loader as for any preset (their values do not change the time a
step takes); opening it is timed apart (`open_s`: drawing, encoding to fp8, pinning).

Two steps run: the first pays the kernels' autotuning and the allocator's growth, the second is
the figure (`step_s`). `planned` is `planner.plan` for the same model, placement and clip on a
`Machine` with this device's memory and the planner's other defaults (an H200's measured link and
compute figures): its `time_s.step`, the bound it names, and `step_over_planned`, measured over
predicted. Caution: the planner's compute figure is an H200's; on another card the ratio measures
the card as much as the planner.

With `--out` the JSON is rewritten after the opening and each step, so a run stopped from outside
keeps what it measured (the plan, at least, and how long the opening took).

`--tiny` runs the same code on the CPU with the tiny preset (its default frames, 48x48), in seconds, so the
script is tested without a GPU; its times say nothing about the planner's GPU figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def sync(device: str) -> None:
    if device == "cuda":
        # Timing needs the queued kernels finished; without it we would time the launches only.
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="megaslide-105b")
    ap.add_argument("--tiny", "--dry-run", action="store_true", help="the tiny preset, CPU")
    ap.add_argument("--device", help="default: cuda, or cpu with --tiny")
    ap.add_argument("--weights", default="fp8", help="streamed blocks' host format")
    ap.add_argument("--attention", default="dsa", help="self-attention backend")
    ap.add_argument("--frames", type=int, help="pixel frames (default 81; --tiny: the preset's)")
    ap.add_argument("--size", help="HxW in pixels (default 480x832; --tiny: 48x48)")
    ap.add_argument("--out", type=Path, help="the JSON, rewritten after each phase")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("preset_step: no CUDA device (use --tiny for the CPU form)", file=sys.stderr)
        return 2
    if args.tiny:
        torch.set_num_threads(1)
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.placement import Placement
    from megaslide.engine.planner import Machine, Workload, plan
    from megaslide.engine.request import VideoRequest
    from megaslide.engine.sources import describe, resolve_source

    preset = "tiny" if args.tiny else args.preset
    frames = args.frames or (None if args.tiny else 81)
    # The tiny preset's own 32x32 is too small for 3D-DSA's window: 48x48 is 12 tokens a side.
    size = args.size or ("48x48" if args.tiny else "480x832")
    height, width = (int(v) for v in size.split("x")) if size else (None, None)
    info = describe(resolve_source(preset=preset), attention=args.attention)
    placement = Placement(device=device, offload="stream", weights=args.weights)
    machine = Machine()
    if device == "cuda":
        machine = Machine(gpu_mem=torch.cuda.get_device_properties(0).total_memory)
    workload = Workload.of(placement, frames=frames, height=height, width=width)
    planned = plan(info, machine, workload)

    result = {
        "preset": preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "weights": args.weights,
        "attention": args.attention,
        "clip": {"frames": frames, "height": height, "width": width, "guidance": True},
        "parameters": planned["parameters"],
        "tokens": planned["tokens"],
        "planned": {
            "machine": vars(machine),
            "time_s": planned["time_s"],
            "h2d_bytes_per_step": planned["bytes_per_step"]["h2d"],
            "host_total_bytes": planned["host"]["total"],
            "device_total_bytes": planned["device"]["total"],
        },
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=2, default=str))

    save()
    start = time.perf_counter()
    pipe = open_pipeline(info, placement)
    sync(device)
    result["open_s"] = time.perf_counter() - start
    save()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    request = VideoRequest(
        prompt="a red circle moving left",
        frames=frames,
        height=height,
        width=width,
        steps=2,
        seed=0,
    )
    state = pipe.prepare(pipe.resolve(request))
    step_s, h2d = [], []
    for _ in range(2):
        t = time.perf_counter()
        counters = pipe.denoise_step([state])
        sync(device)
        step_s.append(time.perf_counter() - t)
        h2d.append(counters.get("h2d_bytes", 0))
        result["first_step_s"] = step_s[0]
        save()
    result["step_s"] = step_s[1]
    result["h2d_bytes_per_step"] = h2d[1]
    result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    result["step_over_planned"] = step_s[1] / planned["time_s"]["step"]
    result["h2d_over_planned"] = h2d[1] / planned["bytes_per_step"]["h2d"]
    save()
    pipe.close()
    print(json.dumps(result, indent=2, default=str) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
