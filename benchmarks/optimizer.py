"""CPU AdamW throughput: megaslide's CPUAdamW against torch.optim.AdamW (fused and foreach).

Every optimizer updates the same fp32 parameters with the same fp32 gradients (each has its own m
and v); ours also writes the bf16 compute copy, which torch's optimizers do not make. Rounds are
interleaved (ours, fused, foreach, ...) so that load from other processes hits all alike, and the
median round is reported.

Roofline. One step of ours moves about 30 B/param: read p, g, m, v (16 B), write p, m, v (12 B)
and the bf16 copy (2 B). `copy_gbps` is the bandwidth of a large ``dst.copy_(src)`` in the same
run, counted STREAM-style as 8 B/element (read + write); `roofline_fraction` =
30 B * params/s / copy_gbps. Caution: a copy into a cold destination also reads the destination
line before writing it (write-allocate), a cost AdamW's in-place writes to p, m, v do not pay, so
AdamW can exceed this "roofline". `inplace_gbps` (``a.add_(b)``, 12 B/element, no write-allocate)
is reported as a stricter reference, with `roofline_fraction_inplace` against it.

Compact state formats (`--states`, default all; engine/training/state_format.py): each runs on
its own copy of the parameters (bf16 for a bf16 master, which is then the compute copy and gets
no separate one), interleaved with the rest. Reported per format: params/s, the ratio to ours
in the fp32 format with its bf16 copy (the job a compact format replaces), and host bytes per
parameter; `best_ratio_vs_fp32` compares the fastest rounds instead of the medians (on a
machine shared with other work, the rounds least disturbed by it). Each compact format runs on
both update paths (`--paths`): the fused kernel ("native", engine/training/compact_kernel.py)
and torch ops ("torch-ops"); `update_path` says which one a plain CPUAdamW runs here, and
`native_kernel` where the kernel was loaded from (or why it is unavailable).

Usage: python benchmarks/optimizer.py --json [--sizes 50e6,200e6] [--rounds 7] [--threads N]
           [--states bf16-sr/8bit,...] [--paths native,torch-ops]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

from megaslide.engine.training import compact_kernel
from megaslide.engine.training.optim import FP32_CHUNK_NUMEL, CPUAdamW
from megaslide.engine.training.state_format import MASTERS, MOMENTS, StateFormat

COMPACT_STATES = [f"{m}/{v}" for m in MASTERS for v in MOMENTS if m != "bf16"][1:]

BYTES_PER_PARAM_OURS = 30  # p, g, m, v read (16) + p, m, v written (12) + bf16 copy (2)
BYTES_PER_PARAM_TORCH = 28  # same without the bf16 copy
TENSOR_NUMEL = 4 << 20  # model-like tensors of 4M elements (a 2048 x 2048 matrix)
BLOCK_NUMEL = 32 << 20  # grouped into blocks of ~32M params, updated with step_block


def make_params(num_params: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 params and grads: matrices of TENSOR_NUMEL plus one 1-D tensor per block."""
    sizes, left = [], num_params
    while left > 0:
        n = min(TENSOR_NUMEL, left)
        sizes.append(n)
        left -= n
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    return params, grads


def group_blocks(tensors: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    bid, used = 0, 0
    for i, t in enumerate(tensors):
        if used + t.numel() > BLOCK_NUMEL and used:
            bid, used = bid + 1, 0
        blocks.setdefault(bid, {})[f"t{i}"] = t
        used += t.numel()
    return blocks


def time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bandwidth(numel: int, rounds: int) -> tuple[float, float]:
    """(copy GB/s at 8 B/elem, in-place add GB/s at 12 B/elem), median of `rounds`."""
    a = torch.randn(numel)
    b = torch.empty(numel)
    b.copy_(a)  # fault the pages in before timing
    copy = statistics.median(time_once(lambda: b.copy_(a)) for _ in range(rounds))
    add = statistics.median(time_once(lambda: a.add_(b)) for _ in range(rounds))
    return 8 * numel / copy / 1e9, 12 * numel / add / 1e9


@contextlib.contextmanager
def update_path(path: str):
    """Build optimizers that run `path` ("native": the fused kernel if it builds; "torch-ops")."""
    saved = os.environ.get("MEGASLIDE_NATIVE_OPTIM")
    os.environ["MEGASLIDE_NATIVE_OPTIM"] = "0" if path == "torch-ops" else "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MEGASLIDE_NATIVE_OPTIM"]
        else:
            os.environ["MEGASLIDE_NATIVE_OPTIM"] = saved


