"""Wan's cross-attention keys and values kept per row across steps (engine/wan/prompt_cache.py):
bitwise the frames of recomputing them, with rows joining and leaving, with LoRA adapters (one
registered again mid-run), streamed, and within a memory budget; compact entries (a prompt's
tokens and one padding token) within one uint8 level; and the VAE's faster norms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.planner import Workload, plan
from megaslide.engine.request import LoraChoice
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.wan.family import WanVideoPipeline
from megaslide.engine.wan.prompt_cache import entry_bytes

from lora_fixtures import write_musubi, write_peft
from wan_fixtures import build_tiny_wan, request

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_cache")
    return {
        "model": build_tiny_wan(root / "wan", layers=2),
        "peft": write_peft(root / "peft.safetensors", alpha=8),
        "other": write_peft(root / "other.safetensors", seed=5),
        "musubi": write_musubi(root / "musubi.safetensors"),
    }


def key_passes(pipe) -> list[int]:
    """Rows of each pass that computed block 0's cross-attention keys (a list that grows)."""
    calls = []
    pipe.experts[0].blocks[0].attn2.to_k.register_forward_hook(
        lambda _m, args, _o: calls.append(args[0].shape[0])
    )
    return calls


def run(pipe, schedule, *, cache: bool, compact=False, between=None) -> list[np.ndarray]:
    """Step the requests of `schedule` (`{step: [requests joining then]}`) together until all
    finish, each decoded alone as it finishes; `between(step)` runs before each step. The kept
    keys are all 512 tokens' unless `compact` (which is not bitwise)."""
    pipe.prompt_cache_bytes = type(pipe).prompt_cache_bytes if cache else 0
    pipe.prompt_cache_compact = compact
    states, frames, step = [], {}, 0
    while step in schedule or any(not s.done for s in states):
        for r in schedule.get(step, []):
            states.append(pipe.prepare(pipe.resolve(r)))
        if between is not None:
            between(step)
        pipe.denoise_step(states)
        for i, s in enumerate(states):
            if s.done and i not in frames:
                assert not s.prompt_kv  # its keys and values go when it finishes
                frames[i] = pipe.finish(s)
        step += 1
    return [frames[i] for i in range(len(states))]


@pytest.mark.parametrize("offload", ["none", "stream"])
def test_kept_keys_give_bitwise_the_frames_of_recomputing(wan, offload):
    """Three requests (two guided pairs, one unguided row), resident or streamed: the keys are
    computed in the first step's passes only, and every clip is bitwise the one computed with
    the keys recomputed at every step."""
    pipe = open_pipeline(wan["model"], offload=offload)
    requests = [
        request(seed=1),
        request(seed=2, prompt="a blue square", negative_prompt="dark"),
        request(seed=5, guidance=1.0),
    ]
    calls = key_passes(pipe)
    plain = run(pipe, {0: requests}, cache=False)
    first = len(calls)
    kept = run(pipe, {0: requests}, cache=True)
    assert sum(calls[first:]) == 5  # the five rows' keys, once
    assert sum(calls[:first]) == 5 * requests[0].steps
    for a, b in zip(plain, kept):
        assert np.array_equal(a, b)


def test_rows_joining_and_leaving_refill_and_stay_bitwise(wan):
    """A request joins a running batch (its pass computes every row's keys again), a shorter
    one leaves early: every clip bitwise the one without kept keys."""
    pipe = open_pipeline(wan["model"], offload="stream")  # every row in one pass
    schedule = {
        0: [request(seed=1, steps=5), request(seed=4, steps=2, prompt="a blue square")],
        2: [request(seed=2, prompt="a green circle", guidance=1.0)],
    }
    calls = key_passes(pipe)
    plain = run(pipe, schedule, cache=False)
    first = len(calls)
    kept = run(pipe, schedule, cache=True)
    # Step 0: the first two (4 rows); step 2, when the third joins: the first and the third.
    assert calls[first:] == [4, 3]
    for a, b in zip(plain, kept):
        assert np.array_equal(a, b)


def test_adapter_rows_keep_their_own_keys_and_refill_when_replaced(wan):
    """Requests with adapters on the cross-attention's keys and values (one each, two, none)
    share the passes; halfway through, adapter `a` is registered again from another file: the
    rows that name it compute their keys again, and every clip is bitwise the one without kept
    keys under the same replacement."""
    pipe = open_pipeline(wan["model"], offload="none")
    choices = [[("a", 1.0)], [("a", 0.5), ("b", 1.0)], []]
    requests = [
        request(seed=i, loras=tuple(LoraChoice(n, s) for n, s in c)) for i, c in enumerate(choices)
    ]
    pipe.add_adapter("a", wan["peft"])
    pipe.add_adapter("b", wan["musubi"])

    def replace(step):
        if step == 0:
            pipe.add_adapter("a", wan["peft"], replace=True)
            pipe.add_adapter("b", wan["musubi"], replace=True)
        if step == 2:
            pipe.add_adapter("a", wan["other"], replace=True)

    calls = key_passes(pipe)
    plain = run(pipe, {0: requests}, cache=False, between=replace)
    first = len(calls)
    kept = run(pipe, {0: requests}, cache=True, between=replace)
    # Passes of at most 4 rows on a CPU: [2 + 2], [2]; at step 2 the first pass again (both its
    # requests name `a`), the adapter-free one keeps its keys.
    assert calls[first:] == [4, 2, 4]
    for a, b in zip(plain, kept):
        assert np.array_equal(a, b)


