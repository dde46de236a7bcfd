"""Rectified flow: the training loss and the Euler sampler with classifier-free guidance.

Convention (SD3, Wan): a clip `x0` and Gaussian noise `e` are joined by the straight path
`x_t = (1 - t) * x0 + t * e`, t in [0, 1]; the model predicts the velocity `e - x0`. Sampling walks
from t = 1 (noise) to t = 0 with Euler steps on a shifted schedule.

The sampler is step-wise: each request is a `SampleState`, and `sample_step` advances any list of
them by one step with one forward pass over all of them and both halves of their guidance pairs,
so requests at different steps share one pass of the model's weights. The loop itself is
loop.py's, shared by every family; `EulerSampler` gives it our DiT's inputs and update rule.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..native.config import TIME_SAMPLING
from ..parallel.sequence import gather_tokens, shard_tokens
from ..request import guided_at
from . import loop
from .loop import ForwardCut, GuidanceMemory, Sampler, row_slices
from .loop import cfg_combine as cfg_combine  # the guidance rule, where it was documented
from .samplers import consistency_step, euler_step
from .step_cache import StepCache


def shifted_schedule(steps: int, shift: float) -> torch.Tensor:
    """Flow times `(steps + 1,)` from 1 to 0, warped by `shift` toward the noisy end.

    `t' = shift * t / (1 + (shift - 1) * t)` (SD3, eq. 23): with shift > 1 more of the steps are spent
    at high noise, where a video's layout and motion are decided.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def noisy_sample(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`x_t = (1 - t) * x0 + t * noise` for flow times `t (B,)`: a point on each straight path."""
    t_ = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - t_) * x0 + t_ * noise  # (B, C, F, H, W)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """What the model learns to predict: the velocity `noise - x0` of the straight path."""
    return noise - x0


TRAINING_SHIFT = 4.0  # the "shifted" time sampling's shift
PRIOR_FLOOR = 0.99  # "prior" times lie in [PRIOR_FLOOR, 1)
PRIOR_SHARE = 0.25  # share of "prior" times in "<kind>+prior"


def sample_training_times(
    batch: int, generator: torch.Generator, kind: str = "logit-normal"
) -> torch.Tensor:
    """Flow times for training, `(batch,)` in (0, 1) (1 is pure noise).

    "logit-normal" (SD3's default) favours the middle of the path. "noisy" is logit-normal with
    mean 0.8 and std 0.8, favouring the noisy end, where the prompt is all the model has to go on
    (JiT's choice for pixel-space data prediction, in our direction of time). "shifted" maps
    SD3's logit-normal through the timestep shift t -> s t / (1 + (s - 1) t) with s = 4, as SD3
    does for larger images: a fifth of the times lie above 0.9. Small clips of large flat objects
    stay legible under heavy noise, so the layout and motion of a sample are decided there, and a
    model that has not learned that regime reads motion into pure noise. "uniform" is flat.

    "prior" is uniform in [0.99, 1): the input is all but pure noise, so the best prediction is the
    mean clip the prompt implies, and training there is regression from the prompt alone. A
    direction of motion lives only in that mean's joint dependence on frame and position (a
    left-moving object is on the right early and on the left late; averaged over either, left and
    right look alike), which gradient descent finds slowly: with times spread over the path, the
    evidence in less noisy inputs explains the loss first and the direction words stay unused.
    "<kind>+prior" ("noisy+prior", ...) draws a quarter of the times from "prior" and the rest
    from `kind`, so a model keeps what the prompt alone implies while it learns to denoise.
    """
    if kind == "logit-normal":
        return torch.sigmoid(torch.randn(batch, generator=generator))
    if kind == "noisy":
        return torch.sigmoid(0.8 + 0.8 * torch.randn(batch, generator=generator))
    if kind == "shifted":
        t = torch.sigmoid(torch.randn(batch, generator=generator))
        return TRAINING_SHIFT * t / (1 + (TRAINING_SHIFT - 1) * t)
    if kind == "uniform":
        return torch.rand(batch, generator=generator)
    if kind == "prior":
        return PRIOR_FLOOR + (1 - PRIOR_FLOOR) * torch.rand(batch, generator=generator)
    if kind in TIME_SAMPLING and kind.endswith("+prior"):
        t = sample_training_times(batch, generator, kind.removesuffix("+prior"))
        prior = torch.rand(batch, generator=generator) < PRIOR_SHARE
        return torch.where(prior, sample_training_times(batch, generator, "prior"), t)
    raise ValueError(f"time sampling must be one of {TIME_SAMPLING}, got {kind!r}")


@dataclass
class SampleState:
    """One request on its way from noise to a clip."""

    latents: torch.Tensor  # (1, C, F, H, W) at times[step]
    ctx: torch.Tensor  # (1 or 2, L, text_dim): conditional, then unconditional when guided
    ctx_mask: torch.Tensor  # (1 or 2, L) bool
    times: torch.Tensor  # (steps + 1,) from 1 to 0
    guidance: float
    step: int = 0
    cache: StepCache | None = None  # a step cache: may reuse an earlier output instead of a pass
    fine_tune: str | None = None  # the fine-tune (kept as a delta) whose weights it samples with
    # A consistency sampler's source of fresh noise (samplers.py); None: Euler steps.
    renoise: torch.Generator | None = None
    # (start, end): guided only on the steps in this fraction of the schedule; None: on all.
    guidance_interval: tuple[float, float] | None = None
    row_passes: int = 0  # rows of the model's passes it ran: two a guided step, one otherwise
    keep_x0: bool = False  # keep `x0`, the clean clip its last step predicted (previews)
    x0: torch.Tensor | None = None
    # The guidance direction for the steps a guidance interval leaves out (loop.py).
    guidance_memory: GuidanceMemory | None = None

    @property
    def num_steps(self) -> int:
        return len(self.times) - 1

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    @property
    def guided(self) -> bool:
        """Whether this step runs the guidance pair (`ctx` holds both rows whenever the scale
        is not 1)."""
        return self.guidance != 1.0 and guided_at(self.guidance_interval, self.step, self.num_steps)

    @property
    def passes(self) -> int:
        """Steps that ran a pass of the model (fewer than `step` when the cache reused)."""
        return self.step if self.cache is None else self.cache.passes

    def flow_time(self, step: int) -> torch.Tensor:
        return self.times[step]

    def clip_latents(self) -> torch.Tensor:
        return self.latents


