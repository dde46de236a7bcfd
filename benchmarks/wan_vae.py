"""Wan's VAE decode: diffusers' against MegaSlide's chunked and fused one, and MP4 encoding after
decoding against encoding overlapped with it.

    python benchmarks/wan_vae.py --json                            # 480x832, 5 frames
    python benchmarks/wan_vae.py --height 192 --width 288 --json   # 2 tiles: minutes, not hours
    python benchmarks/wan_vae.py --height 720 --width 1280 --json
    python benchmarks/wan_vae.py --quick --json                    # a tiny VAE: the suite's form

The VAE is Wan2.1's at its real dimensions (`AutoencoderKLWan()`'s defaults: 96 base channels,
16 latent channels) with random weights, tiled as the Wan family runs it (`enable_tiling()`:
256-pixel tiles 192 apart); the latents are random, `(1, 16, 1 + (frames - 1) / 4, h / 8, w / 8)`.
Contenders, each in its own process, one after the other:

- `diffusers`: `vae.decode(z)` then the pipeline's postprocessing to uint8, the whole clip at once
  (what the Wan family did before chunking);
- `chunked_fused`: engine/wan/vae_decode.py's `frame_chunks` after `fuse_chains`, tiles in
  diffusers' order (`order="tiles"`: the family's decode now), each chunk's uint8 frames kept;
- `decode_then_encode`: `chunked_fused`, its frames concatenated, then `write_mp4`;
- `overlapped`: `write_mp4_chunks` taking `chunked_fused`'s chunks, encoding on a thread while
  the next chunk decodes (what `megaslide generate` does now);
- `frames_order`, `overlapped_frames_order`: the same with `order="frames"` (every tile's cache
  alive, every chunk out as soon as it exists);
- `chunked`: `chunked_fused` on the unfused VAE (what fusing the chains alone changes).

Each reports wall and CPU seconds, and the peak resident memory of its process above what it held
before the decode (`peak_rss_above_start_mb`: Linux's VmHWM, reset through
/proc/self/clear_refs just before the decode; RSS counts torch's CPU allocations, which
tracemalloc does not see), and SHA-256 digests of the uint8 frames it produced (the encoding
contenders: of the frames fed to the encoder, and of the MP4's decoded frames), which must agree:
`bitwise` says whether they do. The machine's load moves the seconds: read `cpu_seconds` too,
with `--threads 1`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

CONTENDERS = (
    "diffusers",
    "chunked_fused",
    "decode_then_encode",
    "overlapped",
    "frames_order",
    "overlapped_frames_order",
    "chunked",
)
ENCODERS = ("decode_then_encode", "overlapped", "overlapped_frames_order")


def build_vae(quick: bool, base_dim: int = 96):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    if quick:
        from wan_fixtures import _vae

        _, vae = _vae(False)
        # Tiles of 32 pixels, so the quick form's small clip is tiled as 480p is.
        vae.enable_tiling(32, 32, 24, 24)
    else:
        vae = AutoencoderKLWan(base_dim=base_dim)  # Wan2.1's VAE at 96, random weights
        vae.enable_tiling()  # as engine/wan/encoders.py runs it
    return vae.eval()


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def digest(chunks) -> str:
    """A SHA-256 of the arrays' bytes, in order."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(np.ascontiguousarray(c).tobytes())
    return h.hexdigest()


