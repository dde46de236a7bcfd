"""Check the 8-bit attention kernel against its reference on CUDA and time it against SDPA.

    python benchmarks/sage_cuda_check.py --json              # on a CUDA machine
    python benchmarks/sage_cuda_check.py --interpret --json  # dry run on CPU (TRITON_INTERPRET=1)

Correctness, per case (bf16 and fp16 inputs, ragged and whole blocks): the oracle is the
reference with everything after the int8 scores in float64 (`pv="exact"`); the reference's fp16
P V against it gives `torch_err`; the kernel passes when `kernel_err <= 2 * torch_err` plus one
unit in the last place of the output dtype at the output's largest magnitude (tests/test_sage.py
says why). Its cosine similarity against float64 SDPA must be >= 0.999.

Speed: forward milliseconds of `sage_attention` (quantization included) and of bf16 SDPA
(PyTorch's flash kernel on CUDA) at Wan2.1-14B's self-attention over a 480x832, 81-frame clip
(32,760 tokens, 40 heads of 128), with TFLOP/s from `4 * B * heads * N^2 * D`. Inputs are
Wan-like heads when diffusers imports (tests/support/sage_inputs.py), random normal q and k
otherwise (the time does not depend on the values). Exit 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

if "--interpret" in sys.argv:  # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' Wan-like inputs

from megaslide.kernels import sage_attention_reference, sage_triton  # noqa: E402

# (name, token grid, heads, head dim, dtype, blocks or None for the default (128, 64))
CASES = [
    ("wan_d128_bf16", (4, 30, 52), 2, 128, torch.bfloat16, None),  # 6,240 tokens: whole blocks
    ("ragged_d64_fp16", (3, 17, 23), 3, 64, torch.float16, None),  # 1,173 tokens
    ("small_blocks_d128_bf16", (2, 9, 13), 2, 128, torch.bfloat16, (64, 32)),
]
INTERPRET_CASES = [
    ("ragged_d32_bf16", (2, 5, 7), 2, 32, torch.bfloat16, (16, 16)),
    ("whole_d64_fp16", (2, 4, 8), 1, 64, torch.float16, (32, 16)),
]
SPEED = dict(tokens=32760, heads=40, d=128)  # Wan2.1-14B, 480x832x81: 21 x 30 x 52 tokens


def inputs(grid, heads, d, dtype, device):
    try:
        from sage_inputs import wan_like_qkv

        q, k, v = wan_like_qkv(grid, heads, d, k_offset=10.0, dtype=dtype)
    except ImportError:  # no diffusers: normal q, k, v with an offset on K's channels
        g = torch.Generator().manual_seed(0)
        n = math.prod(grid)
        q, k, v = (torch.randn(1, n, heads, d, generator=g) for _ in range(3))
        k = k + 5 * torch.randn(1, 1, heads, d, generator=g)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q.to(device), k.to(device), v.to(device)


def check(case, device) -> dict:
    name, grid, heads, d, dtype, blocks = case
    kw = {"blocks": blocks} if blocks else {}
    q, k, v = inputs(grid, heads, d, dtype, device)
    oracle = sage_attention_reference(q.double(), k.double(), v.double(), pv="exact", **kw)
    torch_lp = sage_attention_reference(q, k, v, **kw)
    kernel = sage_triton(q, k, v, **kw)
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v))
    ).transpose(1, 2)
    k_err = (kernel.double() - oracle).abs().max().item()
    t_err = (torch_lp.double() - oracle).abs().max().item()
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(oracle.abs().max().item()))
    cosine = F.cosine_similarity(kernel.double().flatten(), exact.flatten(), dim=0).item()
    ok = k_err <= 2 * t_err + ulp and cosine >= 0.999 and kernel.dtype == dtype
    return {
        "case": name,
        "kernel_max_err": k_err,
        "torch_max_err": t_err,
        "bound": 2 * t_err + ulp,
        "cosine_vs_sdpa": round(cosine, 6),
        "ok": ok,
    }


def timed(fn, repeats: int = 10) -> float:
    """Median milliseconds of `fn()` over `repeats` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # the events' times are only valid once the end event has completed
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def speed() -> dict:
    n, h, d = SPEED["tokens"], SPEED["heads"], SPEED["d"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )
    flops = 4 * h * n * n * d
    sage_ms = timed(lambda: sage_triton(q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sdpa_ms = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt))
    return {
        **SPEED,
        "sage_ms": round(sage_ms, 2),
        "sage_tflops": round(flops / sage_ms / 1e9, 1),
        "sdpa_bf16_ms": round(sdpa_ms, 2),
        "sdpa_bf16_tflops": round(flops / sdpa_ms / 1e9, 1),
        "speedup": round(sdpa_ms / sage_ms, 3),
        "device": torch.cuda.get_device_name(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="CPU dry run through the interpreter")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.interpret and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --interpret for a CPU dry run")
    device = "cpu" if args.interpret else "cuda"
    with torch.no_grad():
        checks = [check(c, device) for c in (INTERPRET_CASES if args.interpret else CASES)]
        result = {"checks": checks, "speed": None if args.interpret else speed()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for c in checks:
            print(c)
        print(result["speed"])
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
