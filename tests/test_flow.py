"""Rectified flow: schedule, loss, guidance and the step-wise sampler."""

import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.config import TIME_SAMPLING
from megaslide.engine.request import VideoRequest
from megaslide.engine.sampling.flow import (
    SampleState,
    cfg_combine,
    noisy_sample,
    sample_step,
    sample_training_times,
    shifted_schedule,
    velocity_target,
)
from megaslide.engine.sources import resolve_source

from dit_fixtures import randomise_zero_inits

REQ = dict(frames=4, height=16, width=16, steps=3)


def test_schedule_runs_from_noise_to_data_and_shift_favours_noise():
    t = shifted_schedule(10, 1.0)
    torch.testing.assert_close(t, torch.linspace(1, 0, 11))
    s = shifted_schedule(10, 3.0)
    assert s[0] == 1 and s[-1] == 0 and torch.all(s[1:] < s[:-1])
    assert torch.all(s[1:-1] > t[1:-1])
    with pytest.raises(ValueError):
        shifted_schedule(0, 1.0)


def test_training_times_lie_in_the_open_interval_and_order_by_noisiness():
    g = torch.Generator().manual_seed(0)
    times = {kind: sample_training_times(20000, g, kind) for kind in TIME_SAMPLING}
    assert all(((t > 0) & (t < 1)).all() for t in times.values())
    share_above = {kind: (t > 0.9).float().mean().item() for kind, t in times.items()}
    assert (
        share_above["logit-normal"]
        < share_above["noisy"]
        < share_above["uniform"]
        < share_above["shifted"]
    )
    assert share_above["shifted"] == pytest.approx(0.21, abs=0.02)  # P(sigmoid(z) > 0.9 / 1.3)
    assert (times["prior"] >= 0.99).all()
    # "<kind>+prior": a quarter from "prior", the rest from the kind (under 0.1% of each kind's own
    # times lie above 0.99).
    for kind in ("logit-normal", "noisy", "shifted", "uniform"):
        mixed = times[f"{kind}+prior"]
        own_share = 0.01 if kind == "uniform" else 0.0  # of the kind's own times above 0.99
        assert (mixed >= 0.99).float().mean().item() == pytest.approx(
            0.25 + 0.75 * own_share, abs=0.015
        )
        assert share_above[f"{kind}+prior"] == pytest.approx(
            0.25 + 0.75 * share_above[kind], abs=0.02
        )
    with pytest.raises(ValueError, match="time sampling must be one of"):
        sample_training_times(2, g, "cosine")


class Oracle(torch.nn.Module):
    """Predicts the exact velocity toward a fixed x0: `(x - x0) / t`."""

    def __init__(self, x0):
        super().__init__()
        self.x0 = torch.nn.Parameter(x0)

    def forward(self, x, t, ctx, mask):
        return (x - self.x0) / t.view(-1, 1, 1, 1, 1)


def test_loss_is_zero_for_the_true_velocity_and_euler_lands_on_the_data():
    x0, noise = torch.randn(2, 3, 2, 4, 4), torch.randn(2, 3, 2, 4, 4)
    t = torch.tensor([0.3, 0.8])
    predicted = Oracle(x0)(noisy_sample(x0, noise, t), t, None, None)
    torch.testing.assert_close(predicted, velocity_target(x0, noise))
    ctx, mask = torch.zeros(1, 1, 1), torch.ones(1, 1, dtype=torch.bool)
    state = SampleState(noise[:1].clone(), ctx, mask, shifted_schedule(5, 3.0), guidance=1.0)
    while not state.done:
        sample_step(Oracle(x0[:1]), [state])
    torch.testing.assert_close(state.latents, x0[:1], rtol=1e-5, atol=1e-5)


