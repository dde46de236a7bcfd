"""End to end on one GPU: a Wan2.1-T2V-14B-sized clip, MegaSlide (resident and streamed, each lever
on and off) against diffusers' `WanPipeline` (resident, and with group offloading).

    python benchmarks/wan_e2e.py --json --budget-s 440 --out /tmp/e2e.json   # CUDA
    python benchmarks/wan_e2e.py --tiny --json                               # CPU, seconds

The model is Wan2.1-T2V-14B's pipeline at its real sizes (40 blocks of width 5120, UMT5-XXL, the
Wan2.1 VAE; wan_shapes.py's configs) with random bf16 weights, written once as safetensors into a
scratch directory (`--model-dir` keeps it for the next run): about 28.6 GB of transformer, 11.4 GB
of UMT5 and 0.25 GB of VAE, 40 GB of the GPU machine's 64 GB disk. The weights' values do not
change the time a step takes, so they are not drawn one by one: every tensor's bytes are cut from
one 32 MiB pool of N(0, 0.02) bf16 draws at a rotating offset, which writes as fast as the disk
takes it. The clip is 480x832, 81 frames, guidance 5 (a CFG pair of rows each step).

Each contender opens the model through its own front door (`open_pipeline` with its placement
levers; `WanPipeline.from_pretrained`), then samples one request of `--warmup` + `--timed` steps
and decodes it. Reported per contender: the opening time, each step's seconds, `per_step_s` (the
median of the timed steps: after the warm-up step, which pays allocator growth and a compiled
contender's compile; a step that recompiled is never timed), `decode_s` (VAE decode and frame
conversion), `run_s` (prompt to frames, measured), the peak GPU memory and, streamed, the planner's step time
(`planned_step_s`). The 4- and 40-step figures are NOT measured: `e2e_s_extrapolated[n]` is
`run_s` plus `n - steps_run` more steps at `per_step_s`, labelled so in the JSON.

Contenders run in the order of CONTENDERS (the comparisons that matter most first). Before each,
its time is estimated from those already run (twice as long when it compiles); one that would not
fit in what is left of `--budget-s` is skipped, and the JSON says so and why. With `--out` the JSON
is rewritten after each contender, so a run stopped from outside keeps what it measured.

`--tiny` runs the same code on the CPU at tiny dimensions (a 2-block Wan, a 2-layer UMT5, a VAE of
width 8; 9 frames of 32x32) in float32, so the script is tested without a GPU. Its timings say
nothing about speed. Caution: with random weights the frames are noise; `frames_mean` (the mean
pixel level) only shows that a contender produced finite frames.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import wan_shapes  # noqa: E402

# name: (implementation, options). MegaSlide's options are `open_pipeline` placement levers and
# the attention override; diffusers' say where its weights live.
CONTENDERS: dict[str, tuple[str, dict]] = {
    "megaslide_streamed": ("megaslide", dict(offload="stream")),
    "diffusers_group_offload": ("diffusers", dict(offload="group")),
    "megaslide_resident": ("megaslide", dict(offload="none")),
    "diffusers_resident": ("diffusers", dict(offload="none")),
    "megaslide_streamed_all": (
        "megaslide",
        dict(offload="stream", compile=True, attention="sage", weights="fp8"),
    ),
    "megaslide_resident_all": ("megaslide", dict(offload="none", compile=True, attention="sage")),
    "megaslide_streamed_compile": ("megaslide", dict(offload="stream", compile=True)),
    "megaslide_streamed_sage": ("megaslide", dict(offload="stream", attention="sage")),
    "megaslide_streamed_fp8": ("megaslide", dict(offload="stream", weights="fp8")),
    "megaslide_resident_compile": ("megaslide", dict(offload="none", compile=True)),
    "megaslide_resident_sage": ("megaslide", dict(offload="none", attention="sage")),
}
GOALS = {"per_step_vs_diffusers_resident": 1.9, "decode_vs_diffusers": 1.8}
FULL = dict(frames=81, height=480, width=832, guidance=5.0)
TINY = dict(frames=9, height=32, width=32, guidance=5.0)
EXTRAPOLATE_TO = (4, 40)
PROMPT = "a red circle moving left on the river"
NEGATIVE = "blurry"

TINY_TEXT = dict(
    wan_shapes.UMT5_XXL,
    d_ff=64,
    d_kv=8,
    d_model=32,
    num_heads=4,
    num_layers=2,
    relative_attention_max_distance=16,
    relative_attention_num_buckets=8,
    vocab_size=64,
)
TINY_TRANSFORMER = dict(
    wan_shapes.transformer(2, 32, 2),
    attention_head_dim=12,
    freq_dim=16,
    rope_max_seq_len=32,
    text_dim=32,
)
TINY_VAE = dict(wan_shapes.VAE_2_1, base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)

POOL_BYTES = 32 << 20
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
COMPLETE = ".wan_e2e_complete"  # written last: a directory without it is rebuilt


def sync(device: str) -> None:
    if device == "cuda":
        # Timing needs the queued kernels finished; without it we would time the launches only.
        torch.cuda.synchronize()


# --- The model directory --------------------------------------------------------------------


def tensor_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The persistent tensors of a (meta) module by state-dict name, a tied tensor once under its
    first name (UMT5's `shared.weight`, not `encoder.embed_tokens.weight`)."""
    seen, shapes = set(), {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            shapes[name] = tuple(tensor.shape)
    return shapes


def write_random_safetensors(path: Path, shapes: dict, pool: torch.Tensor) -> int:
    """A safetensors file of bf16 tensors of `shapes` whose bytes are cut from `pool` at a
    rotating offset (the format: an 8-byte little-endian header length, a JSON header of dtypes,
    shapes and byte ranges, the data). Returns the bytes written."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 2 * max(1, int(torch.Size(shape).numel()))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    data = memoryview(pool.view(torch.uint8).numpy())
    at = 0
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, entry in enumerate(v for k, v in header.items() if k != "__metadata__"):
            left = entry["data_offsets"][1] - entry["data_offsets"][0]
            at = (at + 2 * 7919 * (i + 1)) % len(data)  # tensors start at different draws
            while left:
                take = min(left, len(data) - at)
                f.write(data[at : at + take])
                at, left = (at + take) % len(data), left - take
    return 8 + len(raw) + offset


def word_tokenizer():
    """A T5 tokenizer of the prompts' words and the letters (transformers builds its unigram model
    from the list: no sentencepiece, which the GPU machine lacks). Its ids are below any UMT5
    vocabulary's size, which is all the encoder needs of them."""
    from transformers import T5Tokenizer

    words = sorted(set(f"{PROMPT} {NEGATIVE}".split()))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + w, -1.0) for w in words] + [
        (c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"
    ]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def build_model_dir(path: Path, tiny: bool) -> dict:
    """Wan2.1-T2V-14B's pipeline directory (or the tiny one) with random bf16 weights at `path`,
    reused when a complete one is there. Returns the bytes of each component and the seconds."""
    start = time.perf_counter()
    marker = path / COMPLETE
    if marker.is_file() and json.loads(marker.read_text()).get("tiny") == tiny:
        return {**json.loads(marker.read_text()), "build_s": 0.0, "reused": True}
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    shutil.rmtree(path, ignore_errors=True)
    wan_shapes.write("wan2.1-t2v-14b", path)
    configs = {"text_encoder": wan_shapes.UMT5_XXL, "transformer": None, "vae": None}
    if tiny:  # the tiny dims replace the published ones
        for folder, config in (
            ("text_encoder", TINY_TEXT),
            ("transformer", TINY_TRANSFORMER),
            ("vae", TINY_VAE),
        ):
            (path / folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    word_tokenizer().save_pretrained(path / "tokenizer")
    for folder in configs:
        configs[folder] = json.loads((path / folder / "config.json").read_text())
    with torch.device("meta"):
        text_config = {k: v for k, v in configs["text_encoder"].items() if not k.startswith("_")}
        modules = {
            "text_encoder": (UMT5EncoderModel(UMT5Config(**text_config)), "model.safetensors"),
            "transformer": (
                WanTransformer3DModel.from_config(configs["transformer"]),
                "diffusion_pytorch_model.safetensors",
            ),
            "vae": (
                AutoencoderKLWan.from_config(configs["vae"]),
                "diffusion_pytorch_model.safetensors",
            ),
        }
    shapes = {folder: tensor_shapes(module) for folder, (module, _) in modules.items()}
    need = sum(2 * torch.Size(s).numel() for each in shapes.values() for s in each.values())
    free = shutil.disk_usage(path).free
    if need > free:  # found now, not as a full disk halfway through 40 GB
        raise SystemExit(
            f"wan_e2e: the random model needs {need / 1e9:.1f} GB, {path} has "
            f"{free / 1e9:.1f} GB free (--model-dir elsewhere)"
        )
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL_BYTES // 2, generator=g) * 0.02).to(torch.bfloat16)
    written = {
        folder: write_random_safetensors(path / folder / file, shapes[folder], pool)
        for folder, (_, file) in modules.items()
    }
    record = {"tiny": tiny, "bytes": written}
    marker.write_text(json.dumps(record))
    return {**record, "build_s": time.perf_counter() - start, "reused": False}


# --- The contenders -------------------------------------------------------------------------


def peak_reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def run_megaslide(path: Path, options: dict, clip: dict, steps: int, device: str, dtype) -> dict:
    """Open through `open_pipeline`, then prepare (the prompts' UMT5 pass), step and decode one
    request as the worker does."""
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.request import VideoRequest

    peak_reset(device)
    start = time.perf_counter()
    pipe = open_pipeline(path, device=device, dtype=dtype, **options)
    try:  # a failed contender (out of memory) must not hold its memory into the next
        sync(device)
        opened = time.perf_counter()
        request = VideoRequest(prompt=PROMPT, negative_prompt=NEGATIVE, steps=steps, seed=0, **clip)
        states = pipe.prepare_batch([pipe.resolve(request)])
        sync(device)
        prepared = time.perf_counter()
        step_s, h2d, recompiles = [], [], []
        while not all(s.done for s in states):
            t = time.perf_counter()
            counters = pipe.denoise_step(states)
            sync(device)
            step_s.append(time.perf_counter() - t)
            h2d.append(counters.get("h2d_bytes", 0))
            recompiles.append(counters.get("compile_recompiles", 0))
        t = time.perf_counter()
        frames = pipe.finish_batch(states)[0]
        sync(device)
        done = time.perf_counter()
        result = {
            "open_s": opened - start,
            "encode_s": prepared - opened,
            "step_s": step_s,
            "decode_s": done - t,
            "run_s": done - opened,
            "h2d_bytes_per_step": h2d[-1] if h2d else 0,
            "compile_recompiles_by_step": recompiles,  # a timed step that recompiles is not steady
            "frames_mean": float(frames.mean()),
            "peak_gpu_bytes": peak_bytes(device),
        }
    finally:
        pipe.close()
    return result


def run_diffusers(path: Path, options: dict, clip: dict, steps: int, device: str, dtype) -> dict:
    """`WanPipeline.from_pretrained`, the VAE in fp32 as Wan's examples run it; resident, or the
    transformer and UMT5 group-offloaded block by block on a CUDA stream (as wan_streaming.py
    offloads). Steps are timed from its step-end callback; decode is the rest of the call."""
    from diffusers import AutoencoderKLWan, WanPipeline

    peak_reset(device)
    start = time.perf_counter()
    vae = AutoencoderKLWan.from_pretrained(path / "vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(path, vae=vae, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    if options["offload"] == "group":
        from diffusers.hooks import apply_group_offloading

        cuda = device == "cuda"
        for module in (pipe.transformer, pipe.text_encoder):
            apply_group_offloading(
                module,
                onload_device=torch.device(device),
                offload_device=torch.device("cpu"),
                offload_type="block_level",
                num_blocks_per_group=1,
                use_stream=cuda,  # a CUDA stream prefetches the next group
                non_blocking=cuda,
            )
        pipe.vae.to(device)
    else:
        pipe.to(device)
    sync(device)
    opened = time.perf_counter()
    marks = []

    def step_end(_pipe, _i, _t, _kwargs):
        # The step's kernels finished before its end is stamped, else we time launches.
        sync(device)
        marks.append(time.perf_counter())
        return {}

    out = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=clip["height"],
        width=clip["width"],
        num_frames=clip["frames"],
        num_inference_steps=steps,
        guidance_scale=clip["guidance"],
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        callback_on_step_end=step_end,
    ).frames
    sync(device)
    done = time.perf_counter()
    bounds = [opened, *marks]
    result = {
        "open_s": opened - start,
        "encode_s": None,  # inside the first step's interval: the callback sees no boundary
        "step_s": [b - a for a, b in zip(bounds, bounds[1:])],
        "decode_s": done - marks[-1],
        "run_s": done - opened,
        "frames_mean": float(out.mean() * 255),
        "peak_gpu_bytes": peak_bytes(device),
    }
    del pipe, vae
    return result


def resident_fits(device: str, model_bytes: dict) -> str | None:
    """Why diffusers cannot hold the whole pipeline on the device, or None when it can: its
    weights (the VAE in fp32) and a 20% margin for activations against the device's memory."""
    if device != "cuda":
        return None
    need = 1.2 * (model_bytes["transformer"] + model_bytes["text_encoder"] + 2 * model_bytes["vae"])
    have = torch.cuda.get_device_properties(0).total_memory
    if need > have:
        return f"needs about {need / 1e9:.0f} GB of the device's {have / 1e9:.0f} GB"
    return None


def planned_step_s(path: Path, options: dict, clip: dict, device: str) -> float | None:
    """The planner's seconds per step for a streamed MegaSlide contender (its `Machine` defaults,
    an H200's link and compute, with this device's memory); None for a resident one, which the
    planner does not time."""
    from megaslide.engine.placement import Placement
    from megaslide.engine.planner import Machine, Workload, plan
    from megaslide.engine.sources import describe, resolve_source

    if options.get("offload") != "stream":
        return None
    machine = Machine()
    if device == "cuda":
        machine = Machine(gpu_mem=torch.cuda.get_device_properties(0).total_memory)
    info = describe(resolve_source(str(path)), attention=options.get("attention", "dense"))
    placement = Placement(offload="stream", weights=options.get("weights", "raw"))
    clip_shape = {k: clip[k] for k in ("frames", "height", "width")}
    return plan(info, machine, Workload.of(placement, **clip_shape))["time_s"]["step"]


def skip_reason(
    name: str, walls: list[float], left: float, device: str, model_bytes: dict
) -> str | None:
    """Why contender `name` is not run, or None: diffusers resident where the pipeline does not
    fit the device, or any that would not finish in the `left` seconds, its time estimated as the
    median wall time of those run so far (`walls`; twice that when it compiles). The first one
    runs whenever any time is left: there is nothing to estimate it from."""
    implementation, options = CONTENDERS[name]
    if implementation == "diffusers" and options["offload"] == "none":
        why = resident_fits(device, model_bytes)
        if why is not None:
            return why
    estimate = statistics.median(walls) * (2 if options.get("compile") else 1) if walls else 0.0
    if estimate > left or left <= 0:
        return f"estimated {estimate:.0f} s, {left:.0f} s of the budget left"
    return None


def summarise(row: dict, warmup: int) -> None:
    """`per_step_s` from the timed steps and the extrapolated 4- and 40-step figures, in place.
    A step that recompiled is not timed; when every step after the warm-up did, the row says
    `unsteady` and its figure includes compiling."""
    recompiled = row.get("compile_recompiles_by_step") or [0] * len(row["step_s"])
    timed = [s for i, s in enumerate(row["step_s"][warmup:], warmup) if not recompiled[i]]
    if not timed:
        row["unsteady"] = True
        timed = row["step_s"][warmup:] or row["step_s"]
    row["timed_steps"] = len(timed)
    row["steps_run"] = len(row["step_s"])
    row["per_step_s"] = statistics.median(timed)
    row["e2e_s_extrapolated"] = {
        str(n): row["run_s"] + (n - row["steps_run"]) * row["per_step_s"] for n in EXTRAPOLATE_TO
    }


def comparisons(rows: dict) -> dict:
    """Each MegaSlide contender's per-step and decode speed-up over each diffusers contender."""
    ours = {
        n: r
        for n, r in rows.items()
        if r.get("implementation") == "megaslide" and "per_step_s" in r
    }
    theirs = {
        n: r
        for n, r in rows.items()
        if r.get("implementation") == "diffusers" and "per_step_s" in r
    }
    out = {}
    for name, r in ours.items():
        out[name] = {
            f"{key}_vs_{other}": s[key] / r[key]
            for other, s in theirs.items()
            for key in ("per_step_s", "decode_s")
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", "--dry-run", action="store_true", help="tiny dims on the CPU")
    ap.add_argument("--device", help="default: cuda, or cpu with --tiny")
    ap.add_argument(
        "--contenders", help=f"comma-separated, in order (default: all of {list(CONTENDERS)})"
    )
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--timed", type=int, default=2, help="timed steps after the warm-up")
    ap.add_argument("--budget-s", type=float, default=440.0, help="skip what would not fit")
    ap.add_argument("--model-dir", type=Path, help="keep the random model here (reused)")
    ap.add_argument("--out", type=Path, help="the JSON, rewritten after each contender")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    device = args.device or ("cpu" if args.tiny else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("wan_e2e: no CUDA device (use --tiny for the CPU form)", file=sys.stderr)
        return 2
    names = args.contenders.split(",") if args.contenders else list(CONTENDERS)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        ap.error(f"--contenders: unknown {unknown[0]!r} (known: {', '.join(CONTENDERS)})")
    if args.warmup < 0 or args.timed < 1:
        ap.error("--warmup must be >= 0 and --timed >= 1")
    if args.tiny:
        torch.set_num_threads(1)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    clip = TINY if args.tiny else FULL
    scratch = None
    if args.model_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="wan_e2e_"))
    path = args.model_dir or scratch / "wan"
    result = {
        "model": "tiny Wan (random)" if args.tiny else "Wan2.1-T2V-14B dims, random bf16 weights",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "clip": {**clip, "warmup_steps": args.warmup, "timed_steps": args.timed},
        "extrapolated": "e2e_s_extrapolated: run_s plus the missing steps at per_step_s; not measured",
        "budget_s": args.budget_s,
        "goals": GOALS,
        "contenders": {},
    }

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - started
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))

    try:
        result["model_dir"] = build_model_dir(path, args.tiny)
        save()
        walls: list[float] = []
        for name in names:
            implementation, options = CONTENDERS[name]
            row = {"implementation": implementation, "options": options}
            result["contenders"][name] = row
            left = args.budget_s - (time.perf_counter() - started)
            why = skip_reason(name, walls, left, device, result["model_dir"]["bytes"])
            if why is not None:
                row["skipped"] = why
                save()
                continue
            run = run_megaslide if implementation == "megaslide" else run_diffusers
            # Compiled blocks compile at the first step only: the pass that fills the prompt's
            # kept keys and values runs the graph of those that read them (prompt_cache.py).
            warmup = args.warmup
            t = time.perf_counter()
            try:
                row.update(run(path, options, clip, warmup + args.timed, device, dtype))
                summarise(row, warmup)
                if implementation == "megaslide":
                    row["planned_step_s"] = planned_step_s(path, options, clip, device)
            except Exception as e:  # one contender failing (out of memory, say) is a result
                row["failed"] = f"{type(e).__name__}: {e}"[:500]
            row["wall_s"] = time.perf_counter() - t
            walls.append(row["wall_s"])
            gc.collect()
            save()
        result["speedups"] = comparisons(result["contenders"])
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    save()
    print(json.dumps(result, indent=2) if args.json else result)
    failed = [n for n, r in result["contenders"].items() if "failed" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
