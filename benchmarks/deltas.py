"""Fine-tunes kept as lossless deltas over their base (engine/deltas.py): their size, the host RAM of
many, the throughput of a batch mixing them, and the first video of one nobody has used yet.

    python benchmarks/deltas.py --json [--tiny-wan runs/tiny-wan/model] [--quick]

1. Size. MegaSlide's own trainer fine-tunes the packaged model (megaslide-tiny) on the world's
   unseen colour/shape/motion combinations (as benchmarks/finetune_state_quality.py does) at each
   learning rate and length of `--lrs` x `--steps`, and with `--tiny-wan` the trained tiny Wan of
   benchmarks/tiny_wan.py on the world's clips; each export's delta over its base is made in bf16
   (what a GPU serves) and fp32 (what a CPU serves). Reported: the delta's bytes over the bytes of
   the components it changes and of the whole model, in that dtype.
2. Host RAM. `--serve` of those fine-tunes registered on one streamed pipeline of the base (fp32,
   the CPU's dtype): the bytes the deltas hold against as many full copies.
3. Throughput (CPU, streamed): a step of a batch of `--mix` rows, each of another fine-tune,
   against a batch of as many rows of the base alone, and against the same rows on separately
   opened models (each its own pass), in rows per second of denoising steps.
4. Latency of the first video of a fine-tune not used yet: registering its saved delta on the
   running base (the first registration also hashes the base's weights once) and sampling, against
   opening the fine-tune's own copy and sampling.

Cautions: CPU figures. On the CPU "streaming" is a memcpy: the mixed batch's cost here is its
passes (one per fine-tune) and the deltas' decode (the C++ decoder, or the torch reference with
MEGASLIDE_NATIVE_CODEC=0: `throughput.decoder` says which), not the bus; the GPU's bus-bound case
is not measured. The fine-tunes are short runs of tiny models: a fine-tune's delta grows with how far
its weights move (learning rate x steps), which the sweep shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # finetune_state_quality's shifted data set

from finetune_state_quality import SHAPE, TIME_SAMPLING, shifted_dataset  # noqa: E402

from megaslide.engine.deltas import read_delta, write_delta  # noqa: E402
from megaslide.engine.loader import held_nbytes, open_pipeline  # noqa: E402
from megaslide.engine.native.world import write_dataset  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.engine.sources import DEFAULT_MODEL, describe, resolve_source  # noqa: E402
from megaslide.engine.streaming import variants  # noqa: E402
from megaslide.engine.training.finetune import open_trainer  # noqa: E402
from megaslide.engine.training.finetune_spec import (  # noqa: E402
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
)
from megaslide.kernels import lane_native  # noqa: E402

DTYPES = (torch.bfloat16, torch.float32)


def info(model) -> object:
    return describe(resolve_source(str(model)))


def fine_tune(base, data: Path, out: Path, lr: float, steps: int, clips: dict) -> Path:
    """An export of `base` fine-tuned `steps` steps at `lr` on `data` (batch 4, cosine, fp32
    AdamW), its clips as `clips` says; one made before (`--work`) is taken as it is."""
    if (out / "model" / "delta").exists():
        return out / "model"
    spec = FinetuneSpec(
        run=RunSpec(output=str(out / "run"), save_every=10**6, seed=0),
        schedule=ScheduleSpec(steps=steps, lr_schedule="cosine", warmup_steps=max(1, steps // 10)),
        optimizer=OptimizerSpec(lr=lr),
        clips=ClipSpec(**clips, batch_size=4),
    )
    with open_trainer(base, data, spec) as trainer:
        for _ in range(steps):
            trainer.train_step()
        return trainer.export(out / "model")


def sizes(tuned: Path, base) -> dict:
    """The delta of `tuned` over `base` in each serving dtype: bytes and ratios, and the seconds
    making it took."""
    out = {}
    for dtype in DTYPES:
        start = time.perf_counter()
        _, delta = write_delta(info(tuned), info(base), dtype)
        seconds = time.perf_counter() - start
        held = held_nbytes(info(tuned), dtype)
        changed = sum(held[c] for c in delta.deltas)
        out[str(dtype).removeprefix("torch.")] = {
            "delta_bytes": delta.nbytes,
            "changed_components": sorted(delta.deltas),
            "ratio_changed_components": delta.nbytes / changed,
            "ratio_whole_model": delta.nbytes / sum(held.values()),
            "make_s": seconds,
        }
    return out


def sweep(base, data: Path, work: Path, lrs, lengths, clips: dict) -> list[dict]:
    rows = []
    for lr in lrs:
        for steps in lengths:
            start = time.perf_counter()
            model = fine_tune(base, data, work / f"lr{lr:g}-s{steps}", lr, steps, clips)
            row = {"lr": lr, "steps": steps, "train_s": time.perf_counter() - start}
            rows.append({**row, "model": str(model), **sizes(model, base)})
            print(f"  lr {lr:g}, {steps} steps: {rows[-1]['bfloat16']}", file=sys.stderr)
    return rows


def host_ram(base, models: list[str], dtype: torch.dtype) -> dict:
    """Bytes the deltas of `models` hold registered on one streamed pipeline of `base` in
    `dtype` (coded again per block: `fine_tune_card`), against as many full copies."""
    pipe = open_pipeline(str(base), offload="stream", dtype=dtype)
    for k, model in enumerate(models):
        pipe.add_fine_tune(f"ft{k}", read_delta(model, dtype))
    model_bytes = sum(held_nbytes(info(base), dtype).values())
    deltas = sum(pipe.fine_tune_card(name)["bytes"] for name in pipe.fine_tunes)
    pipe.close()
    return {
        "fine_tunes": len(models),
        "dtype": str(dtype).removeprefix("torch."),
        "model_bytes": model_bytes,
        "deltas_bytes": deltas,
        "delta_per_model": deltas / len(models) / model_bytes,
        "base_and_deltas_bytes": model_bytes + deltas,
        "full_copies_bytes": (len(models) + 1) * model_bytes,
        "ratio": (model_bytes + deltas) / ((len(models) + 1) * model_bytes),
    }


def steps_per_s(
    pipe, names: list[str | None], request: dict, rounds: int, decodes: list | None = None
) -> float:
    """Rows of denoising steps a second of one batch whose rows sample `names` (fine-tunes;
    None: the base), after a warm-up step. `decodes`: cleared after the warm-up (`counting`)."""
    videos = [
        pipe.resolve(VideoRequest(fine_tune=n, seed=i, **request)) for i, n in enumerate(names)
    ]
    states = pipe.prepare_batch(videos)
    pipe.denoise_step(states)
    if decodes is not None:
        decodes.clear()
    start = time.perf_counter()
    for _ in range(rounds):
        pipe.denoise_step(states)
    return rounds * len(names) / (time.perf_counter() - start)


@contextlib.contextmanager
def counting(decodes: list):
    """Each delta the pipeline decodes meanwhile, appended to `decodes` as (words, seconds)."""
    apply = variants.delta_apply

    def counted(delta, words, sign):
        start = time.perf_counter()
        apply(delta, words, sign)
        decodes.append((delta.num_words, time.perf_counter() - start))

    variants.delta_apply = counted
    try:
        yield decodes
    finally:
        variants.delta_apply = apply


def throughput(base, models: list[str], request: dict, rounds: int) -> dict:
    pipe = open_pipeline(str(base), offload="stream")
    names = [f"ft{k}" for k in range(len(models))]
    for name, model in zip(names, models):
        pipe.add_fine_tune(name, read_delta(model, pipe.compute_dtype))
    base_rows = steps_per_s(pipe, [None] * len(models), request, rounds)
    with counting([]) as decodes:
        mixed_rows = steps_per_s(pipe, names, request, rounds, decodes)
    pipe.close()
    separate = [open_pipeline(m, offload="stream") for m in models]
    start = time.perf_counter()
    per_model = [steps_per_s(p, [None], request, rounds) for p in separate]
    elapsed = sum(1 / r for r in per_model)  # seconds for one step of each model's row
    native = lane_native.load()
    return {
        "fine_tunes": len(models),
        "threads": torch.get_num_threads(),
        # What decodes the deltas on the CPU: the C++ decoder, or the torch reference and why.
        "decoder": "native" if native else f"reference ({lane_native.unavailable_reason()})",
        "base_batch_rows_per_s": base_rows,
        "mixed_batch_rows_per_s": mixed_rows,
        "mixed_vs_base": mixed_rows / base_rows,
        # The deltas a step of the mixed batch decodes: how many, their words, their seconds.
        "mixed_decodes_per_step": len(decodes) / rounds,
        "mixed_decoded_words_per_step": sum(w for w, _ in decodes) / rounds,
        "mixed_decode_s_per_step": sum(s for _, s in decodes) / rounds,
        "mixed_step_s": len(names) / mixed_rows,
        "separate_models_rows_per_s": len(models) / elapsed,
        "seconds_measuring_separate": time.perf_counter() - start,
    }


def first_video(base, model: str, request: dict) -> dict:
    """Seconds to a first video of `model`: registered as a delta on a running base (twice:
    the first registration hashes the base), or opened whole."""
    pipe = open_pipeline(str(base), offload="stream")
    pipe.generate(VideoRequest(seed=0, **request))  # the base is warm, as in a server
    out = {}
    for attempt in ("first_registration", "later_registration"):
        start = time.perf_counter()
        pipe.add_fine_tune(attempt, read_delta(model, pipe.compute_dtype))
        registered = time.perf_counter() - start
        pipe.generate(VideoRequest(seed=0, fine_tune=attempt, **request))
        out[attempt] = {"register_s": registered, "video_s": time.perf_counter() - start}
    start = time.perf_counter()
    whole = open_pipeline(model, offload="stream")
    opened = time.perf_counter() - start
    whole.generate(VideoRequest(seed=0, **request))
    out["whole_copy"] = {"open_s": opened, "video_s": time.perf_counter() - start}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--lrs", default="1e-5,1e-4,1e-3")
    ap.add_argument("--steps", default="20,100", help="fine-tune lengths")
    ap.add_argument(
        "--tiny-wan", help="a trained tiny Wan (benchmarks/tiny_wan.py) to fine-tune too"
    )
    ap.add_argument("--mix", type=int, default=4, help="fine-tunes in the mixed batch")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per batch")
    ap.add_argument(
        "--work", help="keep the runs here, and reuse them (default: a temporary directory)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one short fine-tune")
    args = ap.parse_args(argv)
    lrs = [float(x) for x in args.lrs.split(",")]
    lengths = [int(x) for x in args.steps.split(",")]
    if args.quick:
        lrs, lengths, args.mix, args.rounds = [1e-4], [2], 1, 1
    torch.set_num_threads(args.threads)
    # A warm-up step, then the timed ones: each a step of the schedule.
    request = {"prompt": "a red ball moves right", "steps": args.rounds + 1}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        data = shifted_dataset(work / "data", 16 if args.quick else 64, seed=1, shape=SHAPE)
        clips = {**SHAPE, "time_sampling": TIME_SAMPLING}  # the packaged model's own
        result = {"packaged": sweep(DEFAULT_MODEL, data, work / "packaged", lrs, lengths, clips)}
        if args.tiny_wan:
            wan_shape = {"frames": 9, "height": 64, "width": 64}  # tiny_wan.py's clips
            wan_data = write_dataset(
                work / "wan-data", 16 if args.quick else 48, seed=7, **wan_shape
            )
            result["tiny_wan"] = sweep(
                args.tiny_wan, wan_data, work / "wan", lrs, lengths, wan_shape
            )
        models = [row["model"] for row in result["packaged"]]
        mixed = (models * args.mix)[: args.mix]
        result["host_ram"] = {
            str(d).removeprefix("torch."): host_ram(DEFAULT_MODEL, models, d) for d in DTYPES
        }
        if args.tiny_wan:
            wan_models = [row["model"] for row in result["tiny_wan"]]
            result["host_ram_tiny_wan"] = {
                str(d).removeprefix("torch."): host_ram(args.tiny_wan, wan_models, d)
                for d in DTYPES
            }
        result["throughput"] = throughput(DEFAULT_MODEL, mixed, request, args.rounds)
        result["first_video"] = first_video(DEFAULT_MODEL, models[-1], request)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in ("packaged", "tiny_wan"):
            for row in result.get(name, []):
                bf16 = row["bfloat16"]
                print(
                    f"{name} lr {row['lr']:g} {row['steps']} steps: bf16 delta "
                    f"{bf16['ratio_changed_components']:.3f}x of {bf16['changed_components']}"
                )
        print(
            json.dumps({k: result[k] for k in ("host_ram", "throughput", "first_video")}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
