"""CPUAdamW against torch.optim.AdamW, step by step, and its block / resume / copy guarantees.

Relative difference here is per tensor, max|ours - torch| / max|torch|. (Element-wise ratios are
dominated by parameters that happen to be near zero: torch's own fused and foreach AdamW differ by
~2e-6 element-wise on these tensors, with both correct to the last bit or two of the update.)
"""

from __future__ import annotations

import io

import pytest
import torch

from megaslide.engine.training.optim import (
    CPUAdamW,
    clipping_extra_bytes,
    grad_buffer_bytes,
)

# Two "blocks" like a transformer's: matrices (decayed), and 1-D norms/biases (not decayed).
# Odd sizes exercise the kernel's scalar tail; chunk_numel=256 below splits and packs tensors.
SHAPES = {
    0: {"attn.w": (64, 48), "attn.b": (48,), "norm.scale": (48,)},
    1: {"mlp.w1": (33, 17), "mlp.b1": (17,), "mlp.w2": (17, 33), "emb": (1000,)},
}
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
TOL = 1e-6


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        b: {n: torch.randn(s, generator=g) for n, s in named.items()} for b, named in SHAPES.items()
    }


def make_grads(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + seed)
    return {
        b: {n: torch.randn(s, generator=g).to(dtype) for n, s in named.items()}
        for b, named in SHAPES.items()
    }


def clone(tree):
    return {b: {n: t.clone() for n, t in named.items()} for b, named in tree.items()}


def flat(tree):
    return {(b, n): t for b, named in tree.items() for n, t in named.items()}


def torch_reference(params, **kw):
    """torch.optim.AdamW on copies of `params`, with the same groups: decay on ndim >= 2."""
    ref = {k: torch.nn.Parameter(t.clone()) for k, t in flat(params).items()}
    groups = [
        {"params": [p for p in ref.values() if p.ndim >= 2], "weight_decay": WD},
        {"params": [p for p in ref.values() if p.ndim < 2], "weight_decay": 0.0},
    ]
    return ref, torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **kw)


def rel_diff(ours, ref) -> float:
    return max(
        ((ours[k] - ref[k].detach()).abs().max() / ref[k].detach().abs().max()).item() for k in ref
    )


def assert_close(ours_tree, ref):
    d = rel_diff(flat(ours_tree), ref)
    assert d <= TOL, f"max relative difference {d:.3e} > {TOL}"


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_matches_torch_adamw_step_by_step(impl):
    params = make_params()
    ours_p = clone(params)
    ref, topt = torch_reference(
        params,
        **{"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[
            impl
        ],
    )
    opt = CPUAdamW(ours_p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, chunk_numel=256)
    for step in range(6):
        lr = LR * (1 - step / 10)  # a schedule: lr changes between steps
        opt.lr = lr
        for group in topt.param_groups:
            group["lr"] = lr
        grads = make_grads(step)
        for k, p in ref.items():
            p.grad = flat(grads)[k].clone()
        topt.step()
        opt.step(grads)
        if impl == "fused":  # the same kernel on the same numbers: bitwise
            for k, p in ref.items():
                assert torch.equal(flat(ours_p)[k], p.detach()), (step, k)
        else:
            assert_close(ours_p, ref)


def test_gradient_accumulation():
    k = 3
    params = make_params()
    ours_p = clone(params)
    ref, topt = torch_reference(params, foreach=True)
    opt = CPUAdamW(
        ours_p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, accumulation_steps=k, chunk_numel=256
    )
    for step in range(4):
        micro = [make_grads(10 * step + i) for i in range(k)]
        # torch convention: (loss / k).backward() per micro-batch, .grad accumulates
        for key, p in ref.items():
            p.grad = None
            for g in micro:
                contrib = flat(g)[key] / k
                p.grad = contrib.clone() if p.grad is None else p.grad + contrib
        topt.step()
        for b in SHAPES:  # blocks arrive one by one; the last micro-batch goes to step_block
            for g in micro[:-1]:
                opt.accumulate(b, g[b])
        for b in reversed(SHAPES):
            opt.step_block(b, micro[-1][b])
        assert_close(ours_p, ref)
        assert opt.num_steps(0) == step + 1


