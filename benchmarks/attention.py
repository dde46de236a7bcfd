"""3D Deformable Slide Attention against dense attention: time, peak memory, TFLOP/s.

    python benchmarks/attention.py --json [--plot attention.png] [--quick]

CPU (always): the PyTorch reference DSA against dense SDPA, forward in fp32 under
`torch.inference_mode`, at N = 4k, 8k, 16k, 32k tokens (`--quick`: 4k, 8k); grid T x 32 x 32,
heads 4, head dim 64, tile 1x8x8, window 3x3x3. Each (method, N) runs in a fresh subprocess so
that one measurement's freed memory cannot hide the next one's. Peak memory is the growth of the
process's peak resident set (Linux VmHWM, reset through /proc/self/clear_refs right before the
call) over its resident set after the inputs are built, so it counts everything the call
allocates, torch's allocator and kernel workspaces alike. Where /proc is missing it falls back
to `resource.getrusage().ru_maxrss`, which cannot be reset and may under-count; the JSON's
`memory_method` says which was used.

The measurement subprocesses run with `OMP_WAIT_POLICY=PASSIVE` unless `--raw-env` is given
(the JSON records which), because this benchmark usually runs on a shared machine: with
libgomp's default spin-waiting, a busy neighbour process makes every parallel region wait for a
scheduler time slice. The reference DSA runs a few hundred small regions per call and was
measured 10x slower that way under a load average of 5 on 2 cores, while dense SDPA (a few large
regions) did not change. CPU training through the reference on a shared machine wants it too.

CUDA (when available): forward and forward+backward of the Triton DSA against dense SDPA (flash)
and FlexAttention with the same block mask, at the 30x48x80 grid (115,200 tokens), heads 24,
head dim 128, tile 2x8x8, window 9x3x3, bf16. TFLOP/s for DSA and FlexAttention count only the
FLOPs inside the windows: forward `4 * B * H * N * (W * S) * D` (two matmuls of 2 FLOPs per
multiply-add), backward 2.5 times that (five matmuls); dense counts `4 * B * H * N^2 * D`.
FlexAttention gets tile-major inputs (the permutation is done outside its timing, which favours
it) and a block mask of whole tiles built from the same window indices.

The JSON has `cpu` rows `{"tokens", "dsa_ms", "dense_ms", "dsa_peak_mb", "dense_peak_mb"}` and,
on CUDA, `cuda` rows with the same keys plus `pass`, `flex_ms`, `flex_peak_mb` and TFLOP/s.
Progress goes to stderr; with `--json` stdout holds only the JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from megaslide.kernels import dsa_attention, dsa_geometry, window_tiles

CPU_TOKENS = (4096, 8192, 16384, 32768)
CPU_HEADS, CPU_DIM, CPU_TILE, CPU_WINDOW = 4, 64, (1, 8, 8), (3, 3, 3)

CUDA_GRID, CUDA_HEADS, CUDA_DIM = (30, 48, 80), 24, 128
CUDA_TILE, CUDA_WINDOW = (2, 8, 8), (9, 3, 3)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# CPU: one measurement per fresh subprocess
# ---------------------------------------------------------------------------------------------


def _cpu_grid(tokens: int) -> tuple[int, int, int]:
    assert tokens % 1024 == 0, tokens
    return (tokens // 1024, 32, 32)


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _rss_kib("VmHWM") is not None
    except OSError:
        return False


def _maxrss_kib() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib // 1024 if sys.platform == "darwin" else kib  # macOS reports bytes


def measure_cpu(method: str, tokens: int) -> dict:
    """Peak extra memory of one call, then the median time of repeated calls (this process)."""
    grid = _cpu_grid(tokens)
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, CPU_HEADS, tokens, CPU_DIM, generator=g) for _ in range(3)]
    if method == "dsa":
        fn = lambda: dsa_attention(q, k, v, grid=grid, tile=CPU_TILE, window=CPU_WINDOW)  # noqa
    else:
        fn = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    try:  # hand freed heap pages back so the baseline is what is live now
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with torch.inference_mode():
        if _reset_peak_rss():
            method_used = "VmHWM growth over VmRSS after setup (peak reset via clear_refs)"
            base = _rss_kib("VmRSS")
            t0 = time.perf_counter()
            out = fn()
            first = time.perf_counter() - t0
            peak = _rss_kib("VmHWM")
        else:
            method_used = "ru_maxrss growth over ru_maxrss after setup (not resettable)"
            base = _maxrss_kib()
            t0 = time.perf_counter()
            out = fn()
            first = time.perf_counter() - t0
            peak = _maxrss_kib()
        del out
        # The first call doubled as warm-up. Repeat for about 3 s, at least twice, at most 10.
        reps = max(2, min(10, int(3.0 / max(first, 1e-3))))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {
        "ms": 1e3 * statistics.median(times),
        "peak_mb": (peak - base) / 1024,
        "memory_method": method_used,
        "threads": torch.get_num_threads(),
    }


MEASURE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def run_cpu(tokens_list, raw_env: bool) -> tuple[list[dict], str]:
    rows, method_used = [], ""
    env = dict(os.environ) if raw_env else {**os.environ, **MEASURE_ENV}
    for tokens in tokens_list:
        row = {"tokens": tokens}
        for method in ("dsa", "dense"):
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--_measure-cpu", method, str(tokens)],
                capture_output=True,
                text=True,
                check=False,
                env=env,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{method} at {tokens} tokens failed:\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            row[f"{method}_ms"] = round(res["ms"], 2)
            row[f"{method}_peak_mb"] = round(res["peak_mb"], 1)
            method_used = res["memory_method"]
        log(
            f"cpu N={tokens:6d}: dsa {row['dsa_ms']:9.1f} ms {row['dsa_peak_mb']:7.1f} MB | "
            f"dense {row['dense_ms']:9.1f} ms {row['dense_peak_mb']:7.1f} MB | "
            f"speed-up {row['dense_ms'] / row['dsa_ms']:.2f}x"
        )
        rows.append(row)
    return rows, method_used


def cpu_goals(rows: list[dict]) -> dict:
    """The issue's CPU goals, evaluated on the rows that were measured."""
    by_n = {r["tokens"]: r for r in rows}
    goals = {}
    if 16384 in by_n:
        r = by_n[16384]
        goals["speedup_at_16k"] = round(r["dense_ms"] / r["dsa_ms"], 2)
        goals["speedup_at_16k_ok"] = goals["speedup_at_16k"] >= 4.0
        if 4096 in by_n:
            goals["time_16k_over_4k"] = round(r["dsa_ms"] / by_n[4096]["dsa_ms"], 2)
            goals["time_16k_over_4k_ok"] = goals["time_16k_over_4k"] <= 4.6
            goals["dense_time_16k_over_4k"] = round(r["dense_ms"] / by_n[4096]["dense_ms"], 2)
    ns = sorted(by_n)
    if len(ns) >= 2 and by_n[ns[0]]["dsa_peak_mb"] > 0:
        growth = by_n[ns[-1]]["dsa_peak_mb"] / by_n[ns[0]]["dsa_peak_mb"]
        goals["dsa_peak_growth"] = round(growth, 2)
        goals["token_growth"] = ns[-1] / ns[0]
    return goals


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not installed: skipping the plot {path}")
        return
    ns = [r["tokens"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("dsa", "3D-DSA (reference, CPU)"), ("dense", "dense SDPA")):
        ax_t.loglog(ns, [r[f"{key}_ms"] for r in rows], "o-", label=label, base=2)
        ax_m.loglog(ns, [max(r[f"{key}_peak_mb"], 1e-1) for r in rows], "o-", label=label, base=2)
    ax_t.set(xlabel="tokens", ylabel="forward time (ms)", title="time")
    ax_m.set(xlabel="tokens", ylabel="peak extra memory (MB)", title="peak memory")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


def window_flops(geom, batch: int, heads: int, dim: int) -> float:
    """Forward FLOPs inside the windows: QK^T and PV, 2 FLOPs per multiply-add each."""
    return 4.0 * batch * heads * geom.num_tokens * geom.window_tiles * geom.tile_tokens * dim


def flex_block_mask(geom, batch: int, heads: int, device):
    """FlexAttention BlockMask of whole tiles (tile-major token order) from `window_tiles`."""
    from torch.nn.attention.flex_attention import BlockMask

    nQ, W, S = geom.num_tiles, geom.window_tiles, geom.tile_tokens
    win = window_tiles(geom, device=device)[0, 0]  # (nQ, W)
    # BlockMask wants index rows as long as the number of key blocks; entries past the count
    # are ignored. All of a window's tiles are full blocks, so the fused kernel never calls
    # mask_mod; it is still exact, because the unfused (eager) path applies only mask_mod.
    idx = torch.zeros(batch, heads, nQ, nQ, dtype=torch.int32, device=device)
    idx[..., :W] = win.to(torch.int32)
    full = torch.full((batch, heads, nQ), W, dtype=torch.int32, device=device)
    allowed = torch.zeros(nQ, nQ, dtype=torch.bool, device=device)
    allowed[torch.arange(nQ, device=device)[:, None], win] = True

    def in_window(b, h, q_idx, kv_idx):
        return allowed[q_idx // S, kv_idx // S]

    return BlockMask.from_kv_blocks(
        torch.zeros_like(full),
        idx,
        full,
        idx,
        BLOCK_SIZE=S,
        mask_mod=in_window,
        seq_lengths=(geom.num_tokens, geom.num_tokens),
    )


def _cuda_time(fn, reps: int = 10) -> float:
    """Median milliseconds of fn() on the current stream, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        # Needed to read the events: elapsed_time is only valid once `end` has completed.
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cuda_peak_mb(fn) -> float:
    # Synchronize so the peak counter covers only fn's allocations, not earlier queued work.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()  # the peak is final only once fn's kernels have run
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_cuda() -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from megaslide.kernels.dsa_reference import to_tiles

    device = torch.device("cuda")
    geom = dsa_geometry(CUDA_GRID, CUDA_TILE, CUDA_WINDOW)
    B, H, D, N = 1, CUDA_HEADS, CUDA_DIM, geom.num_tokens
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = [
        torch.randn(B, H, N, D, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    ]
    do = torch.randn(B, H, N, D, generator=g, device=device, dtype=torch.bfloat16)
    qt, kt, vt = [
        to_tiles(t.detach(), geom).reshape(B, H, N, D).requires_grad_() for t in (q, k, v)
    ]
    mask = flex_block_mask(geom, 1, 1, device)  # broadcast over batch and heads
    flex = torch.compile(flex_attention, dynamic=False)

    def dsa():
        return dsa_attention(q, k, v, grid=CUDA_GRID, tile=CUDA_TILE, window=CUDA_WINDOW)

    def dense():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    def flexed():
        return flex(qt, kt, vt, block_mask=mask)

    fwd_flops = window_flops(geom, B, H, D)
    dense_flops = 4.0 * B * H * N * N * D
    rows = []
    for pass_name, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        row = {
            "tokens": N,
            "pass": pass_name,
            "grid": list(CUDA_GRID),
            "heads": H,
            "dim": D,
            "tile": list(CUDA_TILE),
            "window": list(CUDA_WINDOW),
            "dtype": "bfloat16",
        }
        for name, fn, inputs in (
            ("dsa", dsa, (q, k, v)),
            ("dense", dense, (q, k, v)),
            ("flex", flexed, (qt, kt, vt)),
        ):
            if pass_name == "fwd":

                def call(fn=fn):
                    with torch.no_grad():
                        fn()
            else:

                def call(fn=fn, inputs=inputs):  # autograd.grad: no accumulation into .grad
                    torch.autograd.grad(fn(), inputs, do)

            try:
                row[f"{name}_ms"] = round(_cuda_time(call), 3)
                row[f"{name}_peak_mb"] = round(_cuda_peak_mb(call), 1)
            except Exception as exc:  # FlexAttention's compiler can fail on some torch builds
                if name == "dsa":
                    raise
                row[f"{name}_ms"] = row[f"{name}_peak_mb"] = None
                row[f"{name}_error"] = repr(exc)[:500]
                log(f"cuda {pass_name}: {name} failed: {exc!r}")
                continue
            flops = (dense_flops if name == "dense" else fwd_flops) * mult
            row[f"{name}_tflops"] = round(flops / (row[f"{name}_ms"] * 1e-3) / 1e12, 1)
        for other in ("dense", "flex"):
            if row[f"{other}_ms"] is not None:
                row[f"speedup_vs_{other}"] = round(row[f"{other}_ms"] / row["dsa_ms"], 2)
        log(
            f"cuda {pass_name:8s}: dsa {row['dsa_ms']} ms ({row['dsa_tflops']} TFLOP/s in "
            f"window) | dense {row['dense_ms']} ms | flex {row['flex_ms']} ms | "
            f"{row.get('speedup_vs_dense')}x vs dense"
        )
        rows.append(row)
    with torch.no_grad():  # sanity: the timed kernel computes the operator at this shape
        want = dsa_attention(
            q.float(),
            k.float(),
            v.float(),
            grid=CUDA_GRID,
            tile=CUDA_TILE,
            window=CUDA_WINDOW,
            backend="reference",
        )
        rows[0]["dsa_max_abs_err_vs_fp32_reference"] = round(
            (dsa().float() - want).abs().max().item(), 5
        )  # .item(): a number for the JSON
    return rows


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    p.add_argument("--plot", metavar="PNG", help="plot CPU time and memory against N")
    p.add_argument("--quick", action="store_true", help="CPU at 4k and 8k tokens only")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA rows")
    p.add_argument(
        "--raw-env",
        action="store_true",
        help="measure CPU rows in the inherited environment (see the docstring)",
    )
    p.add_argument("--_measure-cpu", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._measure_cpu:
        method, tokens = args._measure_cpu
        print(json.dumps(measure_cpu(method, int(tokens))))
        return 0

    tokens = CPU_TOKENS[:2] if args.quick else CPU_TOKENS
    log(
        f"CPU: {torch.get_num_threads()} threads, heads {CPU_HEADS}, dim {CPU_DIM}, "
        f"tile {CPU_TILE}, window {CPU_WINDOW}, fp32 forward"
    )
    load_before = os.getloadavg()[0]
    cpu_rows, memory_method = run_cpu(tokens, args.raw_env)
    result = {
        "cpu": cpu_rows,
        "cpu_goals": cpu_goals(cpu_rows),
        "cpu_setup": {
            "heads": CPU_HEADS,
            "dim": CPU_DIM,
            "tile": list(CPU_TILE),
            "window": list(CPU_WINDOW),
            "grid": "tokens/1024 x 32 x 32",
            "dtype": "float32",
            "pass": "forward",
            "threads": torch.get_num_threads(),
            "memory_method": memory_method,
            "env": "inherited" if args.raw_env else MEASURE_ENV,
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "torch": torch.__version__,
    }
    if torch.cuda.is_available() and not args.no_cuda:
        result["device"] = torch.cuda.get_device_name()
        result["cuda"] = run_cuda()
    if args.plot:
        plot(cpu_rows, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        log(json.dumps(result["cpu_goals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