def bench_size(
    num_params: int,
    rounds: int,
    threads: int | None,
    chunk_numel: int,
    states: list[str],
    paths: list[str],
) -> dict:
    params, grads = make_params(num_params)
    n = sum(p.numel() for p in params)

    # Ours: blocks of named tensors, a bf16 output buffer per tensor.
    p_blocks = group_blocks(params)
    g_blocks = group_blocks(grads)
    outs = group_blocks([torch.empty(p.shape, dtype=torch.bfloat16) for p in params])
    ours = CPUAdamW(p_blocks, lr=1e-4, weight_decay=0.01, threads=threads, chunk_numel=chunk_numel)

    def step_ours():
        for bid in p_blocks:
            ours.step_block(bid, g_blocks[bid], out=outs[bid])

    def step_ours_nocopy():
        for bid in p_blocks:
            ours.step_block(bid, g_blocks[bid])

    torch_opts = {}
    for kind in ("fused", "foreach"):
        tparams = [torch.nn.Parameter(p) for p in params]  # shares storage with `params`
        for tp, g in zip(tparams, grads):
            tp.grad = g
        torch_opts[kind] = torch.optim.AdamW(tparams, lr=1e-4, weight_decay=0.01, **{kind: True})

    variants = {
        "ours": step_ours,
        "ours_no_copy": step_ours_nocopy,
        "torch_fused": torch_opts["fused"].step,
        "torch_foreach": torch_opts["foreach"].step,
    }
    compact = {}
    for state in states:
        fmt = StateFormat.parse(state)
        dtype = torch.bfloat16 if fmt.master_is_compute_copy else torch.float32
        for path in paths:
            blocks = group_blocks([p.to(dtype, copy=True) for p in params])
            with update_path(path):
                opt = CPUAdamW(blocks, lr=1e-4, weight_decay=0.01, threads=threads, state=state)
            if opt.update_path != path:  # the kernel did not build: nothing to time
                continue
            compact[state, path] = opt

            def step_compact(opt=opt, blocks=blocks, copy=not fmt.master_is_compute_copy):
                for bid in blocks:
                    opt.step_block(bid, g_blocks[bid], out=outs[bid] if copy else None)

            variants[state, path] = step_compact
    for fn in variants.values():  # warm-up: allocates torch's state, faults pages in
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(time_once(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    name = {k: k if isinstance(k, str) else f"{k[0]} [{k[1]}]" for k in med}
    rate = {k: n / t for k, t in med.items()}
    best = {k: n / min(v) for k, v in times.items()}  # the least disturbed round of each
    copy_gbps, inplace_gbps = bandwidth(min(n, 64 << 20), rounds)
    ours.close()
    for opt in compact.values():
        opt.close()
    formats = {}
    for state in states:
        by_path = {
            path: {
                "params_per_s": rate[state, path],
                "ratio_vs_fp32": rate[state, path] / rate["ours"],
                "best_ratio_vs_fp32": best[state, path] / best["ours"],
                "chunk_numel": compact[state, path].chunk_numel,
            }
            for path in paths
            if (state, path) in compact
        }
        default = "native" if compact_kernel.load() is not None else "torch-ops"  # CPUAdamW's
        formats[state] = {
            **by_path.get(default, {}),
            "update_path": default,
            "bytes_per_param": StateFormat.parse(state).bytes_per_param(),
            "paths": by_path,
        }
    return {
        "params": n,
        "ours_params_per_s": rate["ours"],
        "ours_no_copy_params_per_s": rate["ours_no_copy"],
        "torch_fused_params_per_s": rate["torch_fused"],
        "torch_foreach_params_per_s": rate["torch_foreach"],
        "ratio_vs_torch_fused": rate["ours"] / rate["torch_fused"],
        "ratio_vs_torch_foreach": rate["ours"] / rate["torch_foreach"],
        "copy_gbps": copy_gbps,
        "inplace_gbps": inplace_gbps,
        "ours_gbps": BYTES_PER_PARAM_OURS * rate["ours"] / 1e9,
        "torch_fused_gbps": BYTES_PER_PARAM_TORCH * rate["torch_fused"] / 1e9,
        "roofline_fraction": BYTES_PER_PARAM_OURS * rate["ours"] / 1e9 / copy_gbps,
        "roofline_fraction_inplace": BYTES_PER_PARAM_OURS * rate["ours"] / 1e9 / inplace_gbps,
        "bytes_per_param_fp32": StateFormat().bytes_per_param(),
        "states": formats,
        "median_step_s": {name[k]: t for k, t in med.items()},
        "min_step_s": {name[k]: min(v) for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--sizes", default="50e6,200e6", help="comma-separated parameter counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPUAdamW worker threads (default: torch.get_num_threads())",
    )
    ap.add_argument(
        "--chunk-numel",
        type=int,
        default=None,
        help="CPUAdamW chunk size in elements (default: the optimizer's default)",
    )
    ap.add_argument(
        "--states",
        default=",".join(COMPACT_STATES),
        help="compact state formats to measure beside fp32 ('' for none)",
    )
    ap.add_argument(
        "--paths",
        default="native,torch-ops",
        help="update paths of the compact formats: the fused kernel, torch ops, or both",
    )
    args = ap.parse_args(argv)
    states = [s for s in args.states.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    chunk = args.chunk_numel or FP32_CHUNK_NUMEL
    results = [bench_size(s, args.rounds, args.threads, chunk, states, paths) for s in sizes]
    report = {
        "benchmark": "cpu_adamw",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "ours_threads": args.threads or torch.get_num_threads(),
        "ours_chunk_numel": chunk,
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),  # other processes on the machine skew the figures
        "machine": platform.processor() or platform.machine(),
        "bytes_per_param_ours": BYTES_PER_PARAM_OURS,
        "native_kernel": (
            str(compact_kernel.load().path)
            if compact_kernel.load() is not None
            else {"unavailable": compact_kernel.unavailable_reason()}
        ),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            print(
                f"{r['params'] / 1e6:7.1f}M params: ours {r['ours_params_per_s'] / 1e6:7.0f}M/s "
                f"(no copy {r['ours_no_copy_params_per_s'] / 1e6:5.0f}M/s), "
                f"torch fused {r['torch_fused_params_per_s'] / 1e6:7.0f}M/s, "
                f"foreach {r['torch_foreach_params_per_s'] / 1e6:7.0f}M/s, "
                f"ratio {r['ratio_vs_torch_fused']:.3f}, copy {r['copy_gbps']:.1f} GB/s, "
                f"roofline {100 * r['roofline_fraction']:.0f}% "
                f"(in-place {100 * r['roofline_fraction_inplace']:.0f}%)",
                file=sys.stdout,
            )
            for state, f in r["states"].items():
                for path, t in f["paths"].items():
                    print(
                        f"{'':16}{state:16} {path:9} {t['params_per_s'] / 1e6:7.0f}M/s, "
                        f"ratio to fp32 {t['ratio_vs_fp32']:.3f}, "
                        f"{f['bytes_per_param']:.2f} B/param"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