@pytest.mark.parametrize("k", [1, 2])
def test_global_norm_clipping(k):
    max_norm = 1.0  # the gradients' norm is ~50: clipping is active
    params = make_params()
    ours_p = clone(params)
    ref, topt = torch_reference(params, foreach=True)
    opt = CPUAdamW(
        ours_p,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        accumulation_steps=k,
        max_grad_norm=max_norm,
        chunk_numel=256,
    )
    for step in range(4):
        micro = [make_grads(10 * step + i) for i in range(k)]
        for key, p in ref.items():
            p.grad = sum(flat(g)[key] for g in micro) / k
        total = torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm)
        topt.step()
        for g in micro:
            for b in SHAPES:
                opt.accumulate(b, g[b])
        for b in reversed(SHAPES):
            opt.step_block(b)
        assert abs(opt.last_grad_norm - total.item()) <= TOL * total.item()
        assert_close(ours_p, ref)


def test_clipping_inactive_is_bitwise_torch_fused():
    params = make_params()
    ours_p = clone(params)
    ref, topt = torch_reference(params, fused=True)
    opt = CPUAdamW(ours_p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=1e6)
    for step in range(3):
        grads = make_grads(step)
        for key, p in ref.items():
            p.grad = flat(grads)[key].clone()
        topt.step()
        opt.step(grads)
    for key, p in ref.items():
        assert torch.equal(flat(ours_p)[key], p.detach())


def test_clipping_needs_every_block_and_refuses_nonfinite():
    params = make_params()
    opt = CPUAdamW(params, max_grad_norm=1.0)
    grads = make_grads(0)
    opt.accumulate(0, grads[0])
    with pytest.raises(RuntimeError, match="every block"):
        opt.step_block(0)
    with pytest.raises(ValueError, match="accumulate"):
        opt.step_block(1, grads[1])
    grads[1]["emb"][3] = float("inf")
    opt.accumulate(1, grads[1])
    before = clone(params)
    with pytest.raises(FloatingPointError):
        opt.step_block(0)
    for key, t in flat(before).items():
        assert torch.equal(flat(params)[key], t)


def run_blocks(block_of, order, threads, chunk_numel, steps=4):
    """Train with the given block assignment; return the final masters by name."""
    params = flat(make_params())
    blocks: dict = {}
    for key, t in params.items():
        blocks.setdefault(block_of(key), {})[key[1]] = t
    opt = CPUAdamW(
        blocks,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        threads=threads,
        chunk_numel=chunk_numel,
    )
    for step in range(steps):
        grads = {key[1]: g for key, g in flat(make_grads(step)).items()}
        for b in order(list(blocks)):
            opt.step_block(b, {n: grads[n] for n in blocks[b]})
    opt.close()
    return {key[1]: t for key, t in params.items()}


def test_per_block_updates_equal_whole_model_update():
    whole = run_blocks(lambda key: "all", list, threads=1, chunk_numel=1 << 16)
    per_tensor = run_blocks(lambda key: key[1], lambda ids: ids[::-1], threads=2, chunk_numel=128)
    per_block = run_blocks(lambda key: key[0], lambda ids: ids[::-1], threads=3, chunk_numel=256)
    for name in whole:
        assert torch.equal(whole[name], per_tensor[name]), name
        assert torch.equal(whole[name], per_block[name]), name


