"""Host RAM against the disk tier: what does reading streamed blocks from disk each step cost?

    python benchmarks/disk_streaming.py --json              # the small preset, saved to a temp dir
    python benchmarks/disk_streaming.py --quick --json      # a 32-block width-256 model, seconds
    python benchmarks/disk_streaming.py --model DIR --json  # a model directory as it is

Reports seconds per denoising step with the blocks in RAM (`host_tier="ram"`) and on disk
(`host_tier="disk"`), the latter with a warm page cache (the file read just before) and a cold
one (the model files dropped from the cache with posix_fadvise(DONTNEED) before every step, so
the step reads them from the drive), for buffered and O_DIRECT reads; and the reader's raw read
bandwidth over every block, cold and warm (GB/s of block bytes). The planner's `--disk-gbps` is
the cold figure.

Caution: DONTNEED drops only clean pages no other process has mapped, and a drive's own cache is
not dropped: a "cold" figure may be warmer than a reboot's. The ring reads the first blocks of
the next step while the current step ends, before the next drop: those few come from the cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.checkpoint import save_model
from megaslide.engine.native.config import DiTConfig
from megaslide.engine.request import VideoRequest, parse_size, resolve
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.streaming.disk_store import DiskBlockStore, direct_io_supported


def drop_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped; a freshly saved model has some
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path]) -> None:
    """Read these files once through the page cache, so that the next reads find them there."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def build_model(root: Path, quick: bool) -> Path:
    """A model directory: the small preset (or, quick, 32 blocks of width 256), saved in fp32."""
    if quick:
        from megaslide.engine.native.dit import VideoDiT

        tiny = open_pipeline(resolve_source(preset="tiny"))
        torch.manual_seed(0)
        dit = VideoDiT(DiTConfig(dim=256, depth=32, heads=4, ffn_dim=1024))
        return save_model(root / "model", dit, tiny.text_encoder, tiny.info.sampling)
    pipe = open_pipeline(resolve_source(preset="small"))
    return save_model(root / "model", pipe.dit, pipe.text_encoder, pipe.info.sampling)


def time_steps_round_robin(pipes: dict, video, before: dict) -> dict[str, list[float]]:
    """Seconds of each denoising step after the first (a warm-up) of every pipeline, taking
    turns step by step so that a shared machine's changing load falls on all of them alike;
    `before[name]` runs untimed before each of that pipeline's timed steps."""
    states = {name: pipe.prepare(video) for name, pipe in pipes.items()}
    for name, pipe in pipes.items():
        pipe.denoise_step([states[name]])
    times: dict[str, list[float]] = {name: [] for name in pipes}
    while not all(s.done for s in states.values()):
        for name, pipe in pipes.items():
            if states[name].done:
                continue
            if name in before:
                before[name]()
            start = time.perf_counter()
            pipe.denoise_step([states[name]])
            times[name].append(time.perf_counter() - start)
    return times


def read_bandwidth(pipe, files: list[Path], direct: bool, cold: bool, repeats: int) -> float:
    """GB/s of the reader over every streamed block (median of `repeats` passes)."""
    stores = [
        b.store
        for h in pipe.handles.values()
        for b in h._blocks
        if isinstance(b.store, DiskBlockStore)
    ]
    out = torch.empty(max(s.nbytes for s in stores), dtype=torch.uint8)
    nbytes = sum(s.nbytes for s in stores)
    rates = []
    for _ in range(repeats):
        if cold:
            drop_cache(files)
        start = time.perf_counter()
        for s in stores:
            s.read_into(out, direct)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: build one in a temp dir)")
    ap.add_argument("--quick", action="store_true", help="a small built model and clip, for CI")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--size", default="32x32")
    ap.add_argument("--steps", type=int, default=6, help="denoising steps (the first is warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="raw read passes per figure")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=os.environ.get("MEGASLIDE_BENCH_DIR")) as tmp:
        model = Path(args.model) if args.model else build_model(Path(tmp), args.quick)
        files = sorted(model.glob("*.safetensors"))
        info = describe(resolve_source(str(model)))
        width, height = parse_size(args.size, "--size")
        request = VideoRequest(
            "a red ball", seed=0, steps=args.steps, frames=args.frames, width=width, height=height
        )
        video = resolve(request, info.limits, model=info.name)
        direct_ok = all(direct_io_supported(str(f)) for f in files)

        pipes = {"ram": open_pipeline(model, offload="stream", host_tier="ram")}
        stats = pipes["ram"].stats()["dit"]
        ios = ["buffered", "direct"] if direct_ok else ["buffered"]
        # O_DIRECT bypasses the page cache: only its cold figure means anything.
        for io, cache in [("buffered", "warm"), ("buffered", "cold")] + [
            ("direct", "cold") for _ in ios[1:]
        ]:
            pipes[f"disk_{io}_{cache}"] = open_pipeline(
                model, offload="stream", host_tier="disk", disk_io=io
            )
        ring_bytes = pipes["disk_buffered_warm"].stats()["dit"]["host_store_bytes"]
        # Cold: the files dropped from the page cache before each step. Warm: read just before.
        before = {
            name: functools.partial(drop_cache if name.endswith("_cold") else warm_cache, files)
            for name in pipes
            if name.startswith("disk_")
        }
        results = time_steps_round_robin(pipes, video, before)
        reads = {}
        disk = pipes["disk_buffered_warm"]
        for io in ios:
            for cache in ("warm", "cold"):
                if io == "buffered" and cache == "warm":
                    warm_cache(files)
                reads[f"{io}_{cache}_gbps"] = read_bandwidth(
                    disk, files, io == "direct", cache == "cold", args.repeats
                )
        for pipe in pipes.values():
            pipe.close()
        del pipes

    step = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "benchmark": "disk_streaming",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "torch": torch.__version__,
        "model": info.name,
        "streamed_blocks": stats["streamed_blocks"],
        "streamed_block_bytes": stats["streamed_block_bytes"],
        "ram_tier_host_store_bytes": stats["host_store_bytes"],
        "disk_tier_ring_bytes": ring_bytes,
        "o_direct_supported": direct_ok,
        "clip": {"frames": args.frames, "size": args.size, "timed_steps": args.steps - 1},
        "seconds_per_step": step,  # medians
        # The fastest step of each: on a shared machine the least disturbed by other work.
        "seconds_per_step_min": {k: min(v) for k, v in results.items()},
        "disk_over_ram": {k: v / step["ram"] for k, v in step.items() if k != "ram"},
        "read_gbps": reads,
        "step_times_s": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in step.items():
            print(f"{k:<22}{v:8.3f} s/step")
        for k, v in reads.items():
            print(f"read {k:<17}{v:8.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
