"""Compiled blocks (`--compile`): seconds per denoising step, eager against compiled, on the CPU.

    python benchmarks/compile.py --json                    # small and megaslide-tiny
    python benchmarks/compile.py --quick --json            # the tiny preset, a few steps (CI)

For each preset, resident and streamed: an eager pipeline and one with its blocks compiled
(`open_pipeline(compile=True)`, inductor on the CPU) sample the preset's default request side by
side, a step of one then a step of the other, so that other work on the machine slows both
alike. The first compiled step pays the compile: `compile_s` is its time less a compiled step's
(Dynamo's caches are reset before each compiled pipeline; inductor's cache on disk, which a
later run on the same machine finds, is not). `eager_s` and `compiled_s` are medians of the steps
after `--warmup`; `speedup` is their ratio. `--batches` also counts the graphs compiled as
requests join and leave a batch (passes of 2, 4, 3 and 2 rows) with static shapes and with
Dynamo's automatic dynamic shapes, on the first preset.

Goal: `--compile` >= 1.2x on the small preset, on the CPU. The GPU effect is unmeasured.
The load average at the start and the end is in the JSON: on a shared machine the figures move.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from megaslide.engine.compiled_blocks import compile_blocks  # noqa: E402
from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.engine.sources import resolve_source  # noqa: E402

from tiny_wan import add_threads_arg  # noqa: E402


def open_preset(preset: str, offload: str, compile_: bool):
    if compile_:
        torch._dynamo.reset()  # compile_s is a cold Dynamo's (see the module docstring)
    return open_pipeline(resolve_source(preset=preset), offload=offload, compile=compile_)


def open_inductor_only(preset: str, offload: str):
    """A pipeline whose blocks compile without `cpu_linears` (their linears stay `F.linear`)."""
    torch._dynamo.reset()
    pipe = open_preset(preset, offload, False)
    pipe.compiled = {"dit": compile_blocks(pipe.dit.blocks, cpu_linears=False)}
    return pipe


def side_by_side(preset: str, offload: str, steps: int, warmup: int, ablate: bool) -> dict:
    """Steps of an eager and a compiled pipeline (and with `ablate` one compiled without oneDNN
    linears), interleaved: wall and CPU seconds of each step of each."""
    pipes = {"eager": open_preset(preset, offload, False)}
    pipes["compiled"] = open_preset(preset, offload, True)
    if ablate:
        pipes["inductor_only"] = open_inductor_only(preset, offload)
    request = VideoRequest("a red circle moving left", seed=0, steps=steps + warmup + 1)
    states = {k: p.prepare(p.resolve(request)) for k, p in pipes.items()}
    times: dict[str, list[float]] = {k: [] for k in pipes}
    cpu: dict[str, list[float]] = {k: [] for k in pipes}
    for _ in range(steps + warmup + 1):
        for key, pipe in pipes.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            pipe.denoise_step([states[key]])
            times[key].append(time.perf_counter() - start)
            cpu[key].append(time.process_time() - start_cpu)
    wall = {k: statistics.median(t[1 + warmup :]) for k, t in times.items()}
    work = {k: statistics.median(t[1 + warmup :]) for k, t in cpu.items()}
    video = pipes["eager"].resolve(request)
    row = {
        "preset": preset,
        "offload": offload,
        "shape": {"frames": video.frames, "height": video.height, "width": video.width},
        "rows": 2 if video.guidance != 1 else 1,
        "eager_s": round(wall["eager"], 5),
        "compiled_s": round(wall["compiled"], 5),
        "speedup": round(wall["eager"] / wall["compiled"], 3),
        # CPU seconds of the process (every thread), which other work on the machine moves less
        # than wall seconds: the work a step does.
        "eager_cpu_s": round(work["eager"], 5),
        "compiled_cpu_s": round(work["compiled"], 5),
        "cpu_speedup": round(work["eager"] / work["compiled"], 3),
        "compile_s": round(times["compiled"][0] - wall["compiled"], 2),
        "first_eager_step_s": round(times["eager"][0], 4),
        "compile_stats": pipes["compiled"].compile_stats(),
        # Every timed step, to judge the spread on a shared machine.
        "eager_steps_s": [round(t, 4) for t in times["eager"][1 + warmup :]],
        "compiled_steps_s": [round(t, 4) for t in times["compiled"][1 + warmup :]],
        "eager_steps_cpu_s": [round(t, 4) for t in cpu["eager"][1 + warmup :]],
        "compiled_steps_cpu_s": [round(t, 4) for t in cpu["compiled"][1 + warmup :]],
    }
    if ablate:
        row["inductor_only"] = {
            "compiled_s": round(wall["inductor_only"], 5),
            "speedup": round(wall["eager"] / wall["inductor_only"], 3),
            "compiled_cpu_s": round(work["inductor_only"], 5),
            "cpu_speedup": round(work["eager"] / work["inductor_only"], 3),
            "steps_s": [round(t, 4) for t in times["inductor_only"][1 + warmup :]],
            "steps_cpu_s": [round(t, 4) for t in cpu["inductor_only"][1 + warmup :]],
        }
    return row


def batch_graphs(preset: str) -> dict:
    """Graphs compiled as requests join and leave (passes of 2, 4, 3 and 2 rows), static shapes
    against Dynamo's automatic dynamic shapes, and the seconds those four steps took."""
    out = {}
    for name, dynamic in (("static", False), ("automatic_dynamic", None)):
        torch._dynamo.reset()
        pipe = open_pipeline(resolve_source(preset=preset))
        blocks = compile_blocks(pipe.dit.blocks, dynamic=dynamic)
        requests = [
            VideoRequest("a red circle", seed=1),
            VideoRequest("a blue square", seed=2),
            VideoRequest("a green line", seed=3, guidance=1.0),  # one row
        ]
        states = [pipe.prepare(pipe.resolve(r)) for r in requests]
        start = time.perf_counter()
        for batch in ([0], [0, 1], [0, 2], [1]):
            pipe.denoise_step([states[i] for i in batch])
        out[name] = {**blocks.stats(), "seconds": round(time.perf_counter() - start, 2)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["small", "megaslide-tiny"])
    ap.add_argument("--offloads", nargs="+", default=["none", "stream"])
    ap.add_argument("--steps", type=int, default=7, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1, help="steps after the compile, untimed")
    ap.add_argument("--batches", action="store_true", help="count recompiles as batches change")
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="also a compiled pipeline without oneDNN linears (inductor alone)",
    )
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 3 steps (CI)")
    ap.add_argument("--json", action="store_true")
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.presets, args.steps = ["tiny"], 3
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    rows = [
        side_by_side(preset, offload, args.steps, args.warmup, args.ablate)
        for preset in args.presets
        for offload in args.offloads
    ]
    result = {
        "rows": rows,
        "batches": batch_graphs(args.presets[0]) if args.batches else None,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "torch": torch.__version__,
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r in rows:
            print(
                f"{r['preset']:>15} {r['offload']:>6}: eager {r['eager_s']:.4f} s/step, "
                f"compiled {r['compiled_s']:.4f} s/step ({r['speedup']:.2f}x; CPU seconds "
                f"{r['cpu_speedup']:.2f}x), compile {r['compile_s']:.1f} s"
            )
        if result["batches"]:
            print(json.dumps(result["batches"]))
        print(f"load average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
