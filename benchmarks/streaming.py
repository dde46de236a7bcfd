"""Resident against streamed denoising steps: what does streaming block weights cost?

    python benchmarks/streaming.py --json                  # small preset on this machine's CPU
    python benchmarks/streaming.py --quick --json          # tiny preset, seconds (CI-sized)
    python benchmarks/streaming.py --device cuda --json    # adds H2D GB/s and overlap figures

On the CPU, "streaming" copies each block from its host store into a slot buffer with memcpy, the
same code path as on a GPU, so the ratio measures the streamer's own overhead. On CUDA the model is
also run with a deliberately small `--gpu-budget` and the report adds the achieved host-to-device
bandwidth, the fraction of copy time hidden under compute, and step time / max(compute, transfer).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import ResolvedVideo, VideoRequest
from megaslide.engine.sampling.pipeline import Pipeline
from megaslide.engine.sources import describe, resolve_source


def sync(device: str) -> None:
    if device == "cuda":
        # Timing needs the queued kernels finished; without it we would time the launch only.
        torch.cuda.synchronize()


def time_steps(pipe: Pipeline, request: ResolvedVideo, device: str) -> list[float]:
    """Seconds of each denoising step after the first (a warm-up); the CFG pair runs in one batch."""
    state = pipe.prepare(request)
    pipe.denoise_step([state])
    sync(device)
    times = []
    while not state.done:
        start = time.perf_counter()
        pipe.denoise_step([state])
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--quick", action="store_true", help="tiny preset and sizes, for CI")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--size", default="32x32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.repeats = "tiny", 3
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    width, height = (int(v) for v in args.size.split("x"))
    info = describe(resolve_source(preset=args.preset))
    request = VideoRequest(
        "a red circle moving right",
        frames=args.frames,
        height=height,
        width=width,
        steps=args.repeats + 1,
        seed=0,
    )
    pipe = open_pipeline(info, device=args.device, dtype=dtype)
    video = pipe.resolve(request)
    resident = time_steps(pipe, video, args.device)
    del pipe  # one copy of the weights at a time
    pipe = open_pipeline(
        info, device=args.device, dtype=dtype, offload="stream", timing=args.device == "cuda"
    )
    streamed = time_steps(pipe, video, args.device)
    handle = pipe.handles["dit"]
    stats = handle.stats()
    result = {
        "preset": args.preset,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": math.prod(info.config.token_grid(args.frames, height, width)),
        "rows_per_step": 2,
        "steps_timed": args.repeats,
        "resident_s": statistics.median(resident),
        "streamed_s": statistics.median(streamed),
        "h2d_bytes_per_step": stats["h2d_bytes"] / (args.repeats + 1),
        "streamed_block_bytes": stats["streamed_block_bytes"],
        "peak_device_weight_bytes": stats["peak_device_weight_bytes"],
    }
    result["ratio"] = result["streamed_s"] / result["resident_s"]
    if args.device == "cuda":
        compute, copy = stats["compute_s_total"], stats["copy_s_total"]
        result.update(
            h2d_gbps=stats["h2d_gbps"],
            copy_hidden_fraction=stats["copy_hidden_fraction"],
            # Per step: the slower of compute and transfer bounds the step; 1.0 is perfect overlap.
            step_over_bound=result["streamed_s"] / (max(compute, copy) / (args.repeats + 1)),
        )
    pipe.close()
    print(
        json.dumps(result, indent=2)
        if args.json
        else f"{args.preset} on {args.device}: resident {result['resident_s']:.4f} s/step, streamed "
        f"{result['streamed_s']:.4f} s/step, ratio {result['ratio']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
