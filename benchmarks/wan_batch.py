"""Throughput under concurrency: MegaSlide's worker path against diffusers' `WanPipeline`.

    python benchmarks/wan_batch.py --json            # 4 and 8 concurrent requests
    python benchmarks/wan_batch.py --quick --json    # the test suite's few-second form

A random Wan in the diffusers layout (6 blocks of width 384, UMT5 and a Wan VAE of reduced
width; tests/support/wan_fixtures.py's tokenizer), 13x96x96 clips, 6 steps, CFG 5, one prompt and seed
per request. Three contenders sample the same requests:

- `megaslide`: the pipeline driven as the worker drives it (server/worker/videos.py): the requests
  claimed together prepared in one call (their prompts in one UMT5 pass), every row of every
  request stepped together (resident on a CPU: in passes of `CPU_ROWS_PER_PASS` rows), each
  row's cross-attention keys and values computed at its first step and kept (engine/wan/
  prompt_cache.py), the clips decoded together `DECODE_CHUNK` per VAE pass;
- `diffusers_per_request`: `WanPipeline.__call__` once per request;
- `diffusers_batched`: `WanPipeline.__call__` once with every prompt (one generator each).

Repeats interleave the contenders (rotating who goes first), so load on the machine hits each
alike; medians are reported, of wall time and of the process's CPU time (`cpu_seconds`: what
a contender computed, which other processes on the machine move far less than the wall time;
read it with `--threads 1`, where no thread waits on another). `bus_bytes_per_step_per_request` is measured on a streamed copy of
the MegaSlide pipeline (one step of the same requests): the transformer's bytes moved to the
device per step, divided by the requests sharing it, and its fraction of the streamed blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' Wan tokenizer and builder

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402

from wan_fixtures import WORDS, build_tiny_wan, tokenizer  # noqa: E402

GOALS = {"vs_per_request": 1.5, "vs_batched": 1.0, "bus_fraction_of_blocks": 0.3}
FULL = dict(frames=13, size=96, steps=6, guidance=5.0, counts=(4, 8), repeats=3)
QUICK = dict(frames=5, size=32, steps=2, guidance=5.0, counts=(2,), repeats=1)


def build_mid_wan(path: Path, seed: int = 0) -> Path:
    """A random Wan2.1-style pipeline directory: 6 transformer blocks of width 384 (6 heads of
    64), a 2-layer UMT5 of width 256, and a Wan VAE of base width 16 with one residual block per
    level (its layout is Wan's; its width is cut so that a 2-core CPU decodes in seconds)."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tok = tokenizer()
    text = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok),
            d_model=256,
            d_kv=32,
            d_ff=1024,
            num_layers=2,
            num_heads=8,
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
        )
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=6,
        attention_head_dim=64,
        in_channels=16,
        out_channels=16,
        text_dim=256,
        freq_dim=256,
        ffn_dim=1536,
        num_layers=6,
    )
    with torch.no_grad():  # Wan's output projection starts at zero; random draws a clip
        transformer.proj_out.weight.normal_(0, 0.05)
    vae = AutoencoderKLWan(base_dim=16, num_res_blocks=1)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    WanPipeline(
        tokenizer=tok, text_encoder=text, vae=vae, scheduler=scheduler, transformer=transformer
    ).save_pretrained(path)
    defaults = {"frames": 13, "height": 96, "width": 96, "fps": 8, "steps": 6}
    (path / "megaslide.json").write_text(json.dumps({"sampling": defaults}))
    return path


def requests(n: int, clip: dict) -> list[VideoRequest]:
    """`n` requests with prompts and seeds of their own."""
    return [
        VideoRequest(
            prompt=" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(6)),
            negative_prompt="blurry",
            frames=clip["frames"],
            height=clip["size"],
            width=clip["size"],
            steps=clip["steps"],
            guidance=clip["guidance"],
            seed=100 + i,
        )
        for i in range(n)
    ]


