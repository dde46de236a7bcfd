"""Check the Triton 3D-DSA kernels against the PyTorch reference on CUDA; exit 1 on mismatch.

    python benchmarks/dsa_cuda_check.py            # on a CUDA machine (bf16, fp16, fp32)
    python benchmarks/dsa_cuda_check.py --interpret  # dry run on CPU through TRITON_INTERPRET=1

For every case: the oracle is the reference in float64 on the same rounded inputs; `torch` is
the reference's spelled-out math (`use_sdpa=False`) at the case's precision; the kernel passes
when `kernel_err <= 2 * torch_err + eps` for the output and for dQ, dK, dV (max abs error),
the FlashAttention test rule. Prints one line per case and tensor, with max and mean errors.

Autotuning compiles and times every block configuration once per shape and dtype (about 20 s
each on an H200 with a cold cache), so only the first case runs autotuned, the path users get;
the others run fixed block shapes that cover padded, straddling and multi-block tiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--interpret" in sys.argv:  # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from megaslide.kernels import dsa_attention_reference, dsa_geometry, dsa_triton  # noqa: E402

# Slack for fp32 accumulator rounding at unit scale (see tests/test_dsa.py).
EPS = 8 * torch.finfo(torch.float32).eps

# (name, grid, tile, window, batch, heads, head dim, motion kind)
CUDA_CASES = [
    ("sta_d128", (8, 32, 48), (2, 8, 8), (3, 3, 3), 1, 4, 128, "none"),
    ("motion_d64", (8, 32, 48), (2, 8, 8), (3, 3, 3), 2, 3, 64, "per_head"),
    ("past_border_d32", (6, 24, 24), (1, 8, 8), (3, 3, 3), 1, 2, 32, "past_border"),
    ("odd_tiles_d64", (9, 15, 21), (3, 3, 3), (3, 3, 5), 1, 2, 64, "broadcast"),  # S = 27
    ("wide_time_d128", (30, 16, 16), (2, 8, 8), (9, 1, 1), 1, 2, 128, "per_head"),
]
# Block shapes (BLOCK_M, BLOCK_N) for the cases after the first, in turn; None autotunes.
FIXED_BLOCKS = [(32, 32), (64, 64), (16, 64)]
INTERPRET_CASES = [
    ("tiny_d16", (3, 6, 8), (1, 2, 2), (3, 3, 3), 1, 1, 16, "per_head"),
]


def make_motion(kind, B, H, tiles, device):
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(1)
    heads = 1 if kind == "broadcast" else H
    m = torch.randn(B, heads, *tiles, 2, generator=g) * (6.0 if kind == "past_border" else 1.5)
    return m.to(device)


def check_case(case, dtype, device, blocks) -> bool:
    name, grid, tile, window, B, H, D, motion_kind = case
    geom = dsa_geometry(grid, tile, window)
    N = geom.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v, do = [
        torch.randn(B, H, N, D, generator=g).to(device=device, dtype=dtype) for _ in range(4)
    ]
    kw = dict(
        grid=grid,
        tile=tile,
        window=window,
        motion=make_motion(motion_kind, B, H, geom.tiles, device),
    )

    def run(fn, *tensors):
        q_, k_, v_, do_ = tensors
        q_, k_, v_ = [t.detach().requires_grad_() for t in (q_, k_, v_)]
        out = fn(q_, k_, v_)
        return (out, *torch.autograd.grad(out, (q_, k_, v_), do_))

    oracle = run(
        lambda a, b, c: dsa_attention_reference(a, b, c, **kw),
        q.double(),
        k.double(),
        v.double(),
        do.double(),
    )
    low = run(lambda a, b, c: dsa_attention_reference(a, b, c, use_sdpa=False, **kw), q, k, v, do)
    started = time.perf_counter()
    kernel = run(lambda a, b, c: dsa_triton(a, b, c, blocks=blocks, **kw), q, k, v, do)
    seconds = time.perf_counter() - started
    ok = True
    for tname, kt, lt, ot in zip(("out", "dq", "dk", "dv"), kernel, low, oracle):
        k_err, l_err = (kt.double() - ot).abs(), (lt.double() - ot).abs()
        bound = 2 * l_err.max().item() + EPS
        passed = k_err.max().item() <= bound and kt.dtype == dtype
        ok &= passed
        print(
            f"{'ok  ' if passed else 'FAIL'} {name:16s} {str(dtype)[6:]:9s} {tname}: kernel max "
            f"{k_err.max().item():.3e} mean {k_err.mean().item():.3e} | torch max "
            f"{l_err.max().item():.3e} mean {l_err.mean().item():.3e} | bound {bound:.3e}",
            flush=True,
        )
    tuned = "autotuned" if blocks is None else f"blocks {blocks}"
    print(f"     {name:16s} {str(dtype)[6:]:9s} {tuned}, kernels {seconds:.1f} s", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true", help="CPU dry run under the interpreter")
    args = p.parse_args()
    if args.interpret:
        device, cases, dtypes = "cpu", INTERPRET_CASES, (torch.float16, torch.float32)
    elif torch.cuda.is_available():
        device, cases = "cuda", CUDA_CASES
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
    else:
        print("no CUDA device: run with --interpret for a CPU dry run", file=sys.stderr)
        return 2
    ok = True
    for i, case in enumerate(cases):
        for dtype in dtypes:
            first = i == 0 and dtype == dtypes[0]
            blocks = None if first or args.interpret else FIXED_BLOCKS[i % len(FIXED_BLOCKS)]
            try:
                ok &= check_case(case, dtype, device, blocks)
            except Exception as exc:  # a crash in one case must not hide the others
                print(f"FAIL {case[0]} {dtype}: {exc!r}", flush=True)
                ok = False
    print("all DSA kernel checks passed" if ok else "DSA kernel checks FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