def test_the_budget_bounds_the_kept_bytes(wan):
    """With room for two guided requests' entries, the first two (one pass on a CPU) keep their
    keys and the third (a pass of its own) recomputes its own at every step; an entry's bytes are
    `entry_bytes`' count, and the frames are bitwise the ones without kept keys."""
    pipe = open_pipeline(wan["model"], offload="none")
    model = pipe.experts[0]
    per_row = entry_bytes(model, 512, pipe.dtype)
    assert per_row == 512 * 2 * 24 * len(model.blocks) * 4  # tokens x (k, v) x width x blocks
    requests = [request(seed=i, prompt=p) for i, p in enumerate(["a", "b blue", "c green"])]
    plain = run(pipe, {0: requests}, cache=False)
    calls = key_passes(pipe)
    pipe.prompt_cache_bytes = 4 * per_row
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    pipe.denoise_step(states)
    assert [sum(e.nbytes for e in s.prompt_kv.values()) for s in states] == [2 * per_row] * 2 + [0]
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    assert calls == [4] + [2] * requests[0].steps
    for a, s in zip(plain, states):
        assert np.array_equal(a, pipe.finish(s))


def test_the_planner_counts_the_kept_keys_on_the_device(wan, monkeypatch):
    """`plan` reserves on the device what a pass's rows keep across steps: a row's full entry
    (`entry_bytes`, 512 tokens), within the pipeline's budget."""
    info = describe(resolve_source(wan["model"]))
    model = open_pipeline(wan["model"], offload="none").experts[0]
    per_row = entry_bytes(model, 512, torch.float32)

    def kept(batch: int) -> int:
        return plan(info, w=Workload(batch=batch, dtype_bytes=4))["device"]["kept_across_steps"]

    assert kept(1) == 2 * per_row  # a guided request: two rows
    monkeypatch.setattr(WanVideoPipeline, "prompt_cache_bytes", 3 * per_row)
    assert kept(4) == 3 * per_row


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_compact_entries_keep_one_padding_token_within_one_level(wan):
    """Compact entries (the default in fp32) keep each prompt's tokens and one padding token,
    its scores raised by log(count): every clip within one uint8 level of recomputing the 512
    tokens' keys, the entries' bytes (L + 1) / 512 of the full ones."""
    pipe = open_pipeline(wan["model"], offload="none")
    assert type(pipe).prompt_cache_compact
    requests = [
        request(seed=1),
        request(seed=2, prompt="a blue square", negative_prompt="dark"),
        request(seed=5, guidance=1.0),
    ]
    plain = run(pipe, {0: requests}, cache=False)
    compact = run(pipe, {0: requests}, cache=True, compact=True)
    assert (
        max(int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(plain, compact)) <= 1
    )
    state = pipe.prepare(pipe.resolve(requests[1]))
    pipe.denoise_step([state])
    full = entry_bytes(pipe.experts[0], 512, pipe.dtype)
    for half, length in enumerate(state.lengths):
        assert 1 < length < 20  # a few words: a few UMT5 tokens and the end token
        assert state.prompt_kv[0, half].nbytes * 512 == full * (length + 1)


def test_vae_norms_within_one_level_of_diffusers_decode(wan):
    """The batched mode's VAE norms sum squares where diffusers' take `F.normalize`: decoded
    frames within one uint8 level of diffusers' own decode; the reference mode keeps diffusers'
    norms (bitwise)."""
    fast = open_pipeline(wan["model"])
    reference = open_pipeline(wan["model"], batched=False)
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    ours, theirs = fast.encoders.decode(latents), reference.encoders.decode(latents)
    assert int(np.abs(ours.astype(int) - theirs.astype(int)).max()) <= 1
    vae = diffusers.AutoencoderKLWan.from_pretrained(wan["model"] / "vae")
    vae.enable_tiling()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std_inv = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():  # as WanPipeline de-normalises
        video = vae.decode(latents / std_inv + mean, return_dict=False)[0]
    video = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1)
    assert np.array_equal(theirs, (video * 255).round().to(torch.uint8).numpy())