def run_megaslide(pipe, reqs: list[VideoRequest]) -> list[np.ndarray]:
    """As the worker runs requests claimed together: prepare, step, decode, all batched."""
    states = pipe.prepare_batch([pipe.resolve(r) for r in reqs])
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    return pipe.finish_batch(states)


def _call(pipe, reqs: list[VideoRequest]) -> np.ndarray:
    r = reqs[0]
    out = pipe(
        prompt=[q.prompt for q in reqs],
        negative_prompt=[q.negative_prompt for q in reqs],
        height=r.height,
        width=r.width,
        num_frames=r.frames,
        num_inference_steps=r.steps,
        guidance_scale=r.guidance,
        generator=[torch.Generator().manual_seed(q.seed) for q in reqs],
        output_type="np",
    ).frames  # (B, F, H, W, 3) float in [0, 1]
    return (np.asarray(out) * 255).round().astype(np.uint8)


def run_diffusers_per_request(pipe, reqs: list[VideoRequest]) -> list[np.ndarray]:
    return [_call(pipe, [r])[0] for r in reqs]


def run_diffusers_batched(pipe, reqs: list[VideoRequest]) -> list[np.ndarray]:
    return list(_call(pipe, reqs))


def bus_bytes(path: Path, reqs: list[VideoRequest]) -> dict:
    """One step of `reqs` on a streamed copy: the transformer's bytes moved per step."""
    pipe = open_pipeline(path, offload="stream")
    handle = pipe.handles["transformer"]
    states = pipe.prepare_batch([pipe.resolve(r) for r in reqs])
    before = handle.h2d_bytes
    pipe.denoise_step(states)
    per_step = handle.h2d_bytes - before
    blocks = handle.stats()["streamed_block_bytes"]
    pipe.close()
    return {
        "bus_bytes_per_step": per_step,
        "bus_bytes_per_step_per_request": per_step / len(reqs),
        "streamed_block_bytes": blocks,
        "bus_fraction_of_blocks": per_step / len(reqs) / blocks,
    }


def rows_per_pass_sweep(model, rows: int, clip: dict, repeats: int) -> dict[int, float]:
    """CPU seconds (fewest of `repeats`) for one transformer pass over `rows` rows of the clip's
    latents, taken in passes of 1, 2, 4 ... rows: what CPU_ROWS_PER_PASS is chosen from."""
    frames, size = (clip["frames"] - 1) // 4 + 1, clip["size"] // 8  # the Wan VAE's latents
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, model.config.in_channels, frames, size, size, generator=g)
    context = torch.randn(rows, 512, model.config.text_dim, generator=g)
    t = torch.full((rows,), 500.0)
    chunks = [c for c in (1, 2, 4, 8, 16, 32) if c < rows] + [rows]
    best: dict[int, float] = {}
    for _ in range(repeats):
        for c in chunks:
            start = time.process_time()
            with torch.no_grad():
                for i in range(0, rows, c):
                    model(
                        hidden_states=x[i : i + c],
                        timestep=t[i : i + c],
                        encoder_hidden_states=context[i : i + c],
                        return_dict=False,
                    )
            best[c] = min(best.get(c, float("inf")), time.process_time() - start)
    return best


