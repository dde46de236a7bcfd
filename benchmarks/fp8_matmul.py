"""fp8 matmuls against dequantizing fp8: frames (PSNR), bytes moved per step, CPU seconds.

`--weights fp8` keeps each streamed linear weight as float8_e4m3fn bytes and row scales and
dequantizes it into the device slot before the block runs; `fp8_matmul=True` leaves it in the
payload and multiplies by it with `torch._scaled_mm`, quantizing the activations per token
(engine/streaming/fp8_matmul.py). Per model (the packaged default model, and a tiny Wan:
random weights, or `--wan DIR` for a pipeline directory such as benchmarks/tiny_wan.py's
trained one) this samples the same requests resident in bf16, streamed in fp8, and streamed in
fp8 with the lever, and reports each fp8 run's PSNR against bf16 and the lever's against plain
fp8; the bytes one denoising step copies to the device (`h2d`) and writes into the slots by
decoding (`slot_decode`), from the streamer's counters; and seconds per request. A matmul of a
Wan2.1-14B FFN's shape compares `_scaled_mm` with the bf16 matmul on this CPU.

Caution: the speed goal is a GPU one (fp8 tensor cores, and no dequantize pass over the slot);
on the CPU `_scaled_mm` is a reference path, and the timings on a shared machine are noisy.

    python benchmarks/fp8_matmul.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' tiny Wan builder

from compression import psnr  # noqa: E402

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.native.world import benchmark_prompts  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.engine.streaming.fp8_matmul import Fp8Operand, fp8_linear  # noqa: E402
from megaslide.engine.streaming.weight_formats import fp8_quantize  # noqa: E402


def run(where, requests, **placement) -> tuple[list[np.ndarray], dict, float]:
    """Frames of every request, the streamer's counters per step, and seconds per request."""
    pipe = open_pipeline(where, dtype="bfloat16", **placement)
    start = time.perf_counter()
    frames = [pipe.generate(r) for r in requests]
    seconds = (time.perf_counter() - start) / len(requests)
    steps = sum(r.steps for r in requests)
    counters = {}
    if placement.get("offload") == "stream":
        for name, s in pipe.stats().items():
            counters[name] = {
                "fp8_matmul": s.get("fp8_matmul", "off"),
                "fp8_matmul_linears": s.get("fp8_matmul_linears", 0),
                "h2d_bytes_per_step": s["h2d_bytes"] / steps,
                # Every streamed block decodes once per pass here (all blocks streamed).
                "slot_decode_bytes_per_step": s["slot_decode_bytes_per_pass"]
                * s["forwards"]
                / steps,
                "forwards_per_step": s["forwards"] / steps,
            }
    pipe.close()
    return frames, counters, seconds


def compare(where, requests) -> dict:
    ref, _, bf16_s = run(where, requests)
    fp8, fp8_counters, fp8_s = run(where, requests, offload="stream", weights="fp8")
    mm, mm_counters, mm_s = run(where, requests, offload="stream", weights="fp8", fp8_matmul=True)

    def db(a, b):
        values = [psnr(x, y) for x, y in zip(a, b)]
        return {"mean": float(np.mean(values)), "min": float(min(values))}

    finite = all(np.isfinite(f.astype(np.float64)).all() for f in mm)
    return {
        "psnr_db": {
            "fp8 vs bf16": db(fp8, ref),
            "fp8_matmul vs bf16": db(mm, ref),
            "fp8_matmul vs fp8": db(mm, fp8),
        },
        "fp8_matmul_frames_finite": bool(finite),
        "bytes": {"fp8": fp8_counters, "fp8_matmul": mm_counters},
        "seconds_per_request": {"bf16 resident": bf16_s, "fp8": fp8_s, "fp8_matmul": mm_s},
    }


def matmul_timing(m: int, k: int, n: int, repeat: int) -> dict:
    """One linear of `(m, k) x (k, n)`: bf16 `F.linear` against `fp8_linear` (activation
    quantization included), best of `repeat`."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k) * 0.02
    q, exponent = fp8_quantize(w)
    op = Fp8Operand(q, torch.exp2(exponent.float()))
    wb = w.to(torch.bfloat16)

    def best(fn):
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    bf16 = best(lambda: torch.nn.functional.linear(x, wb))
    fp8 = best(lambda: fp8_linear(x, op))
    return {"shape_mkn": [m, k, n], "bf16_s": bf16, "fp8_scaled_mm_s": fp8, "ratio": fp8 / bf16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--wan", help="a Wan pipeline directory (default: a random tiny Wan)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [p for p, *_rest in benchmark_prompts(args.prompts)]
    requests = [VideoRequest(p, steps=args.steps, seed=i) for i, p in enumerate(prompts)]
    out = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "torch": torch.__version__}
    out["default model"] = compare(None, requests)
    from wan_fixtures import build_tiny_wan
    from wan_fixtures import request as wan_request

    with tempfile.TemporaryDirectory() as tmp:
        where = args.wan
        if where is None:
            where = str(build_tiny_wan(Path(tmp) / "wan", layers=4))
        wan_requests = [
            wan_request(32, prompt=p, seed=i, steps=args.steps) for i, p in enumerate(prompts)
        ]
        out["tiny wan" + (" (random)" if args.wan is None else "")] = compare(where, wan_requests)
    # A 480p Wan2.1-14B step's FFN up-projection is (32760 tokens, 5120) x (5120, 13824): a
    # slice of its tokens, enough to compare the two paths' throughput on this CPU.
    out["matmul_cpu"] = matmul_timing(512, 5120, 13824, repeat=3)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for model in ("default model", *[k for k in out if k.startswith("tiny wan")]):
            for label, v in out[model]["psnr_db"].items():
                print(f"{model:22s} {label:20s} {v['mean']:6.1f} dB (min {v['min']:5.1f})")
        print(out["matmul_cpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
