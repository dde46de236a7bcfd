"""Weight formats on the device: decode throughput and the streamed step time per format.

    python benchmarks/weight_formats_device.py --device cuda --json   # (benchmarks/gpu_check.sh)
    python benchmarks/weight_formats_device.py --quick --json         # the same code paths on CPU

Decode: one buffer of bf16 weights (`--decode-mb`, Gaussian with trained-like spread) coded
lossless on the CPU, its payload put on the device, then the decode (the Triton kernel on CUDA,
the reference on the CPU) timed over `--repeats` runs, in GB/s of decoded output; checked
bitwise against the original. fp8's dequantize is timed the same way, the per-weight PyTorch ops
and, where Triton runs (CUDA), the one-launch kernel the slot decode uses (kernels/fp8_decode.py),
checked bitwise against them. Goal on an H200: the
lossless decode >= 200 GB/s, so decoding a block takes under a third of copying it at 55 GB/s.

Step time: the `--preset` model (bf16 on CUDA) streamed with every block in host RAM, median
seconds per denoising step after a warm-up, per weight format, with the bytes each step moved,
the decode time the streamer measured and whether the frames equal the raw run's bitwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import VideoRequest
from megaslide.engine.sources import resolve_source
from megaslide.engine.streaming.weight_formats import fp8_dequantize, fp8_quantize
from megaslide.kernels.dfloat import dfloat_decode
from megaslide.kernels.dfloat_reference import dfloat_encode
from megaslide.kernels.fp8_decode import fp8_decode_available, fp8_rows_decode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        # Timing needs the queued kernels finished; without it we would time the launch only.
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Best seconds of `repeats` calls after one warm-up (the first call compiles the kernel)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def decode_throughput(device: torch.device, megabytes: int, repeats: int) -> dict:
    words = megabytes * (1 << 20) // 2
    x = (torch.randn(words, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    start = time.perf_counter()
    coded = dfloat_encode(x)
    encode_s = time.perf_counter() - start
    parts = [p.to(device) for p in coded.parts()]
    out = torch.empty(words, dtype=torch.int16, device=device)
    seconds = timed(lambda: dfloat_decode(*parts, out), device, repeats)
    exact = bool(torch.equal(out.cpu(), x.view(torch.int16)))
    rows = x.view(-1, 1024)
    q, scale = fp8_quantize(rows)
    q, scale = q.to(device), scale.to(device)
    fp8_s = timed(lambda: fp8_dequantize(q, scale, torch.bfloat16), device, repeats)
    fused = {}
    if fp8_decode_available(device):
        slot = torch.empty(2 * words, dtype=torch.uint8, device=device)
        # One payload, as a store's staging holds it: the weight's bytes, then its exponents.
        payload = torch.cat([q.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])
        weights = [(payload[: q.numel()].view(q.shape), payload[q.numel() :].view(torch.int8), 0)]
        fused_s = timed(lambda: fp8_rows_decode(weights, slot, torch.bfloat16), device, repeats)
        same = torch.equal(
            slot.view(torch.bfloat16).view(q.shape), fp8_dequantize(q, scale, torch.bfloat16)
        )
        fused = {
            "fp8_fused_decode_gbps": 2 * words / fused_s / 1e9,
            "fp8_fused_bitwise": bool(same),
        }
    return {
        "decoded_bytes": 2 * words,
        "payload_bytes": coded.nbytes,
        "lossless_decode_gbps": 2 * words / seconds / 1e9,
        "lossless_decode_bitwise": exact,
        "lossless_encode_cpu_gbps": 2 * words / encode_s / 1e9,
        "fp8_dequantize_gbps": 2 * words / fp8_s / 1e9,
        **fused,
    }


def step_times(device: torch.device, preset: str, frames: int, size: str, repeats: int) -> dict:
    width, height = (int(v) for v in size.split("x"))
    request = VideoRequest(
        "a red circle moving left",
        frames=frames,
        width=width,
        height=height,
        steps=repeats + 1,
        seed=0,
    )
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    out, reference = {}, None
    for weights in ("raw", "lossless", "fp8"):
        pipe = open_pipeline(
            resolve_source(preset=preset),
            device=device,
            dtype=dtype,
            offload="stream",
            weights=weights,
            timing=True,
        )
        video = pipe.resolve(request)
        state = pipe.prepare(video)
        pipe.denoise_step([state])  # warm-up: kernels compile, slots fill
        sync(device)
        for handle in pipe.handles.values():
            handle.reset_stats()
        times = []
        while not state.done:
            start = time.perf_counter()
            pipe.denoise_step([state])
            sync(device)
            times.append(time.perf_counter() - start)
        frames_out = pipe.finish(state)
        stats = pipe.stats()["dit"]
        if weights == "raw":
            reference = frames_out
        out[weights] = {
            "step_s": statistics.median(times),
            "h2d_bytes_per_step": stats["h2d_bytes"] // len(times),
            "host_store_bytes": stats["host_store_bytes"],
            "decode_s_per_step": stats["decode_s_total"] / len(times),
            "copy_hidden_fraction": stats["copy_hidden_fraction"],
            "frames_equal_raw": bool(np.array_equal(frames_out, reference)),
        }
        pipe.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI, CPU)")
    ap.add_argument("--decode-mb", type=int, default=256, help="MB of bf16 weights to decode")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--size", default="128x128")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_mb, args.preset, args.frames, args.size, args.repeats = 1, "tiny", 4, "32x32", 2
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "decode": decode_throughput(device, args.decode_mb, args.repeats),
        "preset": args.preset,
        "clip": f"{args.frames} frames of {args.size}",
        "step": step_times(device, args.preset, args.frames, args.size, args.repeats),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        d = result["decode"]
        print(
            f"lossless decode {d['lossless_decode_gbps']:.1f} GB/s (bitwise: "
            f"{d['lossless_decode_bitwise']}), fp8 dequantize {d['fp8_dequantize_gbps']:.1f} GB/s"
        )
        if "fp8_fused_bitwise" in d:
            print(
                f"fp8 one-launch decode {d['fp8_fused_decode_gbps']:.1f} GB/s (bitwise: "
                f"{d['fp8_fused_bitwise']})"
            )
        for w, s in result["step"].items():
            print(f"{w:>9}: {s['step_s']:.4f} s/step, {s['h2d_bytes_per_step']:,} B/step")
    # A decode that is not bitwise its reference is a failed check, whatever its speed.
    d = result["decode"]
    return 0 if d["lossless_decode_bitwise"] and d.get("fp8_fused_bitwise", True) else 1


if __name__ == "__main__":
    sys.exit(main())