def level_diff(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    return max(int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(a, b))


def interleaved(contenders: dict, reqs: list[VideoRequest], rotate: int, repeats: int):
    """Each contender's wall and CPU seconds over `repeats` rounds, who goes first rotating so
    that load from elsewhere falls on each alike; and each one's frames."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    frames: dict[str, list[np.ndarray]] = {}
    for k in range(rotate, rotate + repeats):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            frames[name] = contenders[name](reqs)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return times, cpu, frames


def count_row(n: int, times: dict, cpu: dict, frames: dict, bus: dict) -> dict:
    """The table's row for `n` concurrent requests: medians and speedups, wall and CPU."""
    median = {name: statistics.median(t) for name, t in times.items()}
    median_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    return {
        "requests": n,
        "seconds": median,
        "all_seconds": times,
        "seconds_per_request": {k: v / n for k, v in median.items()},
        "speedup_vs_per_request": median["diffusers_per_request"] / median["megaslide"],
        "speedup_vs_batched": median["diffusers_batched"] / median["megaslide"],
        "cpu_seconds": median_cpu,
        "all_cpu_seconds": cpu,
        "cpu_speedup_vs_per_request": median_cpu["diffusers_per_request"] / median_cpu["megaslide"],
        "cpu_speedup_vs_batched": median_cpu["diffusers_batched"] / median_cpu["megaslide"],
        # Our frames against diffusers' for the same seeds (a level: GEMM order).
        "max_level_diff_vs_diffusers": level_diff(
            frames["megaslide"], frames["diffusers_per_request"]
        ),
        **bus,
    }


def print_table(rows: list[dict], sweep: dict, counts) -> None:
    for row in rows:
        s = row["seconds"]
        print(
            f"{row['requests']} requests: megaslide {s['megaslide']:.2f} s, diffusers per "
            f"request {s['diffusers_per_request']:.2f} s "
            f"({row['speedup_vs_per_request']:.2f}x), batched {s['diffusers_batched']:.2f} s "
            f"({row['speedup_vs_batched']:.2f}x); bus {row['bus_fraction_of_blocks']:.3f} "
            "of the blocks per step per request; CPU time "
            f"{row['cpu_speedup_vs_per_request']:.2f}x and {row['cpu_speedup_vs_batched']:.2f}x"
        )
    print(f"one pass of {2 * max(counts)} rows, CPU s by rows per pass: {sweep}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny Wan, 2 requests, 2 steps")
    ap.add_argument("--counts", type=int, nargs="+", help="concurrent requests (default 4 8)")
    ap.add_argument("--repeats", type=int, help="interleaved repeats per count (default 3)")
    ap.add_argument(
        "--rotate", type=int, default=0, help="who goes first in the first repeat (0: megaslide)"
    )
    ap.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import diffusers
    import transformers
    from diffusers import WanPipeline

    from megaslide.engine.sampling.pipeline import CPU_ROWS_PER_PASS, DECODE_CHUNK

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()

    clip = dict(QUICK if args.quick else FULL)
    counts = args.counts or clip["counts"]
    repeats = args.repeats or clip["repeats"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            path = build_tiny_wan(Path(tmp) / "wan", layers=2)
        else:
            path = build_mid_wan(Path(tmp) / "wan")
        ours = open_pipeline(path)
        theirs = WanPipeline.from_pretrained(path)
        theirs.set_progress_bar_config(disable=True)
        contenders = {
            "megaslide": lambda reqs: run_megaslide(ours, reqs),
            "diffusers_per_request": lambda reqs: run_diffusers_per_request(theirs, reqs),
            "diffusers_batched": lambda reqs: run_diffusers_batched(theirs, reqs),
        }
        for n in counts:
            reqs = requests(n, clip)
            times, cpu, frames = interleaved(contenders, reqs, args.rotate, repeats)
            rows.append(count_row(n, times, cpu, frames, bus_bytes(path, reqs)))
        sweep = rows_per_pass_sweep(ours.experts[0], 2 * max(counts), clip, repeats)
    for row in rows:
        row["goals_met"] = {
            "vs_per_request": row["speedup_vs_per_request"] >= GOALS["vs_per_request"],
            "vs_batched": row["speedup_vs_batched"] >= GOALS["vs_batched"],
            "bus_fraction_of_blocks": row["bus_fraction_of_blocks"]
            <= GOALS["bus_fraction_of_blocks"],
        }
    result = {
        "model": "tiny test Wan" if args.quick else "mid-size random Wan (6 x 384)",
        "clip": {k: clip[k] for k in ("frames", "size", "steps", "guidance")},
        "repeats": repeats,
        "decode_chunk": DECODE_CHUNK,
        "threads": torch.get_num_threads(),
        "rows_per_pass": CPU_ROWS_PER_PASS,
        "pass_cpu_seconds_by_rows_per_pass": sweep,
        "goals": GOALS,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(rows, sweep, counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
