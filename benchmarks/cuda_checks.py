"""Correctness and bandwidth checks that need a CUDA device (run by benchmarks/gpu_check.sh).

    python benchmarks/cuda_checks.py --json          # exits non-zero when a check fails

- streamed equals resident: the same clip with every block streamed and with none streamed (bf16);
- pinned against pageable host-to-device bandwidth (GB/s) for a block-sized buffer;
- a streamed training step equals a resident one (fp32), and the time of a bf16 streamed step.

`--device cpu` runs the same code paths without CUDA (no bandwidth check), so the script itself is
tested where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.native.checkpoint import save_model
from megaslide.engine.request import VideoRequest
from megaslide.engine.sources import describe, resolve_source


def random_model(preset: str, path: Path) -> Path:
    """A model directory with the preset's random weights and its zero-initialised layers
    randomised too (a fresh model predicts zero, which would make every comparison trivial)."""
    pipe = open_pipeline(resolve_source(preset=preset))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in pipe.dit.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return save_model(path, pipe.dit, pipe.text_encoder, pipe.info.sampling)


def streamed_equals_resident(model: Path, device: str) -> dict:
    request = VideoRequest(
        "a red circle moving right", frames=8, height=64, width=64, steps=3, seed=1
    )
    clips, stats = {}, {}
    for offload in ("none", "stream"):
        pipe = open_pipeline(model, device=device, offload=offload)
        clips[offload] = pipe.generate(request)
        if pipe.handles:
            stats = pipe.handles["dit"].stats()
        pipe.close()
    diff = abs(clips["none"].astype(int) - clips["stream"].astype(int))
    # Same kernels on the same weights: identical, or at most one uint8 level where bf16 reductions
    # were scheduled differently.
    return {
        "max_uint8_diff": int(diff.max()),
        "ok": int(diff.max()) <= 1,
        "h2d_bytes": stats["h2d_bytes"],
    }


def h2d_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    from megaslide.engine.streaming.host_store import pin_exact, unpin

    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8)
    pin_exact(pinned)
    out = {}
    for name, src in (("pageable", pageable), ("pinned", pinned)):
        device.copy_(src, non_blocking=True)
        torch.cuda.synchronize()  # timing needs the copies finished
        start = time.perf_counter()
        for _ in range(repeats):
            device.copy_(src, non_blocking=True)
        # The clock stops when the last copy has landed, not when it was queued.
        torch.cuda.synchronize()
        out[f"{name}_gbps"] = nbytes * repeats / (time.perf_counter() - start) / 1e9
    unpin(pinned.data_ptr(), nbytes)
    out["ok"] = out["pinned_gbps"] > out["pageable_gbps"]
    return out


def training_step(model: Path, device: str) -> dict:
    from megaslide.engine.native.family import DiTTrainingModel
    from megaslide.engine.training.blockwise import BlockwiseStep, StepConfig, master_state_dicts
    from megaslide.engine.training.finetune_spec import OptimizerSpec

    info = describe(resolve_source(model))
    x0 = torch.randn(2, 3, 8, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle moving left", "a blue square"]

    def blockwise(offload: str, **options) -> BlockwiseStep:
        parts, handles = open_model(
            info,
            device=device,
            dtype=torch.float32,
            offload=offload,
            timing=options.get("timing", False),
        )
        config = StepConfig(optimizer=OptimizerSpec(lr=1e-4), offload=offload, **options)
        model = DiTTrainingModel(parts["dit"].train(), parts["text_encoder"].train())
        return BlockwiseStep(model, device, config, handles.get("dit"))

    results = {}
    for offload in ("none", "stream"):
        step = blockwise(offload)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            step.micro_step(x0, prompts, g)
        results[offload] = master_state_dicts(step)["dit"]
        step.close()
    worst = max(
        (
            (results["stream"][k] - results["none"][k]).norm()
            / results["none"][k].norm().clamp_min(1e-30)
        ).item()
        for k in results["none"]
    )
    autocast = torch.bfloat16 if device == "cuda" else None
    timed = blockwise("stream", autocast=autocast, timing=True)
    g = torch.Generator().manual_seed(0)
    timed.micro_step(x0, prompts, g)
    seconds = [timed.micro_step(x0, prompts, g)["step_time_s"] for _ in range(3)]
    stats = timed.handle.stats()
    timed.close()
    return {
        "max_relative_difference_stream_vs_resident": worst,
        "ok": worst <= 1e-5,
        "streamed_step_s": sorted(seconds)[1],
        "step_dtype": "bfloat16" if autocast else "float32",
        "h2d_gbps": stats.get("h2d_gbps"),
        "copy_hidden_fraction": stats.get("copy_hidden_fraction"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_checks: no CUDA device", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(args.preset, Path(tmp) / args.preset)
        report = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "preset": args.preset,
            "streamed_equals_resident": streamed_equals_resident(model, args.device),
            "training_step": training_step(model, args.device),
        }
    if args.device == "cuda":
        report["h2d_bandwidth"] = h2d_bandwidth()
    ok = all(v["ok"] for v in report.values() if isinstance(v, dict))
    report["ok"] = ok
    print(json.dumps(report, indent=2) if args.json else report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