def run_one(name: str, args) -> dict:
    from megaslide.engine.video import read_video, write_mp4, write_mp4_chunks
    from megaslide.engine.wan.vae_decode import frame_chunks, fuse_chains

    torch.set_num_threads(args.threads)
    vae = build_vae(args.quick, args.base_dim)
    if name not in ("diffusers", "chunked"):
        fuse_chains(vae)
    order = "frames" if name.endswith("frames_order") else "tiles"
    ratio = vae.spatial_compression_ratio
    g = torch.Generator().manual_seed(1)
    latent_frames = 1 + (args.frames - 1) // 4
    z = torch.randn(
        1, vae.config.z_dim, latent_frames, args.height // ratio, args.width // ratio, generator=g
    )
    out: dict = {"contender": name}
    tmp = Path(tempfile.mkdtemp(prefix="wan_vae_"))
    mp4 = tmp / "out.mp4"
    fed = []

    def fed_chunks():
        for c in frame_chunks(vae, z, order=order):
            fed.append(c[0])
            yield c[0]

    start_rss = rss_mb("VmRSS")
    out["peak_reset"] = reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if name == "diffusers":
            video = vae.decode(z).sample  # (1, 3, F, H, W)
            video = (video / 2 + 0.5).clamp(0, 1)
            frames = (video.permute(0, 2, 3, 4, 1).float() * 255).round().to(torch.uint8)
            frames = frames.numpy()[0]
            out["frames_sha256"] = digest([frames])
        elif name in ("chunked", "chunked_fused", "frames_order"):
            chunks = [c[0] for c in frame_chunks(vae, z, order=order)]
            out["frames_sha256"] = digest(chunks)
        elif name == "decode_then_encode":
            chunks = list(fed_chunks())
            write_mp4(mp4, np.concatenate(chunks), fps=16)
        else:
            write_mp4_chunks(mp4, fed_chunks(), fps=16)
    out["seconds"] = time.perf_counter() - wall
    out["cpu_seconds"] = time.process_time() - cpu
    out["peak_rss_above_start_mb"] = rss_mb("VmHWM") - start_rss
    out["rss_at_start_mb"] = start_rss
    out["max_rss_process_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if name in ENCODERS:
        out["frames_sha256"] = digest(fed)
        out["mp4_frames_sha256"] = digest([read_video(mp4)])
    out["frames"] = args.frames
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=5, help="pixel frames: 1 + 4k")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--base-dim",
        type=int,
        default=96,
        help="the VAE's base width (Wan2.1: 96); narrower decodes long 720p clips in minutes, "
        "with the memory that grows with the frame count (3-channel outputs) unchanged",
    )
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--quick", action="store_true", help="a tiny VAE at 64x96, 5 frames")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one contender in this process
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.height, args.width, args.frames = 64, 96, 5
    if (args.frames - 1) % 4:
        ap.error(f"--frames must be 1 + 4k (Wan's VAE), got {args.frames}")
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return 0
    names = [n for n in args.contenders.split(",") if n]
    for n in names:
        if n not in CONTENDERS:
            ap.error(f"--contenders: unknown {n!r}; known: {', '.join(CONTENDERS)}")
    results = {}
    for n in names:
        cmd = [sys.executable, __file__, "--one", n, *_passed(args)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if done.returncode:
            raise SystemExit(f"{n} failed:\n{done.stderr[-4000:]}")
        results[n] = json.loads(done.stdout.strip().splitlines()[-1])
        print(n, json.dumps(results[n]), file=sys.stderr, flush=True)
    digests = {r["frames_sha256"] for r in results.values()}
    mp4s = {r["mp4_frames_sha256"] for r in results.values() if "mp4_frames_sha256" in r}
    base = results.get("diffusers")
    summary = {
        "vae": "tiny (tests/support/wan_fixtures.py)"
        if args.quick
        else f"Wan2.1's layout, base width {args.base_dim} (Wan2.1: 96), random weights",
        "height": args.height,
        "width": args.width,
        "frames": args.frames,
        "threads": args.threads,
        "device": "cpu",
        "bitwise": len(digests) == 1,
        "mp4_frames_identical": len(mp4s) <= 1,
        "contenders": results,
    }
    if base:
        summary["speedup_vs_diffusers"] = {
            n: base["seconds"] / r["seconds"] for n, r in results.items() if n != "diffusers"
        }
    print(json.dumps(summary, indent=2))
    return 0


def _passed(args) -> list[str]:
    out = ["--height", str(args.height), "--width", str(args.width)]
    out += ["--frames", str(args.frames), "--threads", str(args.threads)]
    out += ["--base-dim", str(args.base_dim)]
    return out + (["--quick"] if args.quick else [])


if __name__ == "__main__":
    raise SystemExit(main())
