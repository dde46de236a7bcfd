"""Fine-tune deltas: bitwise round trips both ways, the format's forms, storage, validation, and
the Triton kernel against the reference.

Pairs (base, tuned) look like fine-tunes: Gaussian weights moved by Adam-like updates of a small
fraction of their RMS, with sign flips across zero and special values (NaN payloads, infinities,
signed zeros) on either side, in bf16, fp16 and fp32, at sizes that are not multiples of a lane
group. The Triton kernel runs under TRITON_INTERPRET=1 in a subprocess (see tests/test_dsa.py
for why a subprocess); integer arithmetic only, so the interpreter is exact.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load, save

from megaslide.kernels.delta import delta_apply, delta_apply_, delta_apply_triton
from megaslide.kernels.delta_reference import (
    BIAS,
    PARTS,
    SPARSE_NBYTES,
    DeltaBuffer,
    delta_apply_reference,
    delta_encode,
)
from megaslide.kernels.lane_code import LANES, SYMBOLS, lane_position

from interpreted import interpreted_results, worker_main

GROUP = LANES * SYMBOLS  # words per lane group


def fine_tune(n: int, dtype: torch.dtype, fraction: float, seed: int) -> tuple[torch.Tensor, ...]:
    """(base, tuned): weights of std 0.02 and an update of `fraction` of their RMS, with a few
    sign flips and special values on either side."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g) * 0.02
    tuned = base + torch.randn(n, generator=g) * fraction * 0.02
    flip = torch.randint(0, n, (max(1, n // 100),), generator=g)
    tuned[flip] = -base[flip] * 0.5  # crosses zero
    base, tuned = base.to(dtype), tuned.to(dtype)
    if n >= 8:
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
        base[:4] = specials
        tuned[4:8] = specials
        tuned[0] = 0.0  # nan -> 0
        base[7] = 0.0  # 0 -> -0.0: a delta of 0x8000 or 0x80000000
    return base, tuned


def nan_payloads() -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 NaNs with different payloads and signs: words apart by small and large amounts."""
    base = torch.tensor([0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x7FFF, 0x0001] * 50, dtype=torch.int32)
    tuned = base.flip(0)
    return (base.to(torch.int16).view(torch.bfloat16), tuned.to(torch.int16).view(torch.bfloat16))


def boundaries() -> tuple[torch.Tensor, torch.Tensor]:
    """Random int16 words moved by every delta around the symbol window's edges, and by 2**15."""
    g = torch.Generator().manual_seed(3)
    edges = list(range(-BIAS - 3, -BIAS + 3)) + list(range(BIAS - 2, BIAS + 4)) + [-(2**15)]
    deltas = torch.tensor(edges * 400 + [0, 1, -1] * 4000, dtype=torch.int32)
    base = torch.randint(-(2**15), 2**15, deltas.shape, generator=g, dtype=torch.int32)
    tuned = (base + deltas).to(torch.int16)  # wraps mod 2**16
    return base.to(torch.int16), tuned


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    big = torch.randn(GROUP * 2 + 5, generator=g).bfloat16()
    few_changed = big.clone()
    few_changed[::1000] = few_changed[::1000] * 2
    return {
        "bf16_1pct": fine_tune(GROUP * 2 + 123, torch.bfloat16, 0.01, 0),
        "bf16_0.3pct_2d": tuple(t.reshape(-1, 7) for t in fine_tune(7 * 1500, torch.bfloat16, 0.003, 1)),
        "fp16_1pct": fine_tune(GROUP + 1, torch.float16, 0.01, 2),
        "fp32_1pct": fine_tune(3001, torch.float32, 0.01, 4),
        "nan_payloads": nan_payloads(),
        "boundaries": boundaries(),
        "untouched": (big, big.clone()),
        "few_changed": (big, few_changed),
        "one_word": (torch.tensor([1.5]).bfloat16(), torch.tensor([1.5078125]).bfloat16()),
        "three_words": fine_tune(3, torch.bfloat16, 0.03, 5),
        "empty": (torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.bfloat16)),
    }  # fmt: skip


def words(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16).clone()


def assert_words_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got != want).nonzero().reshape(-1)
    assert diff.numel() == 0, f"{diff.numel()} words differ, first at {diff[:4].tolist()}"


@pytest.mark.parametrize("name", list(cases()))
def test_reference_round_trip_is_bitwise_both_ways(name):
    base, tuned = cases()[name]
    coded = delta_encode(base, tuned)
    assert coded.num_words == base.numel() * base.element_size() // 2
    w = words(base)
    assert delta_apply_reference(coded, w) is w
    assert_words_equal(w, words(tuned))
    delta_apply_reference(coded, w, sign=-1)
    assert_words_equal(w, words(base))


def test_symbol_window_and_escapes():
    """Deltas in [-BIAS, BIAS] ride in the stream, all others (here 3 + 3 + 1 of 13 edges) are
    escapes holding the exact delta, mod 2**16."""
    base, tuned = boundaries()
    coded = delta_encode(base, tuned)
    delta = (tuned.to(torch.int32) - base.to(torch.int32) + 2**15) % 2**16 - 2**15
    outside = (delta.abs() > BIAS).nonzero().reshape(-1)
    assert coded.coded and outside.numel() == 7 * 400
    # Escaped deltas in lane order, each lane's run starting at its escape offset.
    lane_order = outside[torch.argsort(lane_position(outside))]
    assert torch.equal(coded.escape_value, delta[lane_order].to(torch.int16))
    per_lane = torch.bincount(
        lane_position(outside) // SYMBOLS, minlength=coded.lane_offsets.numel()
    )
    starts = torch.cumsum(per_lane, 0) - per_lane
    assert torch.equal(coded.escape_offsets, starts.to(torch.int32))
    assert coded.escape_index.numel() == 0


def test_untouched_and_sparse_deltas_cost_only_their_changes():
    base, tuned = cases()["untouched"]
    coded = delta_encode(base, tuned)
    assert not coded.coded and coded.nbytes == 0 and coded.num_words == base.numel()
    base, tuned = cases()["few_changed"]
    coded = delta_encode(base, tuned)
    changed = int((words(base) != words(tuned)).sum())
    assert not coded.coded and coded.nbytes == SPARSE_NBYTES * changed


def test_fine_tune_delta_compresses():
    """A sanity check that the coder codes (the figures live in benchmarks/delta_codec.py)."""
    base, tuned = fine_tune(GROUP * 8, torch.bfloat16, 0.01, 6)
    coded = delta_encode(base, tuned)
    assert coded.coded and coded.nbytes < 0.45 * tuned.numel() * 2, coded.nbytes


def test_stored_as_named_tensors_and_moved():
    base, tuned = cases()["bf16_1pct"]
    coded = delta_encode(base, tuned)
    stored = load(save(coded.to_tensors("blocks.0.delta.")))
    assert sorted(stored) == sorted(f"blocks.0.delta.{k}" for k in ["num_words", *PARTS])
    back = DeltaBuffer.from_tensors(stored, "blocks.0.delta.").to("cpu")
    assert back.num_words == coded.num_words and back.nbytes == coded.nbytes
    assert all(torch.equal(a, b) for a, b in zip(back.parts(), coded.parts()))
    w = words(base)
    delta_apply(back, w)
    assert_words_equal(w, words(tuned))
    with pytest.raises(KeyError, match="missing"):
        DeltaBuffer.from_tensors(stored, "blocks.1.delta.")


def test_apply_to_a_weight_in_place():
    base, tuned = fine_tune(5000, torch.bfloat16, 0.01, 7)
    weight = base.clone().reshape(50, 100)
    assert delta_apply_(delta_encode(base, tuned), weight) is weight
    assert torch.equal(weight.reshape(-1).view(torch.int16), words(tuned))


def test_bad_input_is_refused_with_a_message():
    x = torch.randn(100).bfloat16()
    with pytest.raises(ValueError, match="one shape and one dtype"):
        delta_encode(x, x.half())
    with pytest.raises(ValueError, match="one shape and one dtype"):
        delta_encode(x, x[:99])
    with pytest.raises(ValueError, match="odd"):
        delta_encode(torch.zeros(3, dtype=torch.uint8), torch.ones(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CPU"):
        delta_encode(x.to("meta"), x.to("meta"))
    coded = delta_encode(*fine_tune(10_000, torch.bfloat16, 0.01, 8))
    assert coded.coded
    w = words(x.repeat(100))
    with pytest.raises(ValueError, match="words has"):
        delta_apply(coded, w[:9999].clone())
    with pytest.raises(ValueError, match="words: need a contiguous 1-D"):
        delta_apply(coded, w.view(torch.bfloat16))
    with pytest.raises(ValueError, match="words: need a contiguous 1-D"):
        delta_apply(coded, torch.zeros(20_000, dtype=torch.int16)[::2])
    with pytest.raises(ValueError, match="sign"):
        delta_apply(coded, w, sign=2)
    with pytest.raises(ValueError, match="sign"):
        delta_apply(coded, w, sign=True)
    wrong = dataclasses.replace(coded, lane_offsets=coded.lane_offsets.long())
    with pytest.raises(ValueError, match="lane_offsets"):
        delta_apply_reference(wrong, w)
    short = dataclasses.replace(coded, lane_offsets=coded.lane_offsets[:-1])
    with pytest.raises(ValueError, match="lane_offsets for 10000 words"):
        delta_apply_reference(short, w)
    if not os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises((ValueError, RuntimeError), match="CUDA|triton"):
            delta_apply_triton(coded, w)
    with pytest.raises(ValueError, match="contiguous"):
        delta_apply_(coded, torch.zeros(20, 100).bfloat16().t())


# ---------------------------------------------------------------------------------------------
# The Triton kernel under the interpreter


def _interpret_worker() -> None:
    results = {}
    for name, (base, tuned) in cases().items():
        if base.numel() > 20_000:  # the interpreter runs numpy per step: keep it to a few groups
            base, tuned = base.reshape(-1)[:20_000], tuned.reshape(-1)[:20_000]
        coded = delta_encode(base, tuned)
        w = words(base)
        delta_apply_triton(coded, w)
        ref = delta_apply_reference(coded, words(base))
        equals_tuned, equals_reference = torch.equal(w, words(tuned)), torch.equal(w, ref)
        delta_apply_triton(coded, w, sign=-1)
        results[name] = {
            "equals_tuned": bool(equals_tuned),
            "equals_reference": bool(equals_reference),
            "restores_base": bool(torch.equal(w, words(base))),
            "coded": coded.coded,
            "escapes": coded.num_escapes,
        }
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpret_results():
    from megaslide.kernels import delta

    return interpreted_results(__file__, delta.TRITON_IMPORT_ERROR)


@pytest.mark.parametrize("name", list(cases()))
def test_triton_apply_matches_reference_and_restores_base(interpret_results, name):
    res = interpret_results[name]
    assert res["equals_tuned"] and res["equals_reference"] and res["restores_base"], res


def test_triton_cases_cover_the_stream_and_its_escapes(interpret_results):
    assert interpret_results["bf16_1pct"]["coded"] and interpret_results["bf16_1pct"]["escapes"]
    assert interpret_results["boundaries"]["coded"] and not interpret_results["untouched"]["coded"]


if __name__ == "__main__":
    worker_main(_interpret_worker)
