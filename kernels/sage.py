"""8-bit attention (SageAttention's recipe): Triton forward kernel and the public entry point.

Semantics (both backends; `tests/test_sage.py` checks them):

- `q (B, Nq, heads, D)`, `k, v (B, Nk, heads, D)`: the layout of Wan's attention processor,
  any strides with the last dimension contiguous. Non-causal, no mask: every query attends to
  every key (Wan's self-attention over all video tokens). Any token counts; D a power of two in
  [16, 256] for the Triton backend (Wan: 128; the tiny models: 16-64).
- K is smoothed: its mean over the Nk tokens is subtracted per (batch, head, channel), which
  changes no softmax (`sage_reference.smooth_keys`).
- Q and smoothed K are rounded to int8 with one fp32 scale (`max|x| / 127`) per token of one
  (batch, head) by default, or per group of `groups = (group_q, group_k)` tokens
  (`sage_reference.quantize_int8`; `(128, 64)` is SageAttention's first, per-tile recipe).
- Scores: int8 x int8 products summed in int32, times the query's and the key's scales and the
  softmax scale (`1/sqrt(D)` unless given) in fp32; softmax online in fp32, base 2.
- P V: probabilities and V rounded to fp16 (V with a power-of-two scale per channel when its
  values exceed fp16's range, `sage_reference.values_fp16`), summed in fp32; output in q's dtype.

Layout of the work: the quantization is a few torch operations (one read of Q, K, V, int8 and
fp16 copies written, Q and K padded to whole blocks), shared with the reference, so both backends
read the same int8 tensors. Then one program per (query tile, batch * head) walks all key tiles
(`blocks = (128, 64)` tokens by default), FlashAttention-style: Q's scales are loaded once per
program, K's as one vector per key tile beside its int8 rows, and each int32 score becomes a
logit by two fp32 multiplies.

Caution:
- Inference only: rounding has no useful derivative, so inputs that require a gradient (with
  grad mode on) are rejected. Fine-tuning runs dense or 3D-DSA attention.
- Accuracy is SageAttention's, not SDPA's: cosine similarity >= 0.999 against exact attention
  on Wan-like heads (measured in `benchmarks/sage.py`, held in `tests/test_sage.py`). Nearly all
  the error is the int8 rounding of Q and K (P's and V's fp16 rounding cost next to nothing
  there): it moves logits in proportion to their size, so very peaked rows lose more, and scales
  shared by a whole tile fell short of 0.999 on them where per-token scales meet it
  (docs/benchmarks.md#8-bit-attention). Without smoothing, a channel-wise offset in K (common in
  trained models) sets every scale and the accuracy falls well below that.
- The Triton path is unverified on a GPU (int8 `tl.dot` lowering, head dims below 32 included):
  `benchmarks/sage_cuda_check.py` checks it there.
- Speed is unmeasured: no GPU has run this kernel. The separate torch quantization costs extra
  memory passes that a fused quantization kernel (SageAttention's) avoids; fp8 P V
  (SageAttention 2) is not built.
- Triton's interpreter (`TRITON_INTERPRET=1`) computes int8 dots with the int32 accumulator's
  dtype (checked with Triton 3.9), so the CPU tests run the same int8 code as a GPU.
- Under `torch.compile` the Triton path is a graph break, as 3D-DSA's is.
- Triton is optional at import time: `backend="auto"` then uses the reference (correct, slower
  than SDPA on a CPU: it is the recipe's oracle, not a CPU speed-up).
"""

import torch
from torch import Tensor

from .sage_reference import (
    DEFAULT_BLOCKS,
    DEFAULT_GROUPS,
    check_inputs,
    quantized_operands,
    sage_attention_reference,
)
from .triton_import import TRITON_IMPORT_ERROR, check_attention_inputs, interpreting, tl, triton

# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sage_fwd_kernel(
    Q8, QS, K8, KS, V, VS, O,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_on, stride_oh,
    H, N_Q, N_K, Q_BLOCKS, K_BLOCKS,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):  # fmt: skip
    """O for BLOCK_M queries of one (batch, head) against all N_K keys.

    Q8 (B, H, Q_BLOCKS * BLOCK_M, D) and K8 (B, H, K_BLOCKS * BLOCK_N, D) int8, contiguous and
    zero-padded; QS (B, H, Q_BLOCKS * BLOCK_M), KS (B, H, K_BLOCKS * BLOCK_N) their fp32
    per-token scales (0 on padding); V (B, N_K, H, D)
    fp16 and VS (B, H, D) its fp32 channel scales; O (B, N_Q, H, D) in the output dtype.
    qk_scale is the softmax scale times log2(e), kept in fp32.
    """
    m_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: the (batch, head) offsets below cannot overflow
    b, h = bh // H, bh % H
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = Q8 + bh * Q_BLOCKS * BLOCK_M * HEAD_DIM
    q = tl.load(q_rows + offs_m[:, None] * HEAD_DIM + offs_d[None, :])  # (BLOCK_M, D) int8
    q_scale = tl.load(QS + bh * Q_BLOCKS * BLOCK_M + offs_m) * qk_scale  # (BLOCK_M,) fp32
    K8 += bh * K_BLOCKS * BLOCK_N * HEAD_DIM
    KS += bh * K_BLOCKS * BLOCK_N
    V += b * stride_vb + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n_block in range(0, K_BLOCKS):
        keys = n_block * BLOCK_N + offs_n
        kT = tl.load(K8 + keys[None, :] * HEAD_DIM + offs_d[:, None])  # (D, BLOCK_N) int8
        s = tl.dot(q, kT, out_dtype=tl.int32)  # (BLOCK_M, BLOCK_N): exact integer sums
        k_scale = tl.load(KS + keys)  # (BLOCK_N,) fp32
        s = s.to(tl.float32) * q_scale[:, None] * k_scale[None, :]
        if not EVEN_N:
            s = tl.where(keys[None, :] < N_K, s, float("-inf"))
        # Every key block holds at least one real key, so m_new is finite from the first one.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + keys[:, None] * stride_vn + offs_d[None, :],
            mask=keys[:, None] < N_K,
            other=0.0,
        )  # (BLOCK_N, D) fp16
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])  # fp16 operands, fp32 sums
        m_i = m_new
    v_scale = tl.load(VS + bh * HEAD_DIM + offs_d)  # (D,) powers of two
    acc = acc / l_i[:, None] * v_scale[None, :]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < N_Q)


# (warps, stages) per head dim; the block shape is the quantization's. Under the interpreter the
# first one runs untimed (timing configs through numpy is meaningless).
_CONFIGS = [
    triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 3), (8, 3), (4, 2), (8, 2))
]


def _prune(configs, named_args, **kwargs):
    return configs[:1] if interpreting() else configs


_sage_fwd = triton.autotune(
    _CONFIGS,
    key=["HEAD_DIM", "BLOCK_M", "BLOCK_N"],
    prune_configs_by={"early_config_prune": _prune},
)(_sage_fwd_kernel)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _check_no_grad(q: Tensor, k: Tensor, v: Tensor) -> None:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(
            "sage attention is inference only (int8 rounding has no gradient): run it under "
            "torch.no_grad(), or fine-tune with attention='dense' or 'dsa'"
        )


@torch.compiler.disable  # a graph break under torch.compile, as 3D-DSA's Triton path is
def sage_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    blocks: tuple[int, int] = DEFAULT_BLOCKS,
    groups: tuple[int, int] = DEFAULT_GROUPS,
) -> Tensor:
    """8-bit attention on the Triton kernel; semantics in this module's docstring. `blocks` are
    the kernel's tiles (query, key), `groups` the tokens per int8 scale of Q and K."""
    blocks, groups = tuple(blocks), tuple(groups)
    scale = check_inputs(q, k, v, scale, blocks, groups)
    _check_no_grad(q, k, v)
    check_attention_inputs(q)  # what Triton takes (`check_inputs` has checked the blocks)
    B, Nq, H, D = q.shape
    Nk = k.shape[1]
    block_q, block_k = blocks
    q8, qs, k8, ks, vh, vs = quantized_operands(q, k, v, blocks, groups)
    if vh.stride(-1) != 1:
        vh = vh.contiguous()
    out = torch.empty(B, Nq, H, D, dtype=q.dtype, device=q.device)
    grid = (q8.shape[2] // block_q, B * H)
    args = (q8, qs, k8, ks, vh, vs, out, *vh.stride()[:3], *out.stride()[:3])
    meta = dict(HEAD_DIM=D, BLOCK_M=block_q, BLOCK_N=block_k, EVEN_N=Nk % block_k == 0)
    sizes = (H, Nq, Nk, q8.shape[2] // block_q, k8.shape[2] // block_k)
    qk_scale = scale * 1.4426950408889634  # log2(e): the kernel's softmax is base 2
    if q.is_cuda:
        # Triton launches on the current device; without the guard a tensor on cuda:1 would be
        # read by a kernel running on cuda:0.
        with torch.cuda.device(q.device):
            _sage_fwd[grid](*args, *sizes, qk_scale, **meta)
    else:
        _sage_fwd[grid](*args, *sizes, qk_scale, **meta)
    return out


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def sage_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """8-bit attention over `(B, N, heads, D)` tensors; semantics in this module's docstring.

    `backend`: "triton", "reference", or "auto" (Triton for CUDA tensors when Triton imports
    and takes the head dim, the PyTorch reference otherwise: tiny models' odd head dims still
    run). Inference only.
    """
    if backend == "auto":
        D = q.shape[-1]
        fits = q.is_cuda and TRITON_IMPORT_ERROR is None and 16 <= D <= 256 and not D & (D - 1)
        backend = "triton" if fits else "reference"
    if backend == "triton":
        return sage_triton(q, k, v, scale=scale)
    if backend == "reference":
        _check_no_grad(q, k, v)
        return sage_attention_reference(q, k, v, scale=scale)
    raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
