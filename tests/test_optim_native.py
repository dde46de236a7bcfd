"""The compact formats' fused kernel (compact_kernel.cpp) against the torch-ops path.

Bounds, derived from what the two paths share and where they differ:

* Codes and random bits are the same functions of the same inputs: given equal m and v (betas
  0, where both paths compute m = g and v = g * g exactly rounded), the 8-bit codes and absmax
  are bitwise equal; the hash is bitwise compact.hash_bits.
* The AdamW arithmetic is torch's vectorized loop, operation for operation; torch runs a scalar
  loop on the last few elements of each tensor piece, which may round v (and, on other builds,
  m) differently by an ulp. From the same state, one step of the two paths therefore gives:
  m and v within 1 ulp; the update u within a few ulps of itself (sqrt, two divisions), so the
  fp32 master within 1 ulp of the result plus 2**-20 |u|; a bf16 master within one bf16 spacing
  (the same random bits, but an fp32 value an ulp apart may round to the other neighbour); an
  absmax within 1 ulp and each 8-bit code within one code step.

Determinism of the kernel against itself (resume, thread count, chunk size) is tested with the
torch-ops path in test_optim_compact.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from native_kernel import require_kernel
from test_optim_compact import COMPACT, EIGHT_BIT, fp32_master, make_grads, make_params, opt_for

from megaslide.engine.training import compact, compact_kernel
from megaslide.engine.training.optim import CPUAdamW


@pytest.fixture
def kernel():
    return require_kernel()


def twin_on_torch_ops(opt: CPUAdamW, params, monkeypatch, **kw):
    """A torch-ops optimizer with a copy of `opt`'s masters and state."""
    twin_params = {b: {n: t.clone() for n, t in named.items()} for b, named in params.items()}
    with monkeypatch.context() as mp:
        mp.setenv("MEGASLIDE_NATIVE_OPTIM", "0")
        twin = opt_for(twin_params, opt.format.name, **kw)
    assert twin.update_path == "torch-ops"
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    return twin, twin_params


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing at |x| (float64), the smallest normal's for tiny x."""
    x = x.float().abs().clamp(min=torch.finfo(torch.float32).tiny)
    return (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()


def signed_code(codes: torch.Tensor) -> torch.Tensor:
    """m's codes as signed integers: magnitude code, negative with the sign bit."""
    c = codes.long()
    return torch.where(c >= 128, -(c - 128), c)


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulated-clipped"])
@pytest.mark.parametrize("state", COMPACT)
def test_one_step_matches_torch_ops_within_the_derived_bound(
    state, accumulate, kernel, monkeypatch
):
    params = make_params(state)
    kw = dict(chunk_numel=512, threads=2, seed=3)
    if accumulate:  # the gradient divided by k / clip coefficient in the kernel
        kw.update(accumulation_steps=2, max_grad_norm=1.0)
    opt = opt_for(params, state, **kw)
    assert opt.update_path == "native"
    fmt = opt.format
    exact, total = 0, 0
    for step in range(4):
        twin, twin_params = twin_on_torch_ops(opt, params, monkeypatch, **kw)
        before = fp32_master(opt, params)
        dtype = (torch.float32, torch.bfloat16, torch.float32, torch.float16)[step]  # fp16: widened
        grads = make_grads(step, dtype)
        for o in (opt, twin):
            if accumulate:
                for b, g in make_grads(100 + step).items():
                    o.accumulate(b, g)
            o.step(grads)
        if accumulate:
            assert opt.last_grad_norm == twin.last_grad_norm > 1.0  # clipped
        ours, ref = fp32_master(opt, params), fp32_master(twin, twin_params)
        for key, r in ref.items():
            o, r = ours[key].double(), r.double()
            exact += int((o == r).sum())
            total += r.numel()
            if fmt.master in ("fp32", "bf16-split"):
                decay = 1 - opt.lr * opt.weight_decay if before[key].ndim >= 2 else 1.0
                u = (r - before[key].double() * decay).abs()
                bound = ulp(r) + 2**-20 * u
            else:  # one bf16 spacing at the larger of the two
                bound = 2.0 ** (torch.frexp(torch.maximum(o.abs(), r.abs()))[1] - 8).double()
            assert ((o - r).abs() <= bound).all(), (state, step, key)
        sd, rsd = opt.state_dict(), twin.state_dict()
        for b, named in params.items():
            for n in named:
                if fmt.moments == "fp32":
                    for k in ("m", "v"):
                        o, r = sd[k][b][n], rsd[k][b][n]
                        assert ((o - r).abs().double() <= ulp(r)).all(), (state, step, k, n)
                else:
                    o, r = sd["absmax"][b][n], rsd["absmax"][b][n]
                    assert ((o - r).abs().double() <= ulp(r)).all(), (state, step, n)
                    oc, rc = sd["codes"][b][n], rsd["codes"][b][n]
                    assert (signed_code(oc[0]) - signed_code(rc[0])).abs().max() <= 1
                    assert (oc[1].long() - rc[1].long()).abs().max() <= 1
    # The paths may differ only in torch's scalar tails, at most 15 elements per tensor (its
    # vectors are at most 16 wide): every other element must be bitwise equal.
    tensors = sum(len(named) for named in params.values())
    numel = sum(t.numel() for named in params.values() for t in named.values())
    print(f"{state}: {exact / total:.4f} of the masters bitwise equal to the torch-ops path")
    assert exact / total >= 1 - 15 * tensors / numel


@pytest.mark.parametrize("state", EIGHT_BIT)
def test_codes_are_bitwise_the_torch_ops_codes(state, kernel, monkeypatch):
    # betas 0: m = g and v = g * g, rounded once in both paths, so the codec and the random bits
    # alone decide the codes.
    params = make_params(state)
    kw = dict(chunk_numel=512, threads=2, seed=7)
    opt = CPUAdamW(params, lr=1e-3, betas=(0.0, 0.0), weight_decay=0.0, state=state, **kw)
    with monkeypatch.context() as mp:
        mp.setenv("MEGASLIDE_NATIVE_OPTIM", "0")
        twin_params = {b: {n: t.clone() for n, t in d.items()} for b, d in params.items()}
        twin = CPUAdamW(twin_params, lr=1e-3, betas=(0.0, 0.0), weight_decay=0.0, state=state, **kw)
    for step in range(3):
        grads = make_grads(step)
        opt.step(grads)
        twin.step(grads)
        sd, rsd = opt.state_dict(), twin.state_dict()
        for key in ("codes", "absmax"):
            for b, named in params.items():
                for n in named:
                    assert torch.equal(sd[key][b][n], rsd[key][b][n]), (step, key, b, n)
        twin.load_state_dict(copy.deepcopy(sd))  # the masters may differ in a tail's last bit
        for b, named in params.items():
            for n, t in named.items():
                twin_params[b][n].copy_(t)


def test_hash_is_bitwise_compact_hash_bits(kernel):
    for start, key in ((0, 0), (256, 12345), ((1 << 32) - 300, 0xDEADBEEF), (1 << 40, 1)):
        ours = kernel.hash_bits(1000, start, key)
        assert torch.equal(ours, compact.hash_bits(1000, start, key)), (start, key)


def test_paths_and_the_switch(kernel, monkeypatch):
    params = make_params("bf16-sr/8bit")
    assert opt_for(make_params("fp32"), "fp32").update_path == "torch-fused"
    assert opt_for(params, "bf16-sr/8bit").update_path == "native"
    monkeypatch.setenv("MEGASLIDE_NATIVE_OPTIM", "0")
    assert compact_kernel.load() is None
    assert "MEGASLIDE_NATIVE_OPTIM=0" in compact_kernel.unavailable_reason()
    opt = opt_for(params, "bf16-sr/8bit")
    assert opt.update_path == "torch-ops" and opt.chunk_numel == 1 << 17


def test_a_missing_compiler_falls_back_to_torch_ops(tmp_path, monkeypatch):
    reason = compact_kernel.build(tmp_path, "no-such-compiler-megaslide")
    assert isinstance(reason, str) and "not found" in reason
    monkeypatch.setenv("CXX", "no-such-compiler-megaslide")
    monkeypatch.setenv("MEGASLIDE_NATIVE_CACHE", str(tmp_path))
    assert compact_kernel.load() is None and "not found" in compact_kernel.unavailable_reason()
    params = make_params("bf16-split/8bit")
    opt = opt_for(params, "bf16-split/8bit")
    assert opt.update_path == "torch-ops"
    opt.step(make_grads(0))  # and it trains


@pytest.mark.slow  # runs the compiler
def test_build_from_scratch_and_from_the_cache(tmp_path):
    compiler = os.environ.get("CXX", "g++")
    built = compact_kernel._build(tmp_path, compiler)
    if isinstance(built, str):
        if os.environ.get("MEGASLIDE_REQUIRE_NATIVE") == "1":
            pytest.fail(built)
        pytest.skip(built)
    print(f"compact kernel built in {built.build_s:.1f} s")
    assert built.build_s > 0 and built.path.parent == tmp_path
    again = compact_kernel._build(tmp_path, compiler)
    assert again.path == built.path and again.build_s == 0  # found in the cache
    assert [p.name for p in tmp_path.iterdir()] == [built.path.name]  # no temporary left
    assert torch.equal(again.hash_bits(300, 5, 9), compact.hash_bits(300, 5, 9))
