"""A Wan-shaped denoising step three ways: resident, streamed by MegaSlide, and streamed by
diffusers' group offloading (block level, one block a group, on a CUDA stream).

    python benchmarks/wan_streaming.py --json                  # Wan2.1-14B blocks, CUDA
    python benchmarks/wan_streaming.py --device cpu --quick --json

A `WanTransformer3DModel` with Wan2.1-14B's block dimensions (width 5120, 40 heads, FFN 13824)
but only `--blocks` blocks of random bf16 weights, one batch of the CFG pair (two rows) of
`--frames` frames at `--size`. The same inputs go through each: seconds per step (median after a
warm-up) and the ratios to resident, the bytes copied per step, and that the three outputs agree.
On the CPU (`--device cpu`) there is no copy stream: the run checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch


def sync(device: str) -> None:
    if device == "cuda":
        # Timing needs the queued kernels finished; without it we would time the launches only.
        torch.cuda.synchronize()


def build(blocks: int, quick: bool):
    from diffusers import WanTransformer3DModel

    if quick:  # small enough for a CPU
        dims = dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=256, text_dim=64)
    else:  # Wan2.1-14B's blocks
        dims = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, text_dim=4096)
    torch.manual_seed(0)
    return WanTransformer3DModel(num_layers=blocks, in_channels=16, out_channels=16, **dims)


def time_steps(model, inputs: dict, device: str, repeats: int) -> tuple[list[float], torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]  # warm-up (and first copies)
        sync(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(**inputs, return_dict=False)
            sync(device)
            times.append(time.perf_counter() - start)
    return times, out.float().cpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--frames", type=int, default=21, help="latent frames")
    ap.add_argument("--size", default="60x104", help="latent HxW (480x832 pixels)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small dims and clip, for a CPU check")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.frames, args.size, args.repeats = 4, 3, "8x8", 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("wan_streaming: no CUDA device", file=sys.stderr)
        return 2
    from diffusers.hooks import apply_group_offloading

    from megaslide.engine.streaming.streamer import stream_module

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    h, w = (int(v) for v in args.size.split("x"))
    base = build(args.blocks, args.quick).to(dtype).eval()
    text_dim = base.config.text_dim
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 16, args.frames, h, w, generator=g).to(args.device, dtype),
        "timestep": torch.tensor([900.0, 900.0], device=args.device),
        "encoder_hidden_states": torch.randn(2, 512, text_dim, generator=g).to(args.device, dtype),
    }
    block_bytes = sum(p.numel() * p.element_size() for p in base.blocks.parameters())

    resident = copy.deepcopy(base).to(args.device)
    resident_s, resident_out = time_steps(resident, inputs, args.device, args.repeats)
    del resident

    ours = copy.deepcopy(base)
    handle = stream_module(ours, ours.blocks, args.device)
    handle.reset_stats()
    ours_s, ours_out = time_steps(ours, inputs, args.device, args.repeats)
    ours_h2d = handle.h2d_bytes / (args.repeats + 1)
    handle.remove()
    del ours

    theirs = copy.deepcopy(base)
    cuda = args.device == "cuda"
    apply_group_offloading(
        theirs,
        onload_device=torch.device(args.device),
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=cuda,  # a CUDA stream prefetches the next group
        non_blocking=cuda,
    )
    theirs_s, theirs_out = time_steps(theirs, inputs, args.device, args.repeats)

    def agree(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "blocks": args.blocks,
        "block_bytes": block_bytes // args.blocks,
        "tokens": args.frames * (h // 2) * (w // 2),
        "rows": 2,
        "resident_s": statistics.median(resident_s),
        "megaslide_streamed_s": statistics.median(ours_s),
        "diffusers_group_offload_s": statistics.median(theirs_s),
        "megaslide_h2d_bytes_per_step": ours_h2d,
        "relative_difference_megaslide": agree(ours_out, resident_out),
        "relative_difference_diffusers": agree(theirs_out, resident_out),
    }
    result["megaslide_over_resident"] = result["megaslide_streamed_s"] / result["resident_s"]
    result["diffusers_over_resident"] = result["diffusers_group_offload_s"] / result["resident_s"]
    result["ok"] = (
        max(result["relative_difference_megaslide"], result["relative_difference_diffusers"]) < 1e-2
    )
    print(json.dumps(result, indent=2) if args.json else result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