class EulerSampler(Sampler):
    """Our DiT's hooks for the sampler loop: rows of (latents, time, prompt, mask), the model's
    velocity in fp32, and the Euler step along the shifted schedule. `passes` splits a step's
    requests into passes (default: all in one)."""

    def __init__(
        self,
        model,
        passes: Callable[[list], list[list]] | None = None,
        first_block_only: Callable[[], ContextManager] = nullcontext,
        sp=None,
        weights: Callable[..., ContextManager] | None = None,
        interleaves: Callable[[list], bool] | None = None,
    ):
        """`sp`: the ranks `model`'s tokens are split over (`parallel.parallelize_dit`), for the
        passes cut at its blocks; None on one process. `weights`: what a pass's weights are
        (the pipeline's fine-tune selection; default the model's own)."""
        self.model = model
        self._passes = passes
        self.first_block_only = first_block_only
        self.sp = sp
        self._weights, self._interleaves = weights, interleaves

    def weights(self, states: list[SampleState], blocks_only: bool = False) -> ContextManager:
        return nullcontext() if self._weights is None else self._weights(states, blocks_only)

    def interleaves(self, parts: list[list[SampleState]]) -> bool:
        return self._interleaves is not None and self._interleaves(parts)

    def passes(self, states: list[SampleState]) -> list[list[SampleState]]:
        return super().passes(states) if self._passes is None else self._passes(states)

    def forward(self, expert: int, states: list[SampleState]) -> list[torch.Tensor]:
        inputs, rows = _inputs(states, next(self.model.parameters()).dtype)
        v = self.model(*inputs).float()  # (B', C, F, H, W)
        return [v[r] for r in rows]

    def cut(self, expert: int, states: list[SampleState]) -> DiTCut:
        inputs, _ = _inputs(states, next(self.model.parameters()).dtype)
        return DiTCut(self.model, inputs, self.sp)

    def update(self, s: SampleState, v: torch.Tensor) -> None:
        t, t_next = s.times[s.step], s.times[s.step + 1]  # t_next < t: from noise to data
        if s.renoise is None:
            s.latents = euler_step(s.latents, v, t, t_next)  # (1, C, F, H, W)
        else:
            s.latents = consistency_step(s.latents, v, t, t_next, s.renoise)
        s.step += 1


class DiTCut(ForwardCut):
    """`VideoDiT.forward` over a pass's rows, cut at its blocks (dit.py's own cut); under sequence
    parallel (`sp`), `parallelize_dit`'s forward cut the same way."""

    def __init__(self, model, inputs: tuple, sp=None):
        self.model, self.inputs, self.sp = model, inputs, sp

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def prologue(self):
        h, c = self.model.prologue(*self.inputs)  # (B', N, D), BlockInputs
        if self.sp is not None:  # the blocks read the rotary angles of this rank's tokens
            _, c = shard_tokens(self.model.config, h, c, self.sp)
        return h, c

    def block(self, i, h, c):
        if i == 0 and self.sp is not None:
            h = self.local(h)  # (B', n, D): this rank's tokens, as `shard_tokens` keeps them
        return self.model.blocks[i](h, c)  # (B', n, D)

    def rows(self, c, index):
        return c.rows(index)

    def epilogue(self, h, c):
        if self.sp is not None:
            h = gather_tokens(h, self.sp)  # (B', N, D)
        return self.model.epilogue(h, c).float()  # (B', C, F, H, W)


def sample_step(
    model, states: list[SampleState], first_block_only: Callable[[], ContextManager] = nullcontext
) -> None:
    """Advance every unfinished state by one Euler step, in one batched forward pass of `model`
    (loop.py's loop with `EulerSampler`'s hooks).

    The batch holds each guided request twice (conditional and unconditional context), so a streamed
    model moves its weights once per step for all of them. A state whose step cache reuses an
    earlier output stays out of the pass; when every state reuses, the model does not run. A state
    whose cache decides from the first block's residual (`first-block`) joins the pass up to the
    first block and leaves it there when it reuses; `first_block_only` is entered around that
    first block (a streamed model's pipeline stops the streamer copying the next block ahead).
    """
    loop.sample_step(EulerSampler(model, first_block_only=first_block_only), states)


def _inputs(states: list[SampleState], dtype: torch.dtype):
    """The batch of a pass: every row of `states` (both halves of each guidance pair), and each
    state's rows in it as a slice."""
    xs, ts, ctxs, masks = [], [], [], []
    for s in states:
        copies = 2 if s.guided else 1
        xs.append(s.latents.expand(copies, *s.latents.shape[1:]))
        ts.append(s.times[s.step].expand(copies))
        ctxs.append(s.ctx[:copies])
        masks.append(s.ctx_mask[:copies])
    x = torch.cat(xs).to(dtype)  # (B', C, F, H, W)
    return (x, torch.cat(ts).to(x.device), torch.cat(ctxs), torch.cat(masks)), row_slices(states)