class Recorder(torch.nn.Module):
    """Returns a different constant velocity for conditional and unconditional rows."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.batches = []

    def forward(self, x, t, ctx, mask):
        self.batches.append(x.shape[0])
        return x * 0 + ctx[:, 0, 0].view(-1, 1, 1, 1, 1)


def test_cfg_runs_both_passes_in_one_batch_and_combines_them():
    model = Recorder()
    ctx = torch.tensor([[[2.0]], [[0.5]]])  # conditional velocity 2, unconditional 0.5
    mask = torch.ones(2, 1, dtype=torch.bool)
    times = torch.tensor([1.0, 0.5])
    a = SampleState(torch.zeros(1, 1, 1, 1, 1), ctx, mask, times, guidance=3.0)
    b = SampleState(torch.zeros(1, 1, 1, 1, 1), ctx, mask, times, guidance=1.0)
    sample_step(model, [a, b])
    assert model.batches == [3]  # one pass: a's pair and b alone
    expected = cfg_combine(torch.tensor(2.0), torch.tensor(0.5), 3.0)  # 0.5 + 3 * 1.5 = 5
    assert expected == 5.0
    torch.testing.assert_close(a.latents.flatten(), torch.tensor([-0.5 * 5.0]))
    torch.testing.assert_close(b.latents.flatten(), torch.tensor([-0.5 * 2.0]))
    assert a.done and b.done
    sample_step(model, [a, b])  # finished states are skipped
    assert model.batches == [3]


@pytest.fixture(scope="module")
def pipe():
    p = open_pipeline(resolve_source(preset="tiny"))
    randomise_zero_inits(p.dit)
    return p


def test_same_seed_is_bitwise_identical_and_seeds_differ(pipe):
    a = pipe.generate(VideoRequest("a red circle", seed=1, **REQ))
    b = pipe.generate(VideoRequest("a red circle", seed=1, **REQ))
    c = pipe.generate(VideoRequest("a red circle", seed=2, **REQ))
    assert a.shape == (4, 16, 16, 3) and a.dtype.name == "uint8"
    assert (a == b).all()
    assert (a != c).any()


def test_batched_steps_equal_one_at_a_time(pipe, monkeypatch):
    """Three requests prepared in one pass of the text encoder (a prompt they share encoded once),
    stepped together and decoded two per pass of the autoencoder: each clip within a level of its
    run alone."""
    reqs = [
        VideoRequest("a red circle", seed=1, **REQ),
        VideoRequest("a red circle", seed=5, guidance=1.0, **REQ),
        VideoRequest("a green line", negative_prompt="red", seed=7, **REQ),
    ]
    alone = [pipe.generate(r) for r in reqs]
    encoded, decoded = [], []
    hook = pipe.text_encoder.register_forward_pre_hook(
        lambda _m, args: encoded.append(args[0].shape[0])
    )
    decode = pipe.autoencoder.decode
    monkeypatch.setattr(pipe.autoencoder, "decode", lambda x: decoded.append(len(x)) or decode(x))
    monkeypatch.setattr(pipe, "decode_chunk", 2)
    states = pipe.prepare_batch([pipe.resolve(r) for r in reqs])
    hook.remove()
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    together = pipe.finish_batch(states)
    assert encoded == [4] and decoded == [2, 1]  # 2 + 1 + 2 prompts, 4 distinct; 3 clips
    for x, y in zip(alone, together):
        # Batched matmuls may sum in another order: allow one level of rounding in the uint8 output.
        assert abs(x.astype(int) - y.astype(int)).max() <= 1


def test_negative_prompt_changes_the_guided_output(pipe):
    a = pipe.generate(VideoRequest("a red circle", seed=1, **REQ))
    b = pipe.generate(VideoRequest("a red circle", negative_prompt="blue", seed=1, **REQ))
    assert (a != b).any()


def test_resolve_rejects_bad_requests(pipe):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        pipe.resolve(VideoRequest("  "))
    with pytest.raises(ValueError, match="even"):
        pipe.resolve(VideoRequest("p", height=15, width=16))
    with pytest.raises(ValueError, match="takes 1 to 32 frames"):
        pipe.resolve(VideoRequest("p", frames=pipe.info.limits.max_frames + 1))
