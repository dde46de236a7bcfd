"""One video on one device against the same video split over several: equal frames, and the time.

    python benchmarks/sequence_parallel.py --json                             # cpu against cpu,cpu
    python benchmarks/sequence_parallel.py --devices cuda:0,cuda:1 --json     # two GPUs

Samples one request with one process (`open_pipeline(offload="stream")` on the first device) and
again with `generate_on_devices` over `--devices`, and reports whether the frames are equal
(bitwise; else the largest uint8 difference) and the wall time of each. The split run's time
includes starting its processes, joining the group and opening the model in every rank, so on a
small model it measures that start-up, not the speed of a step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.parallel.multidevice import generate_on_devices, parse_devices
from megaslide.engine.request import VideoRequest, resolve
from megaslide.engine.sources import describe, resolve_source


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--devices", default="cpu,cpu")
    p.add_argument("--attention", choices=("dense", "dsa"), default="dense")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--size", type=int, default=32, help="width and height in pixels")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    devices = parse_devices(args.devices)
    info = describe(resolve_source(preset=args.preset), attention=args.attention)
    request = VideoRequest(
        prompt="a red circle moving left",
        frames=args.frames,
        width=args.size,
        height=args.size,
        steps=args.steps,
        seed=0,
    )
    video = resolve(request, info.limits, model=info.name)

    start = time.perf_counter()
    pipe = open_pipeline(info, device=devices[0], offload="stream")
    one = pipe.generate(video)
    if devices[0].startswith("cuda"):
        torch.cuda.synchronize()  # the clock stops when the device is done, not when queued
    one_s = time.perf_counter() - start
    pipe.close()

    start = time.perf_counter()
    split = generate_on_devices(info, video, devices, timeout_s=600)
    split_s = time.perf_counter() - start

    result = {
        "preset": args.preset,
        "attention": args.attention,
        "devices": devices,
        "frames": args.frames,
        "size": args.size,
        "steps": args.steps,
        "tokens": int(np.prod(info.config.token_grid(args.frames, args.size, args.size))),
        "bitwise_equal": bool(np.array_equal(one, split)),
        "max_uint8_difference": int(np.abs(one.astype(int) - split.astype(int)).max()),
        "one_device_s": one_s,
        "split_s_with_startup": split_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    return 0 if result["max_uint8_difference"] <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
