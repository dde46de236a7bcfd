"""The fused fp8 slot decode (kernels/fp8_decode.py) against `fp8_dequantize`, bitwise.

The Triton kernel runs under TRITON_INTERPRET=1 in a subprocess (see tests/test_dsa.py for why a
subprocess): every e4m3fn byte, exponents across their range, odd shapes, three output dtypes,
and a whole fp8-coded block decoded by `Fp8Codec` through it (raw tensors included).
"""

from __future__ import annotations

import pytest
import torch

from megaslide.kernels import fp8_decode

from interpreted import interpreted_results, worker_main

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _weights(g: torch.Generator, extremes: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q bytes, int8 exponents) of weights of odd shapes: every byte value, scales from 2**-20
    to 2**3, plus (`extremes`) every byte value at the exponents' ends (2**-126: fp32
    subnormals; 2**127: overflow to infinity)."""
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    shapes = [(16, 16), (37, 300), (5, 3), (17, 513)]
    out = []
    for i, (rows, cols) in enumerate(shapes):
        q = every.clone() if i == 0 else torch.randint(0, 256, (rows, cols), generator=g)
        e = torch.randint(-20, 4, (rows,), generator=g)
        out.append((q.to(torch.uint8), e.to(torch.int8)))
    if extremes:
        out.append((every.clone(), torch.tensor([-126, 127] * 8, dtype=torch.int8)))
    return out


def _reference(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from megaslide.engine.streaming.weight_formats import fp8_dequantize

    return fp8_dequantize(q.view(torch.float8_e4m3fn), e, dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, NaNs by position (their payloads and signs carry nothing: a weight is never one)."""
    nan = a.isnan()
    bits = torch.int16 if a.itemsize == 2 else torch.int32
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def _interpret_worker() -> None:
    import json

    from megaslide.engine.streaming.host_store import collect_tensors
    from megaslide.engine.streaming.weight_formats import EncodedBlockStore, codec

    g = torch.Generator().manual_seed(0)
    results = {}
    for name, dtype in DTYPES.items():
        # The interpreter's fp32 -> bf16 cast rounds fp32 subnormals wrongly (numpy's, not the
        # GPU's): the exponents' ends are checked in fp32 and fp16 only.
        weights = _weights(g, extremes=dtype != torch.bfloat16)
        # One payload: the parts laid out back to back, as a store's staging holds them.
        flat = torch.cat([t.view(torch.uint8).reshape(-1) for q, e in weights for t in (q, e)])
        views, at = [], 0
        for q, e in weights:
            qv = flat[at : at + q.numel()].view(q.shape)
            at += q.numel()
            views.append((qv, flat[at : at + e.numel()].view(torch.int8)))
            at += e.numel()
        offsets, total = [], 0
        for q, _ in views:
            offsets.append(total)
            total += q.numel()
        out = torch.full((total * dtype.itemsize,), 0x5A, dtype=torch.uint8)
        fp8_decode.fp8_rows_decode([(q, e, o) for (q, e), o in zip(views, offsets)], out, dtype)
        typed = out.view(dtype)
        results[name] = all(
            _same(typed[o : o + q.numel()].view(q.shape), _reference(q, e, dtype))
            for (q, e), o in zip(weights, offsets)
        )
    # A block coded by the fp8 codec: linears, a bias, a norm's weight; decoded fused.
    block = torch.nn.Sequential(
        torch.nn.Linear(40, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 40)
    )
    block = block.to(torch.bfloat16)
    original = {n: p.detach().clone() for n, p in block.named_parameters()}
    store = EncodedBlockStore.adopt(collect_tensors(block), codec("fp8"))
    slot = torch.zeros(store.nbytes, dtype=torch.uint8)
    store.decode(store.payload, slot)
    decoded = {e.names[0]: e.view(slot) for e in store.entries}
    unfused = torch.zeros_like(slot)
    results["block"] = fp8_decode.fp8_decode_available(slot.device) and all(
        torch.equal(decoded[n], original[n]) for n in ("0.bias", "1.weight", "1.bias", "2.bias")
    )
    # The per-weight path on the same payload gives the same bytes.
    parts = [p.view(store.payload) for p in store.parts]
    it = iter(parts)
    for kept in store.meta[1]:
        entry = store.entries[kept.k]
        taken = [next(it) for _ in range(kept.nparts)]
        if kept.how == "raw":
            unfused[entry.offset : entry.offset + entry.nbytes].copy_(taken[0])
        else:
            entry.view(unfused).copy_(_reference(taken[0].view(entry.shape), taken[1], entry.dtype))
    results["block_same_bytes"] = bool(torch.equal(slot, unfused))
    print("RESULTS " + json.dumps(results))


@pytest.mark.slow  # the interpreter in a subprocess
def test_fused_decode_is_bitwise_the_per_weight_dequantize():
    results = interpreted_results(__file__, fp8_decode.TRITON_IMPORT_ERROR)
    assert results == {"fp32": True, "bf16": True, "fp16": True, "block": True,
                       "block_same_bytes": True}  # fmt: skip


def test_fused_decode_refuses_what_it_cannot_run():
    q, e = torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, dtype=torch.int8)
    out = torch.zeros(64, dtype=torch.uint8)
    if not fp8_decode.fp8_decode_available(out.device):  # the CPU without the interpreter
        try:
            fp8_decode.fp8_rows_decode([(q, e, 0)], out, torch.float32)
        except RuntimeError as exc:
            assert "TRITON_INTERPRET=1" in str(exc)
        else:
            raise AssertionError("decoded on a device it cannot run on")
    fp8_decode.fp8_rows_decode([], out, torch.float32)  # nothing to do: no launch, no error


if __name__ == "__main__":
    worker_main(_interpret_worker)
