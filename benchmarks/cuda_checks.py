"""Correctness and bandwidth checks that need a CUDA device (run by benchmarks/gpu_check.sh).

    python benchmarks/cuda_checks.py --json          # exits non-zero when a check fails

- streamed equals resident: the same clip with every block streamed and with none streamed (bf16);
- pinned against pageable host-to-device bandwidth (GB/s) for a block-sized buffer;
- a streamed training step equals a resident one (fp32), and the time of a bf16 streamed step.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch


def streamed_equals_resident(preset: str) -> dict:
    from megaslide.engine.pipeline import GenerationRequest, VideoPipeline
    from megaslide.engine.streaming import stream_module

    request = GenerationRequest(
        "a red circle moving right", frames=8, height=64, width=64, steps=3, seed=1
    )
    pipe = VideoPipeline.from_preset(preset, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # random zero-initialised layers would make both outputs pure noise
        for p in pipe.dit.parameters():
            if not p.any():
                p.normal_(0, 0.02)
    resident = pipe.generate(request)
    handle = stream_module(pipe.dit, blocks=pipe.dit.blocks, device="cuda")
    streamed = pipe.generate(request)
    stats = handle.stats()
    handle.remove()
    diff = abs(resident.astype(int) - streamed.astype(int))
    # Same kernels on the same weights: identical, or at most one uint8 level where bf16 reductions
    # were scheduled differently.
    return {
        "preset": preset,
        "max_uint8_diff": int(diff.max()),
        "ok": int(diff.max()) <= 1,
        "h2d_bytes": stats["h2d_bytes"],
    }


def h2d_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    from megaslide.engine.host_store import _pin_exact, _unpin

    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8)
    _pin_exact(pinned)
    out = {}
    for name, src in (("pageable", pageable), ("pinned", pinned)):
        device.copy_(src, non_blocking=True)
        torch.cuda.synchronize()  # timing needs the copies finished
        start = time.perf_counter()
        for _ in range(repeats):
            device.copy_(src, non_blocking=True)
        torch.cuda.synchronize()  # the clock stops when the last copy has landed, not when it was queued
        out[f"{name}_gbps"] = nbytes * repeats / (time.perf_counter() - start) / 1e9
    _unpin(pinned.data_ptr(), nbytes)
    out["ok"] = out["pinned_gbps"] > out["pageable_gbps"]
    return out


def training_step(preset: str) -> dict:
    from megaslide.engine.blockwise import BlockwiseStep, StepConfig, master_state_dicts
    from megaslide.engine.dit import VideoDiT, get_preset
    from megaslide.engine.text import BuiltinTextEncoder

    torch.manual_seed(0)
    config = get_preset(preset)
    dit, text = VideoDiT(config), BuiltinTextEncoder(config.text)
    x0 = torch.randn(2, 3, 8, 64, 64)
    prompts = ["a red circle moving left", "a blue square"]
    results = {}
    for offload in ("none", "stream"):
        step = BlockwiseStep(
            copy.deepcopy(dit), copy.deepcopy(text), "cuda", StepConfig(lr=1e-4, offload=offload)
        )
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            step.micro_step(x0, prompts, g)
        results[offload] = master_state_dicts(step)[0]
        step.close()
    worst = max(
        (
            (results["stream"][k] - results["none"][k]).norm()
            / results["none"][k].norm().clamp_min(1e-30)
        ).item()
        for k in results["none"]
    )
    timed = BlockwiseStep(
        copy.deepcopy(dit),
        copy.deepcopy(text),
        "cuda",
        StepConfig(lr=1e-4, offload="stream", autocast=torch.bfloat16, timing=True),
    )
    g = torch.Generator().manual_seed(0)
    timed.micro_step(x0, prompts, g)
    seconds = [timed.micro_step(x0, prompts, g)["step_time_s"] for _ in range(3)]
    stats = timed.handle.stats()
    timed.close()
    return {
        "preset": preset,
        "max_relative_difference_stream_vs_resident": worst,
        "ok": worst <= 1e-5,
        "bf16_streamed_step_s": sorted(seconds)[1],
        "h2d_gbps": stats.get("h2d_gbps"),
        "copy_hidden_fraction": stats.get("copy_hidden_fraction"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_checks: no CUDA device", file=sys.stderr)
        return 2
    report = {
        "device": torch.cuda.get_device_name(),
        "streamed_equals_resident": streamed_equals_resident(args.preset),
        "h2d_bandwidth": h2d_bandwidth(),
        "training_step": training_step(args.preset),
    }
    ok = all(v["ok"] for v in report.values() if isinstance(v, dict))
    report["ok"] = ok
    print(json.dumps(report, indent=2) if args.json else report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