def test_state_dict_round_trip_resumes_bitwise(tmp_path):
    def train(opt, steps):
        for step in steps:
            opt.lr = LR / (1 + step)
            opt.step(make_grads(step))

    params = make_params()
    opt = CPUAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, chunk_numel=256)
    train(opt, range(3))
    buf = io.BytesIO()
    torch.save({"params": params, "opt": opt.state_dict()}, buf)  # serialized: no aliasing
    train(opt, range(3, 6))

    buf.seek(0)
    saved = torch.load(buf)
    resumed_params = saved["params"]
    resumed = CPUAdamW(resumed_params, lr=123.0, betas=BETAS, eps=EPS, weight_decay=WD)
    resumed.load_state_dict(saved["opt"])
    assert resumed.num_steps(1) == 3 and resumed.lr == opt.lr * 0 + LR / 3
    train(resumed, range(3, 6))
    for key, t in flat(params).items():
        assert torch.equal(flat(resumed_params)[key], t), key
    sd, rsd = opt.state_dict(), resumed.state_dict()
    for b in SHAPES:
        for n in SHAPES[b]:
            assert torch.equal(sd["m"][b][n], rsd["m"][b][n])
            assert torch.equal(sd["v"][b][n], rsd["v"][b][n])


def test_state_dict_refused_mid_accumulation():
    opt = CPUAdamW(make_params(), accumulation_steps=2)
    opt.accumulate(0, make_grads(0)[0])
    with pytest.raises(RuntimeError, match="between optimizer steps"):
        opt.state_dict()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_dtype_copy_equals_master_cast(dtype):
    params = make_params()
    opt = CPUAdamW(params, lr=LR, weight_decay=WD, chunk_numel=256, threads=2)
    out = {
        b: {n: torch.empty(s, dtype=dtype) for n, s in named.items()} for b, named in SHAPES.items()
    }
    for b in SHAPES:
        opt.copy_params(b, out[b])
        for n in SHAPES[b]:
            assert torch.equal(out[b][n], params[b][n].to(dtype))
    for step in range(3):
        opt.step(make_grads(step), out=out)
        for b in SHAPES:
            for n in SHAPES[b]:
                assert torch.equal(out[b][n], params[b][n].to(dtype)), (step, b, n)


@pytest.mark.parametrize("k", [1, 2])
def test_low_precision_grads_widen_exactly(k):
    a, b = make_params(), make_params()
    opt_a = CPUAdamW(a, chunk_numel=256, accumulation_steps=k)
    opt_b = CPUAdamW(b, chunk_numel=256, accumulation_steps=k)
    for step in range(3):
        for i in range(k):
            g16 = make_grads(10 * step + i, torch.bfloat16)
            g16[1]["emb"] = g16[1]["emb"].float()  # mixed dtypes within one chunk
            g32 = {blk: {n: t.float() for n, t in named.items()} for blk, named in g16.items()}
            for opt, g in ((opt_a, g16), (opt_b, g32)):
                if i < k - 1:
                    for blk in SHAPES:
                        opt.accumulate(blk, g[blk])
                else:
                    opt.step(g)
    for key, t in flat(a).items():
        assert torch.equal(t, flat(b)[key])


def test_input_validation():
    params = make_params()
    opt = CPUAdamW(params, accumulation_steps=2)
    grads = make_grads(0)
    with pytest.raises(RuntimeError, match="0 of 2"):
        opt.step_block(0)
    bad = dict(grads[0])
    bad["attn.w"] = bad["attn.w"].t()
    with pytest.raises(ValueError, match="shape"):
        opt.accumulate(0, bad)
    bad = dict(grads[0])
    del bad["attn.b"]
    with pytest.raises(ValueError, match="missing"):
        opt.accumulate(0, bad)
    with pytest.raises(ValueError, match="fp32"):
        CPUAdamW({0: {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}})
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdamW({0: {"w": torch.zeros(4, 4).t()}})


def test_threads_setting_stays_local():
    before = torch.get_num_threads()
    opt = CPUAdamW(make_params(), threads=2)
    assert torch.get_num_threads() == before
    seen = opt._pool.submit(torch.get_num_threads).result()
    assert seen == 1  # workers run torch ops single-threaded
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step(make_grads(0))


def test_memory_accounting():
    n = 10**9
    assert grad_buffer_bytes(n) == 0
    assert grad_buffer_bytes(n, accumulation_steps=4) == 4 * n
    assert grad_buffer_bytes(n, max_grad_norm=1.0) == 4 * n
    assert clipping_extra_bytes(n) == 4 * n
    assert clipping_extra_bytes(n, accumulation_steps=2) == 0
