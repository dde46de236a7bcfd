"""DFloat (lossless bf16): code properties, bitwise round trips, and Triton decode vs reference.

Round trips run on weights with trained statistics: the packaged default model's weights in
bf16 (random init has other exponent statistics), plus words chosen to break a careless decoder
(NaN payloads, infinities, signed zeros, subnormals, every exponent). The Triton kernel runs under
TRITON_INTERPRET=1 in a subprocess (see tests/test_dsa.py for why a subprocess).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megaslide.kernels.dfloat import dfloat_decode
from megaslide.kernels.dfloat_reference import (
    LANES,
    MAX_CODE_BITS,
    SYMBOLS,
    canonical_codes,
    code_lengths,
    dfloat_decode_buffer,
    dfloat_encode,
)

from interpreted import interpreted_results

DEFAULT_MODEL = os.path.join(
    os.path.dirname(__file__), "..", "engine", "assets", "models", "megaslide-tiny"
)


def trained_weights() -> dict[str, torch.Tensor]:
    """The default model's DiT weights (trained here), in bf16."""
    sd = load_file(os.path.join(DEFAULT_MODEL, "model.safetensors"))
    return {k: v.to(torch.bfloat16).reshape(-1) for k, v in sd.items()}


def hard_words() -> torch.Tensor:
    """Every exponent with random signs and mantissas, and the special values, as bf16 bits."""
    g = torch.Generator().manual_seed(0)
    exps = torch.arange(256, dtype=torch.int32).repeat(5)
    mant = torch.randint(0, 128, exps.shape, generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, exps.shape, generator=g, dtype=torch.int32)
    words = (sign << 15) | (exps << 7) | mant
    special = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x807F])
    return torch.cat([words, special.to(torch.int32)]).to(torch.int16)  # wraps to two's complement


def cases() -> dict[str, torch.Tensor]:
    w = trained_weights()
    big = max(w, key=lambda k: w[k].numel())
    g = torch.Generator().manual_seed(1)
    return {
        "trained_largest": w[big],
        "trained_all": torch.cat(list(w.values())),
        "hard_words": hard_words(),
        "one_word": torch.tensor([1.5], dtype=torch.bfloat16),
        "one_exponent": torch.full((3000,), -2.0, dtype=torch.bfloat16),
        "group_plus_one": (torch.randn(LANES * SYMBOLS + 1, generator=g) * 0.02).bfloat16(),
        "fp32_bytes": torch.randn(777, generator=g),  # any dtype: coded as 16-bit words
    }


@pytest.mark.parametrize("name", list(cases()))
def test_reference_round_trip_is_bitwise(name):
    x = cases()[name]
    coded = dfloat_encode(x)
    back = dfloat_decode_buffer(coded)
    original = x.view(torch.uint8)
    diff = (back != original).nonzero()
    assert torch.equal(back, original), f"{diff.numel()} bytes differ, first at {diff[:4].tolist()}"


def test_code_lengths_are_bounded_and_prefix_free():
    rng = np.random.default_rng(0)
    # Geometric counts: an unbounded Huffman code would need lengths up to ~40 bits.
    counts = np.zeros(256, dtype=np.int64)
    counts[:60] = (2.0 ** np.arange(60, 0, -1) // 2**20).astype(np.int64) + 1
    counts[100:110] = rng.integers(1, 5, 10)
    lengths = code_lengths(counts)
    seen = counts > 0
    assert lengths[seen].min() >= 1 and lengths.max() <= MAX_CODE_BITS
    assert (lengths[~seen] == 0).all()
    kraft = (2.0 ** -lengths[seen]).sum()
    assert kraft <= 1.0  # a prefix code exists with these lengths
    codes = canonical_codes(lengths)
    words = [format(int(codes[s]), f"0{lengths[s]}b") for s in np.flatnonzero(seen)]
    for a in words:
        assert sum(b.startswith(a) for b in words) == 1, f"{a} is a prefix of another code"


def test_trained_weights_compress():
    """A sanity check that the coder codes (the goal, <= 0.72x, lives in the benchmark)."""
    w = trained_weights()
    raw = sum(v.numel() * 2 for v in w.values())
    coded = sum(dfloat_encode(v).nbytes for v in w.values())
    assert coded / raw < 0.8, coded / raw


def test_bad_input_is_refused_with_a_message():
    with pytest.raises(ValueError, match="odd"):
        dfloat_encode(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CPU"):
        dfloat_encode(torch.zeros(4, dtype=torch.uint8, device="meta"))
    coded = dfloat_encode(torch.randn(100).bfloat16())
    with pytest.raises(ValueError, match="sm has"):
        dfloat_decode(*coded.parts(), torch.empty(99, dtype=torch.int16))
    sm, table, offsets, stream = coded.parts()
    with pytest.raises(ValueError, match="lane_offsets"):
        dfloat_decode(sm, table, offsets.long(), stream, torch.empty(100, dtype=torch.int16))


# ---------------------------------------------------------------------------------------------
# The Triton kernel under the interpreter


def _interpret_worker() -> None:
    from megaslide.kernels.dfloat import dfloat_triton
    from megaslide.kernels.dfloat_reference import dfloat_decode_reference

    results = {}
    for name, x in cases().items():
        if x.numel() > 20_000:  # the interpreter runs numpy per step: keep it to a few groups
            x = x[:20_000]
        coded = dfloat_encode(x)
        out = torch.full((coded.num_words,), 0x5A5A, dtype=torch.int16)
        dfloat_triton(*coded.parts(), out)
        ref = torch.empty_like(out)
        dfloat_decode_reference(*coded.parts(), ref)
        original = x.reshape(-1).view(torch.int16)
        results[name] = {
            "equals_original": bool(torch.equal(out, original)),
            "equals_reference": bool(torch.equal(out, ref)),
            "words": coded.num_words,
        }
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpret_results():
    from megaslide.kernels import dfloat

    return interpreted_results(__file__, dfloat.TRITON_IMPORT_ERROR)


@pytest.mark.parametrize("name", list(cases()))
def test_triton_decode_matches_reference_and_original(interpret_results, name):
    res = interpret_results[name]
    assert res["equals_original"] and res["equals_reference"], res


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpret-worker"]:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        _interpret_worker()
    else:
        sys.exit(f"usage: TRITON_INTERPRET=1 {sys.argv[0]} --interpret-worker")
