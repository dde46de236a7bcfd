"""CPUAdamW's compact state formats: their codecs, and training against fp64 and fp32 AdamW.

Every bound is derived from the format (state_format.py, compact.py), none fitted:

* bf16-split keeps the fp32 master exactly, so it must equal the fp32 format bit for bit.
* Stochastic rounding moves a value to one of its two bf16 neighbours, up with probability equal
  to the fraction of the gap f: mean 0, variance ulp**2 * f * (1 - f) <= ulp**2 / 4 per rounding.
  After T independent roundings the master's error has rms <= ulp * sqrt(T) / 2.
* The 8-bit code keeps 3 mantissa bits of m and of v: relative error <= 2**-4 for m (nearest)
  and <= 2**-3 for v rounded stochastically (one code step), so <= 2**-4 for sqrt(v); one update
  lr * m / sqrt(v) is off by at most ~2**-4 + 2**-4 = 2**-3 of itself; the test requires the
  whole trajectory to stay within that single-step precision (errors must not compound) and its
  bias far below it.
* Round to nearest bf16 ("bf16") is the baseline: an update below half an ulp is lost.

The training tests run both update paths of a compact format: the fused kernel ("native") and
torch ops (test_optim_native.py compares the two step by step).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from native_kernel import PATHS, use_path

from megaslide.engine.training import compact
from megaslide.engine.training.finetune_spec import OptimizerSpec
from megaslide.engine.training.optim import CPUAdamW
from megaslide.engine.training.state_format import (
    MASTERS,
    MOMENTS,
    StateFormat,
    state_bytes_per_param,
)

COMPACT = [
    f"{m}/{v}" for m in MASTERS for v in MOMENTS if (m, v) != ("fp32", "fp32") and m != "bf16"
] + ["bf16/fp32"]
EIGHT_BIT = [f for f in COMPACT if f.endswith("8bit")]
SHAPES = {
    0: {"attn.w": (64, 48), "attn.b": (48,), "norm.scale": (300,)},
    1: {"mlp.w1": (33, 17), "mlp.b1": (17,), "emb": (1000,)},
}
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def is_bf16(state: str) -> bool:
    return StateFormat.parse(state).master_is_compute_copy


def make_params(state: str, seed: int = 0):
    """bf16-representable starting weights, as fp32 or bf16 tensors for the format's master."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if is_bf16(state) else torch.float32
    return {
        b: {n: torch.randn(s, generator=g).bfloat16().to(dtype) for n, s in named.items()}
        for b, named in SHAPES.items()
    }


def make_grads(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + seed)
    return {
        b: {n: torch.randn(s, generator=g).to(dtype) for n, s in named.items()}
        for b, named in SHAPES.items()
    }


def fp32_master(opt: CPUAdamW, params) -> dict:
    """The fp32 value of each master: the halves joined for bf16-split, else widened."""
    out = {}
    for b, named in params.items():
        for n, t in named.items():
            if opt.format.master == "bf16-split":
                x = torch.empty(t.shape, dtype=torch.float32)
                compact.join_halves(t, opt._blocks[b].lo[n], x, compact.Scratch(256))
                out[b, n] = x
            else:
                out[b, n] = t.float()
    return out


def opt_for(params, state, **kw):
    kw.setdefault("lr", LR)
    return CPUAdamW(params, betas=BETAS, eps=EPS, weight_decay=WD, state=state, **kw)


# ---------------------------------------------------------------------- formats and API


def test_format_names_and_bytes_per_param():
    assert StateFormat.parse("fp32") == StateFormat.parse("fp32/fp32") == StateFormat()
    assert StateFormat.parse("bf16-sr/8bit").name == "bf16-sr/8bit"
    assert state_bytes_per_param("fp32") == 4 + 8 + 2  # master, m and v, bf16 compute copy
    assert state_bytes_per_param("bf16-split/fp32") == 4 + 8
    assert state_bytes_per_param("bf16-split/8bit") == 4 + 2 + 8 / 256
    assert state_bytes_per_param("bf16-sr/8bit") == 2 + 2 + 8 / 256
    assert OptimizerSpec(state="bf16-sr/8bit").state_bytes_per_param == 2 + 2 + 8 / 256
    for bad in ("fp16", "bf16-sr/4bit", "fp32/", "bf16-sr/8bit/x"):
        with pytest.raises(ValueError, match="master"):
            StateFormat.parse(bad)
        with pytest.raises(ValueError):
            OptimizerSpec(state=bad)


