"""3D Deformable Slide Attention: window semantics, reference vs dense oracle, Triton vs reference.

The Triton kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a script with
`--interpret-worker`). Triton reads the variable when a kernel is decorated and the interpreter
patches `triton.language` while it runs, so setting it in this process would turn every Triton
kernel imported by later test files into an interpreted one. The subprocess keeps it contained
and runs all interpreter cases in one start-up; each case is then asserted in its own test.

Tolerances follow FlashAttention's rule: the oracle is the reference in float64 on the same
(rounded) inputs; the same math run by PyTorch at the test precision gives `torch_err`; the
kernel must satisfy `kernel_err <= 2 * torch_err + eps`, with `eps` a few units in the last
place of the float32 accumulator (it only matters in fp32, where both errors are that small).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import megaslide.kernels.dsa_reference as reference_module
from megaslide.kernels import (
    dsa_attention,
    dsa_attention_reference,
    dsa_dense_oracle,
    dsa_geometry,
    invert_windows,
    window_tiles,
)

from interpreted import interpreted_results

# ---------------------------------------------------------------------------------------------
# Window semantics on hand-computed cases
# ---------------------------------------------------------------------------------------------


def _flat(tiles, t, y, x):
    _, nY, nX = tiles
    return (t * nY + y) * nX + x


def _motion(tiles, at, vel, B=1, H=1):
    """Motion tensor with velocity `vel` at query tile `at`, zero elsewhere."""
    m = torch.zeros(B, H, *tiles, 2, dtype=torch.float64)
    m[:, :, at[0], at[1], at[2]] = torch.tensor(vel, dtype=torch.float64)
    return m


def test_time_window_shifts_inward_at_borders():
    geom = dsa_geometry(grid=(5, 1, 1), tile=(1, 1, 1), window=(3, 1, 1))
    win = window_tiles(geom)
    assert win.shape == (1, 1, 5, 3)
    assert win[0, 0].tolist() == [[0, 1, 2], [0, 1, 2], [1, 2, 3], [2, 3, 4], [2, 3, 4]]


def test_spatial_window_without_motion_is_a_clamped_square():
    tiles = (1, 4, 5)
    geom = dsa_geometry(grid=(1, 8, 10), tile=(1, 2, 2), window=(1, 3, 3))
    win = window_tiles(geom)[0, 0]
    # Query tile (0, 0, 4): top-right corner, window shifts to y 0..2, x 2..4.
    assert win[_flat(tiles, 0, 0, 4)].tolist() == [
        _flat(tiles, 0, y, x) for y in range(0, 3) for x in range(2, 5)
    ]
    # Query tile (0, 2, 2): interior, centred.
    assert win[_flat(tiles, 0, 2, 2)].tolist() == [
        _flat(tiles, 0, y, x) for y in range(1, 4) for x in range(1, 4)
    ]


def test_motion_moves_each_key_frame_by_velocity_times_time_offset():
    tiles = (3, 5, 5)
    geom = dsa_geometry(grid=(3, 5, 5), tile=(1, 1, 1), window=(3, 3, 3))
    win = window_tiles(geom, _motion(tiles, (1, 2, 2), (1.0, -1.0)))[0, 0]
    expected = []
    # a'=0 (dt=-1): centre (1, 3) -> y 0..2, x 2..4; a'=1: centre (2, 2); a'=2: centre (3, 1).
    for t, (y0, x0) in zip(range(3), [(0, 2), (1, 1), (2, 0)]):
        expected += [_flat(tiles, t, y, x) for y in range(y0, y0 + 3) for x in range(x0, x0 + 3)]
    assert win[_flat(tiles, 1, 2, 2)].tolist() == expected


@pytest.mark.parametrize(
    "v, shifts",  # shift of key frames a'=0,1,2 relative to query frame 1: r((a'-1) * v)
    [
        (0.5, [0, 0, 1]),  # r(-0.5) = floor(0) = 0, r(0.5) = floor(1) = 1: halves round up
        (1.5, [-1, 0, 2]),  # r(-1.5) = floor(-1) = -1, r(1.5) = 2
        (0.49, [0, 0, 0]),
        (-0.5, [1, 0, 0]),  # r(0.5) = 1, r(-0.5) = 0
    ],
)
def test_motion_rounding_is_floor_of_x_plus_half(v, shifts):
    tiles = (3, 1, 9)
    geom = dsa_geometry(grid=(3, 1, 9), tile=(1, 1, 1), window=(3, 1, 1))
    win = window_tiles(geom, _motion(tiles, (1, 0, 4), (0.0, v)))[0, 0]
    assert win[_flat(tiles, 1, 0, 4)].tolist() == [
        _flat(tiles, t, 0, 4 + s) for t, s in zip(range(3), shifts)
    ]


def test_motion_past_the_border_clamps_and_never_shrinks():
    tiles = (3, 4, 6)
    geom = dsa_geometry(grid=(3, 4, 6), tile=(1, 1, 1), window=(3, 3, 3))
    # Query tile (1, 2, 3); without motion its window starts at y 1, x 2 in every key frame.
    # Key frame 0 is at dt = -1, so it moves against the velocity; frame 2 moves with it.
    for vel, starts in [
        ((0.0, 100.0), [(1, 0), (1, 2), (1, 3)]),
        ((-100.0, float("inf")), [(1, 0), (1, 2), (0, 3)]),  # inf * 0 in frame 1 must not be NaN
        ((float("nan"), -float("inf")), [(1, 3), (1, 2), (1, 0)]),  # NaN counts as 0
    ]:
        win = window_tiles(geom, _motion(tiles, (1, 2, 3), vel))[0, 0]
        expected = []
        for t, (y0, x0) in enumerate(starts):
            expected += [
                _flat(tiles, t, y, x) for y in range(y0, y0 + 3) for x in range(x0, x0 + 3)
            ]
        assert win[_flat(tiles, 1, 2, 3)].tolist() == expected, vel


def test_windows_always_hold_exactly_w_distinct_tiles():
    geom = dsa_geometry(grid=(6, 10, 14), tile=(2, 2, 2), window=(3, 3, 5))
    g = torch.Generator().manual_seed(0)
    motion = torch.randn(2, 3, *geom.tiles, 2, generator=g, dtype=torch.float64) * 4
    win = window_tiles(geom, motion)
    assert win.shape == (2, 3, geom.num_tiles, 45)
    sorted_rows = win.sort(-1).values
    assert (sorted_rows[..., 1:] > sorted_rows[..., :-1]).all()
    assert win.min() >= 0 and win.max() < geom.num_tiles


def test_invert_windows_lists_every_query_of_every_key_tile_in_order():
    geom = dsa_geometry(grid=(3, 5, 7), tile=(1, 1, 1), window=(3, 3, 3))
    g = torch.Generator().manual_seed(1)
    motion = torch.randn(2, 1, *geom.tiles, 2, generator=g, dtype=torch.float64) * 2
    win = window_tiles(geom, motion)
    offsets, queries = invert_windows(win, geom.num_tiles)
    assert offsets.shape == (2, 1, geom.num_tiles + 1) and queries.shape == (2, 1, 105 * 27)
    for b in range(2):
        for key in range(geom.num_tiles):
            want = [q for q in range(geom.num_tiles) if key in win[b, 0, q].tolist()]
            got = queries[b, 0, offsets[b, 0, key] : offsets[b, 0, key + 1]].tolist()
            assert got == want


# ---------------------------------------------------------------------------------------------
# Reference against the dense masked oracle (float64)
# ---------------------------------------------------------------------------------------------


def _qkv(B, H, N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3)]


def _make_motion(kind, B, H, tiles, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    heads = 1 if kind == "broadcast" else H
    m = torch.randn(B, heads, *tiles, 2, generator=g, dtype=torch.float64)
    return m * (6.0 if kind == "past_border" else 1.5)


@pytest.mark.parametrize(
    "grid, tile, window, motion",
    [
        (
            (3, 10, 14),
            (1, 2, 2),
            (3, 3, 3),
            "none",
        ),  # 3 x 5 x 7 tiles, every window touches a border
        ((3, 10, 14), (1, 2, 2), (3, 3, 3), "per_head"),
        ((6, 6, 10), (2, 3, 2), (1, 1, 5), "broadcast"),  # 3 x 2 x 5 tiles, odd tile of 12 tokens
        (
            (4, 9, 12),
            (1, 3, 4),
            (3, 3, 3),
            "past_border",
        ),  # window as large as the tile grid in y, x
        ((5, 4, 4), (1, 4, 4), (5, 1, 1), "per_head"),  # one spatial tile: motion can move nothing
    ],
)
def test_reference_matches_dense_oracle(grid, tile, window, motion):
    B, H, D = 2, 2, 8
    geom = dsa_geometry(grid, tile, window)
    q, k, v = _qkv(B, H, geom.num_tokens, D)
    m = _make_motion(motion, B, H, geom.tiles)
    kwargs = dict(grid=grid, tile=tile, window=window, motion=m)
    want = dsa_dense_oracle(q, k, v, **kwargs)
    for use_sdpa in (True, False):
        err = (dsa_attention_reference(q, k, v, use_sdpa=use_sdpa, **kwargs) - want).abs()
        assert err.max() < 1e-12, f"max {err.max():.3e} mean {err.mean():.3e}"


def test_reference_matches_oracle_across_chunks_and_with_explicit_scale(monkeypatch):
    grid, tile, window = (3, 6, 6), (1, 2, 3), (3, 3, 1)  # 18 tiles of 6 tokens, W = 9
    B, H, D = 1, 3, 16
    # Budget for 4 query tiles per chunk: chunks of 4, 4, 4, 4 and a short last one of 2.
    monkeypatch.setattr(reference_module, "_GATHER_CHUNK_BYTES", 4 * B * H * 9 * 6 * D * 8)
    q, k, v = _qkv(B, H, 108, D, seed=3)
    m = _make_motion("per_head", B, H, (3, 3, 2), seed=3)
    kwargs = dict(grid=grid, tile=tile, window=window, motion=m, scale=0.3)
    want = dsa_dense_oracle(q, k, v, **kwargs)
    # No autograd: gathers reuse one buffer per tensor.
    err = (dsa_attention_reference(q, k, v, **kwargs) - want).abs()
    assert err.max() < 1e-12, f"max {err.max():.3e} mean {err.mean():.3e}"
    # Autograd: fresh gathers per chunk; gradients through the chunk loop and its concat too.
    do = torch.randn_like(q)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    got = dsa_attention_reference(*qkv, **kwargs)
    grads = torch.autograd.grad(got, qkv, do)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    want_grads = torch.autograd.grad(dsa_dense_oracle(*qkv, **kwargs), qkv, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *grads), (want, *want_grads)):
        err = (a - b).abs()
        assert err.max() < 1e-12, f"{name}: max {err.max():.3e} mean {err.mean():.3e}"


def test_dense_oracle_mask_matches_the_rules_on_a_tiny_grid():
    # The oracle is the ground truth, so check its mask once by hand: 1 x 1 x 4 tiles of 2 tokens,
    # window 3; tile 0 sees tiles 0..2, tile 3 sees 1..3.
    geom = dsa_geometry(grid=(1, 1, 8), tile=(1, 1, 2), window=(1, 1, 3))
    mask = reference_module.dsa_dense_mask(geom)[0, 0]
    assert mask[0].tolist() == [True] * 6 + [False] * 2
    assert mask[7].tolist() == [False] * 2 + [True] * 6


def test_reference_gradcheck_float64():
    # 3 x 2 x 2 tiles of 2 tokens; the window covers 1 of 2 tiles in y and x, so motion matters.
    grid, tile, window = (3, 2, 4), (1, 1, 2), (3, 1, 1)
    q, k, v = [t.requires_grad_() for t in _qkv(1, 1, 24, 3, seed=4)]
    m = _make_motion("per_head", 1, 1, (3, 2, 2), seed=4)

    def fn(q, k, v):
        return dsa_attention_reference(q, k, v, grid=grid, tile=tile, window=window, motion=m)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_motion_gets_no_gradient_and_qkv_do():
    grid, tile, window = (3, 4, 4), (1, 2, 2), (3, 1, 1)
    q, k, v = [t.requires_grad_() for t in _qkv(1, 2, 48, 4, seed=5)]
    m = _make_motion("per_head", 1, 2, (3, 2, 2), seed=5).requires_grad_()
    out = dsa_attention(q, k, v, grid=grid, tile=tile, window=window, motion=m)
    out.square().sum().backward()
    assert m.grad is None
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_auto_backend_on_cpu_is_the_reference():
    grid, tile, window = (3, 4, 4), (1, 2, 2), (3, 1, 1)
    q, k, v = _qkv(1, 2, 48, 16, dtype=torch.float32, seed=6)
    want = dsa_attention_reference(q, k, v, grid=grid, tile=tile, window=window)
    got = dsa_attention(q, k, v, grid=grid, tile=tile, window=window, backend="auto")
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


def _bad_call(**overrides):
    args = dict(
        q=torch.zeros(1, 2, 48, 16),
        k=torch.zeros(1, 2, 48, 16),
        v=torch.zeros(1, 2, 48, 16),
        grid=(3, 4, 4),
        tile=(1, 2, 2),
        window=(3, 1, 1),
        motion=None,
        scale=None,
        backend="reference",
    )
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return dsa_attention(q, k, v, **args)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tile=(1, 3, 2)), "must divide grid"),
        (dict(window=(2, 1, 1)), "must be odd"),
        (dict(window=(3, 3, 1)), "larger than the tile count 2 on axis y"),
        (dict(grid=(3, 4, 5)), "tile .* must divide grid"),
        (dict(grid=(3, 4, 2), tile=(1, 2, 1)), "does not match grid"),
        (dict(grid=(3, 4)), "three integers"),
        (dict(k=torch.zeros(1, 2, 48, 8)), "same shape"),
        (dict(q=torch.zeros(2, 48, 16)), r"must be \(B, heads, N, D\)"),
        (dict(v=torch.zeros(1, 2, 48, 16, dtype=torch.float64)), "share a dtype"),
        (
            dict(motion=torch.zeros(1, 2, 3, 2, 2)),
            r"motion must be \(B, heads or 1, nT, nY, nX, 2\)",
        ),
        (dict(motion=torch.zeros(1, 3, 3, 2, 2, 2)), r"motion must be"),
        (dict(motion=torch.zeros(2, 1, 3, 2, 2, 2)), r"motion must be"),
        (dict(motion=torch.zeros(1, 1, 3, 2, 2, 2, dtype=torch.int64)), "floating-point"),
        (dict(scale=-1.0), "positive finite"),
        (dict(backend="flash"), "backend must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        _bad_call(**overrides)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter accepts CPU")
def test_triton_backend_on_cpu_tensors_says_so():
    from megaslide.kernels import dsa

    if dsa.TRITON_IMPORT_ERROR is not None:
        with pytest.raises(RuntimeError, match="needs the triton package"):
            _bad_call(backend="triton")
    else:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            _bad_call(backend="triton")


def test_triton_backend_rejects_head_dims_it_cannot_tile():
    from megaslide.kernels import dsa

    q = torch.zeros(1, 2, 48, 24)
    with pytest.raises((ValueError, RuntimeError), match="power-of-two head dim|needs"):
        dsa._check_triton_inputs(q, q, q)
    if dsa.TRITON_IMPORT_ERROR is None:
        try:
            os.environ["TRITON_INTERPRET"], old = "1", os.environ.get("TRITON_INTERPRET")
            with pytest.raises(ValueError, match="power-of-two head dim in \\[16, 256\\], got 24"):
                dsa._check_triton_inputs(q, q, q)
            with pytest.raises(ValueError, match="fp16, bf16 and fp32"):
                dsa._check_triton_inputs(*(torch.zeros(1, 1, 8, 16, dtype=torch.float64),) * 3)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old


@pytest.mark.slow
def test_package_imports_and_runs_the_reference_without_triton():
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import torch
        from megaslide.kernels import dsa_attention
        q = torch.randn(1, 1, 48, 16)
        out = dsa_attention(q, q, q, grid=(3, 4, 4), tile=(1, 2, 2), window=(3, 1, 1))
        assert out.shape == q.shape
        try:
            dsa_attention(q, q, q, grid=(3, 4, 4), tile=(1, 2, 2), window=(3, 1, 1),
                          backend="triton")
        except RuntimeError as e:
            assert "needs the triton package" in str(e), e
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter, against the reference
# ---------------------------------------------------------------------------------------------

# Kept tiny: the interpreter costs about a millisecond per Triton operation per program.
INTERPRET_CASES = {
    # 3 x 5 x 7 tiles, all windows at borders; default (autotuner-chosen) blocks.
    "odd_grid_fp32": dict(
        grid=(3, 10, 14),
        tile=(1, 2, 2),
        window=(3, 3, 3),
        B=1,
        H=1,
        D=16,
        dtype="float32",
        motion="none",
    ),
    "odd_grid_fp16_motion": dict(
        grid=(3, 10, 14),
        tile=(1, 2, 2),
        window=(3, 3, 3),
        B=1,
        H=1,
        D=16,
        dtype="float16",
        motion="per_head",
    ),
    # Motion pushing windows past the borders, per (batch, head); q/k/v as (B, N, H, D) views.
    "past_border_fp16_strided": dict(
        grid=(3, 6, 8),
        tile=(1, 2, 2),
        window=(3, 3, 3),
        B=2,
        H=2,
        D=32,
        dtype="float16",
        motion="past_border",
        layout="bnhd",
    ),
    # 24-token tiles with 16 x 16 blocks: two query blocks per tile, key blocks that straddle
    # tiles and a ragged last block; heads share one motion field.
    "ragged_blocks_fp32": dict(
        grid=(3, 8, 12),
        tile=(1, 4, 6),
        window=(3, 1, 1),
        B=1,
        H=2,
        D=16,
        dtype="float32",
        motion="broadcast",
        blocks=(16, 16),
    ),
    "ragged_blocks_fp16": dict(
        grid=(3, 8, 12),
        tile=(1, 4, 6),
        window=(3, 1, 1),
        B=1,
        H=2,
        D=32,
        dtype="float16",
        motion="per_head",
        blocks=(16, 16),
        scale=0.7,
    ),
}


def _err(x, ref):
    d = (x.double() - ref).abs()
    return d.max().item(), d.mean().item()


def _run_interpret_case(case: dict) -> dict:
    """Kernel and low-precision torch errors against the float64 reference, for one case."""
    from megaslide.kernels.dsa import dsa_triton

    dtype = getattr(torch, case["dtype"])
    geom = dsa_geometry(case["grid"], case["tile"], case["window"])
    B, H, D, N = case["B"], case["H"], case["D"], geom.num_tokens
    g = torch.Generator().manual_seed(0)
    if case.get("layout") == "bnhd":
        base = [torch.randn(B, N, H, D, generator=g).to(dtype) for _ in range(3)]
        q, k, v = [t.transpose(1, 2) for t in base]  # (B, H, N, D) views, stride(1) = D
    else:
        q, k, v = [torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(3)]
    dout = torch.randn(B, H, N, D, generator=g).to(dtype)
    motion = _make_motion(case["motion"], B, H, geom.tiles, seed=7)
    if motion is not None:
        motion = motion.float().requires_grad_()
    kw = dict(
        grid=case["grid"],
        tile=case["tile"],
        window=case["window"],
        motion=motion,
        scale=case.get("scale"),
    )

    motion_grads = []

    def run(fn, q, k, v, do):
        q, k, v = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(q, k, v)
        inputs = (q, k, v) if motion is None else (q, k, v, motion)
        grads = torch.autograd.grad(out, inputs, do, allow_unused=True)
        motion_grads.append(grads[3:])  # motion only selects tiles: no gradient may reach it
        return (out, *grads[:3])

    oracle = run(
        lambda q, k, v: dsa_attention_reference(q, k, v, **kw),
        q.double(),
        k.double(),
        v.double(),
        dout.double(),
    )
    torch_lp = run(
        lambda q, k, v: dsa_attention_reference(q, k, v, use_sdpa=False, **kw), q, k, v, dout
    )
    kernel = run(
        lambda q, k, v: dsa_triton(q, k, v, blocks=case.get("blocks"), **kw), q, k, v, dout
    )
    names = ("out", "dq", "dk", "dv")
    return {
        "errors": {
            n: {"kernel": _err(kv, o), "torch": _err(tv, o)}
            for n, kv, tv, o in zip(names, kernel, torch_lp, oracle)
        },
        "dtypes_ok": all(t.dtype == dtype for t in kernel),
        "motion_grad_is_none": all(g is None for gs in motion_grads for g in gs),
    }


def _interpret_worker() -> None:
    results = {}
    for name, case in INTERPRET_CASES.items():
        try:
            results[name] = _run_interpret_case(case)
        except Exception as exc:  # reported per case, so one failure does not hide the others
            import traceback

            results[name] = {"exception": f"{exc!r}\n{traceback.format_exc()}"}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpret_results():
    from megaslide.kernels import dsa

    return interpreted_results(__file__, dsa.TRITON_IMPORT_ERROR)


# A few float32 ulps at unit scale (outputs and gradients here are O(1)): in fp32 both errors
# are accumulator rounding, and the kernel's exp2 and blocked summation order differ from torch's
# by about that much. Measured: fp32 kernel/torch max-error ratios 0.7-2.2; fp16 ratios 0.1-0.6.
_EPS = 8 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("name", list(INTERPRET_CASES))
def test_triton_interpreter_matches_reference(interpret_results, name):
    res = interpret_results[name]
    assert "exception" not in res, res.get("exception")
    assert res["dtypes_ok"]
    assert res["motion_grad_is_none"]
    eps = _EPS
    report = []
    ok = True
    for tensor, e in res["errors"].items():
        (k_max, k_mean), (t_max, t_mean) = e["kernel"], e["torch"]
        bound = 2 * t_max + eps
        ok &= k_max <= bound
        report.append(
            f"{tensor}: kernel max {k_max:.3e} mean {k_mean:.3e} | torch max "
            f"{t_max:.3e} mean {t_mean:.3e} | bound {bound:.3e}"
        )
    assert ok, "\n".join(report)


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpret-worker"]:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        _interpret_worker()
    else:
        sys.exit(f"usage: TRITON_INTERPRET=1 {sys.argv[0]} --interpret-worker")
