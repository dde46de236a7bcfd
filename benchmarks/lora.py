"""LoRA adapters per row: one denoising pass of a 4-request batch with 0, 1 and 4 distinct adapters,
against diffusers (PEFT) with the adapter loaded.

    python benchmarks/lora.py --json                  # Wan2.1-1.3B's block dims, 2 blocks, CPU
    python benchmarks/lora.py --quick --json          # tiny dims: checks the script

A `WanTransformer3DModel` with `--blocks` blocks of Wan2.1-1.3B's dimensions (width 1536, 12 heads,
FFN 8960, text 4096) and random weights; 4 rows (4 requests, guidance off), each `--frames` latent
frames of `--size` latents. Rank-`--rank` adapters on every attention projection and both FFN
layers of every block, as Wan LoRAs are trained. Each variant runs `--repeats` times after a
warm-up, round-robin with the others; reported are the fastest pass (`*_s`, robust to load from
elsewhere on the machine) and the median (`*_median_s`):

- `megaslide_s`: the pass with no adapter, 1 adapter on every row, and 4 distinct adapters (one a
  row) applied per row by MegaSlide's hooks, and the ratios to the pass without adapters (goal:
  <= 1.15 on the CPU);
- `diffusers_s`: the same model with the adapter loaded by diffusers' `load_lora_adapter` (PEFT
  layers): 1 adapter on the 4-row batch; 4 distinct adapters as diffusers serves them, one
  single-row pass per adapter (`set_adapters` between passes), summed;
- `adapter_device_bytes` (in the compute dtype; bf16 is half the fp32 figure), `registration_s`
  (reading an original-Wan-layout file, converting it with diffusers' converter, checking it
  against the model and moving it to the device), and the largest difference between MegaSlide's
  and diffusers' outputs with one adapter (MegaSlide's batched mode adds the product with one
  fused `addmm`, so float rounding differs slightly from PEFT's sequence).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ORIGINAL = {"attn1": "self_attn", "attn2": "cross_attn"}
ATTN = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
FFN = {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


def build(blocks: int, quick: bool):
    from diffusers import WanTransformer3DModel

    if quick:
        dims = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32)
    else:  # Wan2.1-T2V-1.3B
        dims = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, text_dim=4096)
    torch.manual_seed(0)
    model = WanTransformer3DModel(num_layers=blocks, in_channels=16, out_channels=16, **dims)
    return model.eval()


def targets(model) -> dict[str, tuple[str, int, int]]:
    """diffusers name -> (original-Wan name, in, out) of every layer the adapters touch."""
    out = {}
    for i, block in enumerate(model.blocks):
        for attn in ("attn1", "attn2"):
            for ours, theirs in ATTN.items():
                layer = block.get_submodule(f"{attn}.{ours}")
                out[f"blocks.{i}.{attn}.{ours}"] = (
                    f"blocks.{i}.{ORIGINAL[attn]}.{theirs}",
                    layer.in_features,
                    layer.out_features,
                )
        for ours, theirs in FFN.items():
            layer = block.get_submodule(ours)
            out[f"blocks.{i}.{ours}"] = (
                f"blocks.{i}.{theirs}",
                layer.in_features,
                layer.out_features,
            )
    return out


def adapter_state(layers: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """An adapter in diffusers / PEFT names (scale 1: alpha == rank)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, (_, n_in, n_out) in layers.items():
        state[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
        state[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    return state


def original_file(state: dict, layers: dict, path: Path) -> Path:
    """The same adapter in the original Wan layout (`diffusion_model.*.lora_down/up`, `.alpha`)."""
    from safetensors.torch import save_file

    out = {}
    for name, (orig, _, _) in layers.items():
        down, up = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        out[f"diffusion_model.{orig}.lora_down.weight"] = down
        out[f"diffusion_model.{orig}.lora_up.weight"] = up
        out[f"diffusion_model.{orig}.alpha"] = torch.tensor(float(down.shape[0]))
    save_file(out, str(path))
    return path


def interleaved(fns: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Time each of `fns` `repeats` times, round-robin, after one warm-up each, so load from
    elsewhere on the machine falls on every variant alike: (min s, median s, warm-up output)."""
    times = {k: [] for k in fns}
    with torch.no_grad():
        outs = {k: fn() for k, fn in fns.items()}
        for _ in range(repeats):
            for k, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - start)
    best = {k: min(v) for k, v in times.items()}
    return best, {k: statistics.median(v) for k, v in times.items()}, outs


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--frames", type=int, default=3, help="latent frames")
    ap.add_argument("--size", default="16x16", help="latent HxW")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="tiny dims, for a check of the script")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.rank, args.frames, args.size, args.repeats = 2, 4, 2, "4x4", 2
        args.text_tokens = 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build(args.blocks, args.quick)
    layers = targets(model)
    rows = 4
    h, w = (int(v) for v in args.size.split("x"))
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(rows, 16, args.frames, h, w, generator=g),
        timestep=torch.full((rows,), 500.0),
        encoder_hidden_states=torch.randn(
            rows, args.text_tokens, model.config.text_dim, generator=g
        ),
        return_dict=False,
    )
    states = [adapter_state(layers, args.rank, seed) for seed in range(4)]
    twin = copy.deepcopy(model)  # for diffusers, before any hook is attached to `model`
    router, registration = register_ours(model, layers, states)
    # All six variants round-robin, so load from elsewhere falls on each alike.
    best, median, outs = interleaved(
        {
            **ours_variants(router, model, inputs, rows),
            **diffusers_variants(twin, states, inputs, rows),
        },
        args.repeats,
    )
    ms = {k: best[k] for k in ("none", "one", "four_distinct")}
    ms_median = {k: median[k] for k in ms}
    ds = {k.removeprefix("diffusers_"): v for k, v in best.items() if k.startswith("diffusers_")}
    ds_median = {
        k.removeprefix("diffusers_"): v for k, v in median.items() if k.startswith("diffusers_")
    }
    d_outs = {"one": outs["diffusers_one"]}

    adapter_bytes = router.adapters["a0"].nbytes
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "model": {
            "blocks": args.blocks,
            "dim": model.config.num_attention_heads * model.config.attention_head_dim,
            "ffn_dim": model.config.ffn_dim,
            "text_dim": model.config.text_dim,
            "rows": rows,
            "tokens_per_row": args.frames * (h // 2) * (w // 2),
            "text_tokens": args.text_tokens,
        },
        "rank": args.rank,
        "adapted_layers": len(layers),
        "megaslide_s": ms,
        "megaslide_median_s": ms_median,
        "ratio_to_none": {k: ms[k] / ms["none"] for k in ("one", "four_distinct")},
        "goal_ratio": 1.15,
        "goal_met": max(ms["one"], ms["four_distinct"]) / ms["none"] <= 1.15,
        "diffusers_s": ds,
        "diffusers_median_s": ds_median,
        "diffusers_ratio_to_none": {
            k: ds[k] / ds["none"] for k in ("one", "four_distinct_one_pass_each")
        },
        "adapter_device_bytes": adapter_bytes,
        "adapter_device_bytes_bf16": adapter_bytes // 2,
        "registration_s": statistics.median(registration),
        "max_abs_diff_vs_diffusers": float((outs["one"] - d_outs["one"]).abs().max()),
        "output_scale": float(outs["one"].abs().max()),
        "adapter_effect": float((outs["one"] - outs["none"]).abs().max()),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


def register_ours(model, layers: dict, states: list[dict]):
    """MegaSlide's router on `model`, with the adapters registered from original-Wan files: the
    router, and the seconds each registration took."""
    from megaslide.engine.lora import AdapterRouter, linear_targets
    from megaslide.engine.wan.lora import load_wan_adapter

    router = AdapterRouter([model], linear_targets, torch.device("cpu"), torch.float32)
    registration = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, state in enumerate(states):
            file = original_file(state, layers, Path(tmp) / f"a{k}.safetensors")
            start = time.perf_counter()
            router.register(load_wan_adapter(f"a{k}", file))
            registration.append(time.perf_counter() - start)
    return router, registration


def ours_variants(router, model, inputs: dict, rows: int) -> dict:
    """MegaSlide's forwards: no adapter, one for every row, a distinct one per row."""

    def ours(sets):
        def run():
            with router.rows(sets):
                return model(**inputs)[0]

        return run

    return {
        "none": ours([[]] * rows),
        "one": ours([[("a0", 1.0)]] * rows),
        "four_distinct": ours([[(f"a{k}", 1.0)] for k in range(rows)]),
    }


def diffusers_variants(twin, states: list[dict], inputs: dict, rows: int) -> dict:
    """diffusers' forwards with the same adapters as PEFT layers, on a twin of the model (PEFT
    wraps the Linear layers MegaSlide's hooks sit on, so the two cannot share one module)."""
    for k, state in enumerate(states):
        twin.load_lora_adapter(
            {f"transformer.{n}": t for n, t in state.items()},
            prefix="transformer",
            adapter_name=f"a{k}",
        )

    def active(names):
        def run():
            if names:
                twin.enable_lora()
                twin.set_adapters(names, [1.0] * len(names))
            else:
                twin.disable_lora()
            return twin(**inputs)[0]

        return run

    def one_row_each():
        twin.enable_lora()
        for k in range(rows):
            twin.set_adapters([f"a{k}"], [1.0])
            row = {n: v[k : k + 1] for n, v in inputs.items() if n != "return_dict"}
            twin(**{**inputs, **row})

    return {
        "diffusers_none": active([]),
        "diffusers_one": active(["a0"]),
        "diffusers_four_distinct_one_pass_each": one_row_each,
    }


if __name__ == "__main__":
    sys.exit(main())