@pytest.mark.parametrize("state", ["fp32", "fp32/fp32"])
def test_fp32_format_is_bitwise_torch_fused_adamw(state):
    params = make_params("fp32")
    ref = [torch.nn.Parameter(t.clone()) for named in params.values() for t in named.values()]
    decayed = [p for p in ref if p.ndim >= 2]
    plain = [p for p in ref if p.ndim < 2]
    topt = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": WD}, {"params": plain, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=True,
    )
    opt = opt_for(params, state)
    assert not opt.format.compact and opt.chunk_numel == 1 << 19
    for step in range(4):
        grads = make_grads(step)
        for p, g in zip(ref, [t for named in grads.values() for t in named.values()]):
            p.grad = g.clone()
        topt.step()
        opt.step(grads)
    ours = [t for named in params.values() for t in named.values()]
    for p, t in zip(ref, ours):
        assert torch.equal(p.detach(), t)


@pytest.mark.parametrize("state", ["fp32"] + COMPACT)
def test_bytes_per_param_match_the_allocations(state):
    shapes = {"w": (64, 256), "b": (256,), "s": (512,)}  # multiples of 256: no padding
    dtype = torch.bfloat16 if is_bf16(state) else torch.float32
    params = {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}
    opt = CPUAdamW({0: params}, state=state)
    numel = sum(t.numel() for t in params.values())
    held = sum(t.nbytes for t in params.values())
    for key in opt._stores():
        held += sum(t.nbytes for t in getattr(opt._blocks[0], key).values())
    if not opt.format.master_is_compute_copy:
        held += 2 * numel  # the bf16 compute copy the caller keeps for an fp32 master
    assert held / numel == state_bytes_per_param(state)


def test_from_spec_and_master_dtype_checks():
    opt = CPUAdamW.from_spec(make_params("bf16-sr/8bit"), OptimizerSpec(state="bf16-sr/8bit"))
    assert opt.format.name == "bf16-sr/8bit" and opt.master_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bf16 CPU tensors"):
        CPUAdamW(make_params("fp32"), state="bf16-split/fp32")
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        CPUAdamW(make_params("bf16-sr/fp32"), state="fp32/8bit")
    with pytest.raises(ValueError, match="multiple of 256"):
        CPUAdamW(make_params("fp32"), state="fp32/8bit", chunk_numel=64)


def test_bf16_master_is_the_compute_copy_and_refuses_out():
    params = make_params("bf16-sr/8bit")
    opt = opt_for(params, "bf16-sr/8bit")
    out = {b: {n: torch.empty_like(t) for n, t in named.items()} for b, named in params.items()}
    with pytest.raises(ValueError, match="pass no out="):
        opt.step(make_grads(0), out=out)
    before = {(b, n): t.clone() for b, named in params.items() for n, t in named.items()}
    opt.step(make_grads(0))
    assert all(not torch.equal(params[b][n], t) for (b, n), t in before.items())
    opt.copy_params(0, out[0])  # still available: writes the master as it is
    assert all(torch.equal(out[0][n], params[0][n]) for n in params[0])


def test_fp32_master_with_8bit_moments_writes_the_compute_copy():
    params = make_params("fp32/8bit")
    opt = opt_for(params, "fp32/8bit", chunk_numel=512, threads=2)
    out = {
        b: {n: torch.empty(t.shape, dtype=torch.bfloat16) for n, t in named.items()}
        for b, named in params.items()
    }
    for step in range(2):
        opt.step(make_grads(step), out=out)
    for b, named in params.items():
        for n, t in named.items():
            assert torch.equal(out[b][n], t.to(torch.bfloat16)), (b, n)


def test_state_dict_format_mismatch_is_refused():
    sd = opt_for(make_params("fp32/8bit"), "fp32/8bit").state_dict()
    assert sd["state"] == "fp32/8bit" and "codes" in sd and "m" not in sd
    with pytest.raises(ValueError, match="state format"):
        opt_for(make_params("fp32"), "fp32").load_state_dict(sd)


# ---------------------------------------------------------------------- codecs


def test_split_halves_round_trip_is_exact_and_hi_is_rounded_bf16():
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g))
    x[:4] = torch.tensor([0.0, -0.0, 1e-40, -3e38])  # zeros, a subnormal, a large value
    # exact ties: the low 16 bits are 0x8000, rounded half away from zero
    ties = (torch.randint(0, 1 << 15, (64,), generator=g, dtype=torch.int32) << 16) | 0x8000
    x[4:68] = ties.view(torch.float32) * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
    hi = torch.empty(n, dtype=torch.bfloat16)
    lo = torch.empty(n, dtype=torch.int16)
    s = compact.Scratch(256)
    compact.split_halves(x, hi, lo, torch.empty(n, dtype=torch.int32), s)
    back = torch.empty(n)
    compact.join_halves(hi, lo, back, s)
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))
    # hi is x rounded to nearest bf16 (ties away from zero where torch rounds them to even)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(hi[~tie], x[~tie].to(torch.bfloat16))
    gap = (hi[tie].double().abs() - x[tie].double().abs()) / x[tie].double().abs()
    assert (gap > 0).all(), "ties must round away from zero"


