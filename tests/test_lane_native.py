"""The lane code's C++ decoders (kernels/lane_native.cpp) against the torch references: a delta
applied both ways and DFloat decoded, bitwise, on every case the references' own tests use
(escapes, the sparse form, fp32/fp16/bf16 words, sizes off a lane group, NaN payloads), on one
thread and on several; malformed buffers refused; the switch and a missing compiler fall back to
the references.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import test_delta_codec
import test_dfloat
import torch
from native_kernel import require_lane_native

from megaslide.kernels import lane_native
from megaslide.kernels.delta import delta_apply, delta_apply_native
from megaslide.kernels.delta_reference import delta_apply_reference, delta_encode
from megaslide.kernels.dfloat import dfloat_decode
from megaslide.kernels.dfloat_reference import dfloat_decode_reference, dfloat_encode

DELTA_CASES = test_delta_codec.cases()
GROUP = test_delta_codec.GROUP


@pytest.fixture(scope="module")
def native():
    return require_lane_native()


@pytest.fixture(scope="module")
def dfloat_cases():
    return test_dfloat.cases()


def words(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16).clone()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", list(DELTA_CASES))
def test_delta_apply_matches_the_reference_both_ways(native, name, threads, monkeypatch):
    monkeypatch.setattr(lane_native, "GROUPS_PER_THREAD", 1)  # several threads on small cases
    base, tuned = DELTA_CASES[name]
    coded = delta_encode(base, tuned)
    for sign, start, end in ((1, base, tuned), (-1, tuned, base)):
        want = delta_apply_reference(coded, words(start), sign)
        got = native.delta_apply(coded, words(start), sign, threads)
        diff = (got != want).nonzero().reshape(-1)
        assert diff.numel() == 0, f"{diff.numel()} words differ, first at {diff[:4].tolist()}"
        assert torch.equal(got, words(end))


def test_the_cases_cover_every_form():
    forms = {name: delta_encode(*pair) for name, pair in DELTA_CASES.items()}
    assert forms["boundaries"].coded and forms["boundaries"].num_escapes
    assert forms["fp32_1pct"].coded and forms["fp32_1pct"].num_escapes
    assert not forms["few_changed"].coded and forms["few_changed"].num_escapes
    assert forms["bf16_1pct"].num_words % GROUP  # a partial last group


def test_delta_apply_uses_it_on_the_cpu(native, monkeypatch):
    base, tuned = DELTA_CASES["bf16_1pct"]
    coded = delta_encode(base, tuned)
    calls = []
    run = lane_native.LaneNative.delta_apply

    def counted(self, *args):
        calls.append(args[2])  # the sign
        return run(self, *args)

    monkeypatch.setattr(lane_native.LaneNative, "delta_apply", counted)
    w = words(base)
    assert delta_apply(coded, w) is w and torch.equal(w, words(tuned))
    assert delta_apply_native(coded, w, -1) is w and torch.equal(w, words(base))
    assert calls == [1, -1]


def test_malformed_deltas_are_refused(native):
    base, tuned = test_delta_codec.boundaries()
    coded = delta_encode(base, tuned)
    assert coded.coded and coded.num_escapes
    cut = dataclasses.replace(coded, stream=coded.stream[: coded.stream.numel() // 2])
    with pytest.raises(ValueError, match="past the end of the stream"):
        delta_apply_native(cut, words(base))
    fewer = dataclasses.replace(coded, escape_value=coded.escape_value[:-1])
    with pytest.raises(ValueError, match="escape"):
        delta_apply_native(fewer, words(base))
    shifted = dataclasses.replace(coded, escape_offsets=coded.escape_offsets.roll(1))
    with pytest.raises(ValueError, match="escape"):
        delta_apply_native(shifted, words(base))
    sparse = delta_encode(*DELTA_CASES["few_changed"])
    outside = dataclasses.replace(sparse, escape_index=sparse.escape_index + sparse.num_words)
    w = words(DELTA_CASES["few_changed"][0])
    with pytest.raises(ValueError, match="out of range"):
        delta_apply_native(outside, w)
    assert torch.equal(w, words(DELTA_CASES["few_changed"][0]))  # nothing written


@pytest.mark.parametrize("threads", [1, 2])
def test_dfloat_decode_matches_the_reference(native, dfloat_cases, threads, monkeypatch):
    monkeypatch.setattr(lane_native, "GROUPS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for name, x in dfloat_cases.items():
        coded = dfloat_encode(x)
        want = torch.empty(coded.num_words, dtype=torch.int16)
        dfloat_decode_reference(*coded.parts(), want)
        got = torch.full_like(want, 0x5A5A)
        assert native.dfloat_decode(*coded.parts(), got) is got
        assert torch.equal(got, want), name
        assert torch.equal(got, x.reshape(-1).view(torch.int16)), name
    coded = dfloat_encode(dfloat_cases["group_plus_one"])
    sm, table, offsets, stream = coded.parts()
    with pytest.raises(ValueError, match="past the end of the stream"):
        dfloat_decode(
            sm, table, offsets, stream[:-8].contiguous(), torch.empty_like(sm, dtype=torch.int16)
        )


def test_the_switch_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("MEGASLIDE_NATIVE_CODEC", "0")
    assert lane_native.load() is None
    assert "MEGASLIDE_NATIVE_CODEC=0" in lane_native.unavailable_reason()
    base, tuned = DELTA_CASES["boundaries"]
    w = words(base)
    delta_apply(delta_encode(base, tuned), w)  # the reference
    assert torch.equal(w, words(tuned))
    with pytest.raises(RuntimeError, match="unavailable"):
        delta_apply_native(delta_encode(base, tuned), words(base))


def test_a_missing_compiler_is_a_reason(tmp_path, monkeypatch):
    reason = lane_native.LIBRARY.build(tmp_path, "no-such-compiler-megaslide")
    assert isinstance(reason, str) and "not found" in reason
    monkeypatch.setenv("CXX", "no-such-compiler-megaslide")
    monkeypatch.setenv("MEGASLIDE_NATIVE_CACHE", str(tmp_path))
    assert lane_native.load() is None and "not found" in lane_native.unavailable_reason()
    base, tuned = DELTA_CASES["fp32_1pct"]
    w = words(base)
    delta_apply(delta_encode(base, tuned), w)
    assert torch.equal(w, words(tuned))


@pytest.mark.slow  # runs the compiler
def test_build_from_scratch_and_from_the_cache(tmp_path):
    compiler = os.environ.get("CXX", "g++")
    built = lane_native.LIBRARY.build_now(tmp_path, compiler)
    if isinstance(built, str):
        if os.environ.get("MEGASLIDE_REQUIRE_NATIVE") == "1":
            pytest.fail(built)
        pytest.skip(built)
    assert built.build_s > 0 and built.path.parent == tmp_path
    again = lane_native.LIBRARY.build_now(tmp_path, compiler)
    assert again.path == built.path and again.build_s == 0  # found in the cache
    assert [p.name for p in tmp_path.iterdir()] == [built.path.name]  # no temporary left
    base, tuned = DELTA_CASES["boundaries"]
    assert torch.equal(
        again.delta_apply(delta_encode(base, tuned), words(base), 1, 2), words(tuned)
    )
