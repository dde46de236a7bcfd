"""Samplers over an explicit list of timesteps, as step-distilled video models are sampled.

A step-distilled model (LightX2V's 4-step Wan LoRAs, rCM, DMD) was trained to visit a few fixed
noise levels, written as training timesteps from 1000 (pure noise) down, e.g. (1000, 750, 500,
250), with a shift. Its noise level (flow time, sigma) at timestep `t` is read off the grid of the
1000 training levels, `linspace(1, 0, 1001)` without its final 0, shifted by
`s' = shift * s / (1 + (shift - 1) * s)` (SD3's eq. 23), at index `1000 - t`: LightX2V's
`WanStepDistillScheduler.set_denoising_timesteps`.

Two update rules walk those levels (`SAMPLERS` in native/config.py):
- "euler": `x' = x + (sigma' - sigma) * v`, the flow's Euler step along the predicted velocity `v`:
  diffusers' `FlowMatchEulerDiscreteScheduler.step`.
- "consistency": predict the clean clip `x0 = x - sigma * v` and re-noise it at the next level
  with fresh noise, `x' = (1 - sigma') * x0 + sigma' * noise` (the rCM, DMD and LCM samplers):
  diffusers' `FlowMatchLCMScheduler.step`. The noise comes from the request's own generator, on
  the CPU, after its starting noise; the last step draws it too (its weight is 0).

Wan's pipeline samples with those diffusers classes themselves (`flow_scheduler`), given the
sigmas of `timestep_sigmas`; our DiT's sampler applies the same rules (`euler_step`,
`consistency_step`), bitwise the classes' own (tests/test_samplers.py).
"""

from __future__ import annotations

import torch

from ..request import TRAIN_TIMESTEPS


def timestep_sigmas(
    timesteps: tuple[int, ...], shift: float, train_timesteps: int = TRAIN_TIMESTEPS
) -> torch.Tensor:
    """The noise levels `(steps,)` fp32 of `timesteps` (whole numbers in [1, train_timesteps],
    decreasing) under `shift`, read off the shifted grid of training levels."""
    grid = torch.linspace(1.0, 0.0, train_timesteps + 1)[:-1]  # (T,): level of timestep T - i
    grid = shift * grid / (1 + (shift - 1) * grid)
    return grid[[train_timesteps - t for t in timesteps]]  # (steps,)


def flow_times(sigmas: torch.Tensor) -> torch.Tensor:
    """The flow times a sampler walks: `sigmas` then 0, the clean clip `(steps + 1,)`."""
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def flow_scheduler(sampler: str, sigmas: torch.Tensor, train_timesteps: int, device: torch.device):
    """A diffusers scheduler that walks `sigmas` with `sampler`'s update rule: the sigmas are
    shifted already, so its own shift is 1 (which leaves them bitwise as they are)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchLCMScheduler

    classes = {"euler": FlowMatchEulerDiscreteScheduler, "consistency": FlowMatchLCMScheduler}
    if sampler not in classes:
        raise ValueError(f"sampler {sampler!r} walks the model's own schedule, not a list")
    scheduler = classes[sampler](num_train_timesteps=train_timesteps, shift=1.0)
    scheduler.set_timesteps(sigmas=sigmas.tolist(), device=device)
    scheduler.set_begin_index(0)
    return scheduler


def euler_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor):
    """One Euler step of the flow from time `t` to `t_next` along the velocity `v`."""
    return x + (t_next - t) * v  # (B, C, F, H, W)


def consistency_step(
    x: torch.Tensor,
    v: torch.Tensor,
    t: torch.Tensor,
    t_next: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """One consistency step: the clean clip predicted at `t`, re-noised at `t_next` with noise
    drawn on the CPU from `generator` (the same on every device)."""
    x0 = x - t * v  # (B, C, F, H, W): the clean clip predicted
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
    return (1 - t_next) * x0 + t_next * noise