def code_bound_check(x: torch.Tensor, q: torch.Tensor, a: torch.Tensor, rel: float, floor: float):
    """|x - q| <= rel * |x| where |x| >= floor * a (per 256-block absmax a), else <= floor * a."""
    a = a.repeat_interleave(256).double()
    x, q = x.double(), q.double()
    err = (x - q).abs()
    big = x.abs() >= floor * a
    slack = 1 + 1e-6  # the fp32 scaling by 1 / absmax and back: two roundings of 2**-24
    assert (err[big] <= rel * x.abs()[big] * slack).all(), (err[big] / x.abs()[big]).max().item()
    assert (err[~big] <= floor * a[~big] * slack).all()


def log_uniform_moments(n: int, seed: int) -> torch.Tensor:
    """m signed and v = (a positive w)**2, magnitudes spread over 2**-24..1 within each block."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g).sign() * torch.exp2(-24 * torch.rand(n, generator=g))
    w = torch.exp2(-24 * torch.rand(n, generator=g))
    return torch.stack([m, w * w])


@pytest.mark.parametrize("stochastic", [False, True])
def test_8bit_round_trip_within_the_code_bounds(stochastic):
    mv = log_uniform_moments(256 * 64, seed=1)
    mv[:, 256:512] = 0.0  # a block of zeros decodes to zeros
    codes, absmax = compact.quantize(mv, key=1234 if stochastic else None)
    assert codes.dtype == torch.uint8 and absmax.shape == (2, 64)
    back = compact.dequantize(codes, absmax)
    assert torch.equal(back[:, 256:512], mv[:, 256:512])
    # m: 3 mantissa bits, nearest: 2**-4; below 2**-16 * 1.25 of absmax flushed to 0
    code_bound_check(mv[0], back[0], absmax[0], 2**-4, 1.25 * 2**-16)
    # v: 3 mantissa bits, 2**-4 to nearest or one step (2**-3) stochastically; a tiny v is
    # raised to the smallest code 1.125 * 2**-32 of absmax, never lowered to 0
    code_bound_check(mv[1], back[1], absmax[1], 2**-3 if stochastic else 2**-4, 1.125 * 2**-32)
    nonzero = mv[1] > 0
    assert (back[1][nonzero] > 0).all()


def test_8bit_stochastic_rounding_of_v_is_unbiased():
    # v at a quarter of a code step above a code: nearest always rounds down, a bias of a
    # quarter step; stochastic rounding must average it out.
    n, draws = 256 * 4, 400
    v = torch.full((n,), 1.0 + 2**-5)
    v[::256] = 2.0  # each block's absmax: v / absmax = 0.5 + 2**-6, a quarter step above 0.5
    rest = torch.arange(n) % 256 != 0
    mv = torch.stack([torch.zeros(n), v])
    means = torch.zeros(n, dtype=torch.float64)
    for key in range(draws):
        codes, absmax = compact.quantize(mv, key=key)
        means += compact.dequantize(codes, absmax)[1].double() / draws
    step = 2**-4 * 2.0  # the code step at v / absmax in [0.5, 1) is 2**-4, times absmax
    sd = step * math.sqrt(0.25 * 0.75 / draws)  # Bernoulli(1/4) rounding
    err = (means - v.double())[rest]
    assert err.mean().abs() <= 5 * sd / math.sqrt(err.numel()) and err.abs().max() <= 6 * sd
    nearest = compact.dequantize(*compact.quantize(mv))[1].double()
    assert ((nearest - v.double())[rest]).abs().min() >= 0.2 * step  # what SR avoids


def test_hash_is_murmur3_fmix32():
    def fmix32(h):  # https://github.com/aappleby/smhasher/blob/master/src/MurmurHash3.cpp
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    key, start = compact.sr_key(3, 14, 1, 5), 1 << 30
    bits = compact.hash_bits(300, start, key)
    for j in (0, 1, 2, 255, 256, 299):
        assert bits[j].item() & 0xFFFFFFFF == fmix32(((start + j) * 0x9E3779B1 + key) & 0xFFFFFFFF)


def test_master_stochastic_rounding_is_unbiased_and_keyed():
    ulp = 2**-7  # bf16 spacing in [1, 2)
    fractions = torch.tensor([0.05, 0.25, 0.5, 0.9]).repeat_interleave(256)
    x = (1.0 + ulp * (3 + fractions)) * torch.where(torch.arange(1024) % 2 == 0, 1.0, -1.0)
    n, draws = x.numel(), 2000
    s, tmp = compact.Scratch(n), torch.empty(n, dtype=torch.int32)
    hi = torch.empty(n, dtype=torch.bfloat16)

    def rounded(key):
        compact.stochastic_round(x, hi, compact.hash_bits(n, 0, key), tmp, s)
        return hi.double()

    total = torch.zeros(n, dtype=torch.float64)
    for step in range(draws):
        r = rounded(compact.sr_key(0, step, 0, 0))
        lower = x.double().abs().div(ulp).floor().mul(ulp) * x.sign()
        assert ((r == lower) | (r == lower + ulp * x.sign())).all()  # only the two neighbours
        total += r
    mean = total / draws
    f = fractions.double()
    sd = ulp * torch.sqrt(f * (1 - f) / draws)
    assert ((mean - x.double()).abs() <= 5 * sd).all()
    nearest_err = (x.to(torch.bfloat16).double() - x.double()).abs()
    assert (nearest_err[f != 0.5] >= 0.05 * ulp).all()  # round to nearest would be biased
    a, b = rounded(compact.sr_key(7, 3, 1, 2)), rounded(compact.sr_key(7, 3, 1, 2))
    assert torch.equal(a, b)
    assert not torch.equal(a, rounded(compact.sr_key(7, 3, 1, 3)))


# ---------------------------------------------------------------------- training


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    use_path(request.param, monkeypatch)
    return request.param


@pytest.mark.parametrize("moments", MOMENTS)
def test_bf16_split_is_the_fp32_master_bit_for_bit(moments, monkeypatch):
    # The reference is the fp32 master on the same path: torch's fused kernel for fp32 moments
    # (so the torch-ops path, the same kernel on joined halves), either path for 8-bit moments.
    if moments == "fp32":
        use_path("torch-ops", monkeypatch)
    ref_p, split_p = make_params(f"fp32/{moments}"), make_params(f"bf16-split/{moments}")
    kw = dict(accumulation_steps=2, max_grad_norm=5.0, chunk_numel=512, threads=2)
    ref, split = (
        opt_for(ref_p, f"fp32/{moments}", **kw),
        opt_for(split_p, "bf16-split/" + moments, **kw),
    )
    for step in range(5):
        for opt in (ref, split):
            for micro in range(2):
                grads = make_grads(10 * step + micro, torch.bfloat16)
                for b in SHAPES:
                    opt.accumulate(b, grads[b])
            for b in SHAPES:
                opt.step_block(b)
        assert ref.last_grad_norm == split.last_grad_norm
        ref32, split32 = fp32_master(ref, ref_p), fp32_master(split, split_p)
        for key, t in ref32.items():
            assert torch.equal(t, split32[key]), (moments, step, key)


def drifting_problem(n_rows=64, n_cols=32, seed=0):
    """Weights of magnitude in [1.25, 1.75] (bf16 spacing 2**-7 throughout the run) and a fixed
    gradient sequence with a steady component, so every weight drifts one way."""
    g = torch.Generator().manual_seed(seed)
    w0 = (1.25 + 0.5 * torch.rand(n_rows, n_cols, generator=g)) * torch.randn(
        n_rows, n_cols, generator=g
    ).sign()
    w0 = w0.bfloat16().float()
    steady = torch.randn(n_rows, n_cols, generator=g)

    def grad(t):
        noise = torch.randn(n_rows, n_cols, generator=torch.Generator().manual_seed(t))
        return steady + 0.5 * noise

    return w0, grad


@pytest.mark.parametrize("state", ["fp32"] + COMPACT)
def test_tracks_fp64_adamw_within_the_format_bound(state, path):
    steps, lr, ulp = 300, 5e-4, 2**-7
    w0, grad = drifting_problem()
    oracle = torch.nn.Parameter(w0.double())
    topt = torch.optim.AdamW([oracle], lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    path = 0.0  # sum over steps of the update's norm
    w = w0.to(torch.bfloat16 if is_bf16(state) else torch.float32).clone()
    opt = CPUAdamW({0: {"w": w}}, lr=lr, betas=(0.9, 0.999), weight_decay=0.01, state=state)
    for t in range(steps):
        before = oracle.detach().clone()
        oracle.grad = grad(t).double()
        topt.step()
        path += (oracle.detach() - before).norm().item()
        opt.step({0: {"w": grad(t)}})
    final = fp32_master(opt, {0: {"w": w}})[0, "w"].double()
    ref = oracle.detach()
    drift = ref - w0.double()
    err = final - ref
    rms = err.pow(2).mean().sqrt().item()
    bias = (err * drift.sign()).mean().item()  # > 0: moved too far, < 0: not far enough
    n = err.numel()
    assert path <= 1.05 * drift.norm().item()  # a steady drift: the path is the displacement
    assert ((final.abs() >= 1) & (final.abs() < 2)).all()  # one bf16 spacing throughout

    fmt = StateFormat.parse(state)
    # fp32: the master rounded (half an fp32 spacing, 2**-24 in [1, 2)) and the update computed
    # in fp32 (well under another half spacing of the weight) at every step: a spacing per step
    fp32_rms = steps * 2**-23
    master_rms = {"fp32": 0.0, "bf16-split": 0.0, "bf16-sr": ulp * math.sqrt(steps) / 2}
    moments_rel = {"fp32": 0.0, "8bit": 2**-3}
    msg = f"{state}: rms {rms:.3e}, bias {bias:.3e}, drift rms {drift.pow(2).mean().sqrt():.3e}"
    if fmt.master == "bf16":  # the baseline: updates of lr << ulp / 2 are lost entirely
        assert bias <= -0.9 * drift.abs().mean().item(), msg
        return
    bound = master_rms[fmt.master] + moments_rel[fmt.moments] * drift.pow(2).mean().sqrt().item()
    assert rms <= bound + fp32_rms, msg
    # Unbiased: stochastic rounding's mean error is its rms / sqrt(n); the moments' bias must be
    # far below their precision (nearest rounding of sqrt(v) gave -7% of the drift here).
    bias_bound = 5 * master_rms[fmt.master] / math.sqrt(n)
    bias_bound += moments_rel[fmt.moments] / 4 * drift.abs().mean().item()
    assert abs(bias) <= bias_bound + fp32_rms, msg


@pytest.mark.parametrize("state", EIGHT_BIT)
def test_8bit_zero_gradients_leave_weights_unchanged(state, path):
    params = make_params(state)
    before = {(b, n): t.clone() for b, named in params.items() for n, t in named.items()}
    opt = CPUAdamW(params, lr=LR, weight_decay=0.0, state=state)
    for step in range(5):
        grads = make_grads(step)
        for named in grads.values():
            for t in named.values():
                t.view(-1)[1::3] = 0.0  # every third element never sees a gradient
        opt.step(grads)
    for (b, n), t in before.items():
        now = params[b][n].view(-1)
        assert torch.equal(now[1::3], t.view(-1)[1::3]), (b, n)
        assert not torch.equal(now[::3], t.view(-1)[::3])


def train(opt, steps):
    for step in steps:
        opt.lr = LR / (1 + step)
        opt.step(make_grads(step))


@pytest.mark.parametrize("state", COMPACT)
def test_state_dict_round_trip_resumes_bitwise(state, path):
    params = make_params(state)
    opt = opt_for(params, state, chunk_numel=512, seed=5)
    train(opt, range(3))
    buf = io.BytesIO()
    torch.save({"params": params, "opt": opt.state_dict()}, buf)  # serialized: no aliasing
    train(opt, range(3, 6))

    buf.seek(0)
    saved = torch.load(buf)
    resumed_params = saved["params"]
    resumed = opt_for(resumed_params, state, chunk_numel=512, seed=0)
    resumed.load_state_dict(saved["opt"])
    assert resumed.seed == 5 and resumed.num_steps(0) == 3
    train(resumed, range(3, 6))
    for b, named in params.items():
        for n, t in named.items():
            assert torch.equal(resumed_params[b][n], t), (b, n)
    sd, rsd = opt.state_dict(), resumed.state_dict()
    for key in ("m", "v", "codes", "absmax", "lo"):
        for b in SHAPES:
            for n in SHAPES[b] if key in sd else ():
                assert torch.equal(sd[key][b][n], rsd[key][b][n]), (key, b, n)


@pytest.mark.parametrize("state", COMPACT)
def test_threads_and_chunk_size_do_not_change_the_result(state, path):
    results = []
    for threads, chunk in ((1, 256), (3, 512), (2, None)):
        params = make_params(state)
        opt = opt_for(params, state, threads=threads, chunk_numel=chunk)
        assert opt.update_path == path
        for step in range(4):
            opt.step(make_grads(step, torch.bfloat16))
        opt.close()
        results.append(fp32_master(opt, params))
    for other in results[1:]:
        for key, t in results[0].items():
            assert torch.equal(t, other[key]), key
