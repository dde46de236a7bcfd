"""Step caches: skip a request's denoising pass when its model output would barely change.

Between neighbouring denoising steps a video DiT's output changes little over long stretches of
the schedule, so a step can reuse the output of an earlier one. For a streamed model a skipped
pass is worth more than elsewhere: it skips the compute *and* the whole transfer of the weights.

A cache sits in the sampler loop (flow.py for our DiT, wan/family.py for Wan), one per request:
before each step the sampler asks `StepCache.reuse(step, t, t_next)`; a request that reuses takes
`StepCache.output()` as its model output and its rows stay out of the pass; a request that
computes joins the pass and hands its output to `StepCache.record`. When every request of a step
reuses, the model does not run and no weights move. What is cached is the request's model output
after guidance (a velocity, or Wan's flow prediction), so both rows of a guidance pair decide
together. A model with two experts (Wan2.2-A14B) keeps one history per expert (`key`): an output
of one expert is never reused for the other, and each expert computes its own first steps.

The policies decide from quantities the sampler has anyway (flow times, latents, the outputs of
the steps that ran), so none needs a hook inside the model. Flow times `t` run from 1 (noise) to 0
(data); in rectified flow `x_t = (1 - t) x0 + t e` and the model predicts `v = e - x0`, so the
clean clip it implies is `x0 = x_t - t v` (Wan's flow-matching schedulers follow the same
convention with `t = timestep / 1000`).

Policies (`threshold` 0 never reuses; larger reuses more):

- ``output-change`` (after TeaCache, Liu et al. 2024, arXiv:2411.19108, and MagCache, Ma et al.
  2025, arXiv:2506.09045). TeaCache estimates the relative L1 change of the output between steps
  and accumulates it over skipped steps, computing again once the sum passes a threshold; MagCache
  observes that the size of that change varies smoothly along the schedule, so it can be read off
  a few measured steps. Here the rate of change per unit of flow time is measured between the last
  two computed outputs (`v_a` the newer), `r = |v_a - v_b|_1 / |v_b|_1 / |t_b - t_a|`, and a
  step at `t` reuses `v_a` while the estimated change `r * |t_a - t|` stays under the threshold.
- ``adaptive`` (after AdaCache with motion regularization, Kahatapitiya et al. 2024,
  arXiv:2411.02397). AdaCache sets how many steps follow a computed one from the measured change
  of its output ("a caching rate"), and MoReg caches less when the content moves more. Here the
  measured rate `r` is scaled by the motion of the clip the model currently predicts, `m`, the
  relative L1 difference between neighbouring frames of `x0 = x_t - t v`, calibrated by the
  motion of a typical clip: `d = r * (1 + m / MOTION_SCALE)`. What a reused output costs is the
  drift it puts into the latents: reusing `v_a` at step j moves the latents by
  `|dt_j| * |v_j - v_a| ~ |dt_j| * d * |t_a - t_j| * |v_a|`, so the steps after a computed one
  reuse while the summed relative drift `d * sum_j |dt_j| |t_a - t_j|` stays under the
  threshold. Fast change, much motion or long steps shorten the run of reuses; a still, settled
  clip lengthens it. The last tenth of flow time always computes (`LAST_TIME`): there the rate
  of change climbs steeply (on the packaged model from about 0.2 per unit of flow time mid-way
  to 5-8 at the last step), a rate measured earlier underestimates it, and what a late step
  gets wrong goes straight into the clip with no later pass to correct it.

  Why (benchmarks/step_cache.py, docs/benchmarks.md): with the motion unscaled (`1 + m`) the
  motion term did nothing, since the packaged model's predicted clips move by m = 0.00-0.10, and
  the policy followed the same measured rate as `output-change`, no better at equal passes.
- ``first-block`` (after FBCache, ParaAttention's First Block Cache, as diffusers'
  `FirstBlockCacheConfig` applies it). The first block runs for every row on every step; the
  change of its residual `r_0 = block_0(h) - h` against the residual of the last computed step,
  `|r_0 - r_0'|_1 / |r_0'|_1`, stands in for the change of the whole model's output (the first
  block sees the new latents and time before anything else does). Under the threshold the rows
  skip the remaining blocks and add the residual those blocks made at the last computed step,
  `h_N' - h_1'`, to this step's `h_1`; the model's epilogue (final norm and projection) runs on
  the result with this step's timestep. The decision needs block 0's output, so it is taken
  inside the pass (`StepCache.reuse_probed`): the sampler cuts the forward after block 0. For a
  streamed model a reuse step moves block 0's weights and no others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .request import CACHE_POLICIES, CacheSpec


def relative_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """`|a - b|_1 / |b|_1`, in fp32."""
    a, b = a.float(), b.float()
    # .item(): the answer decides on the host which rows join the next pass, so it must be read
    # back; one read per computed request and step.
    return ((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12)).item()


def frame_motion(x0: torch.Tensor) -> float:
    """Relative L1 difference between neighbouring frames of a clip `(1, C, F, H, W)`: 0 for a
    still clip; about 1.1 for frames of independent noise. 0 for a single frame."""
    if x0.shape[2] < 2:
        return 0.0
    x0 = x0.float()
    diff = (x0[:, :, 1:] - x0[:, :, :-1]).abs().mean()
    # .item(): read on the host for the same reason as in `relative_l1`.
    return (diff / x0.abs().mean().clamp_min(1e-12)).item()


@dataclass
class History:
    """What one expert of one request remembers: its last two computed steps and the drift
    accumulated by the steps that reused since."""

    times: list[float] = field(
        default_factory=list
    )  # flow times of the computed steps, newest last
    outputs: list[torch.Tensor] = field(default_factory=list)
    rate: float = 0.0  # relative change of the output per unit of flow time
    motion: float = 0.0  # frame motion of the predicted clip at the newest computed step
    drift: float = 0.0  # adaptive: estimated relative drift of the reuses since the last compute
    # first-block: the first block's residual `(rows, N, D)` at the newest computed step, and the
    # residual of the blocks after it, `h_N - h_1`, at that step.
    first: torch.Tensor | None = None
    tail: torch.Tensor | None = None

    def record(self, t: float, latents: torch.Tensor, output: torch.Tensor) -> None:
        if self.outputs:
            span = abs(self.times[-1] - t)
            change = relative_l1(output, self.outputs[-1])
            self.rate = change / span if span > 0 else float("inf")
        self.motion = frame_motion(latents.float() - t * output.float())
        self.times = [*self.times[-1:], t]
        self.outputs = [*self.outputs[-1:], output]
        self.drift = 0.0

    @property
    def measured(self) -> bool:
        """Two computed steps: a rate of change to go on."""
        return len(self.outputs) == 2


class StepPolicy(ABC):
    """Decides, before a step, whether a request reuses its last computed output."""

    name: str
    probes = False  # decides inside the pass, from the first block's residual (`reuse_probed`)

    def __init__(self, threshold: float):
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.threshold = threshold

    @abstractmethod
    def reuse(self, history: History, t: float, t_next: float) -> bool:
        """True to reuse at flow time `t` (the step goes on to `t_next`)."""


class OutputChange(StepPolicy):
    """Reuse while the estimated relative change of the output, `rate * |t_a - t|`, is under the
    threshold (TeaCache's accumulated estimate, MagCache's measured rate of change)."""

    name = "output-change"

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        if not history.measured:
            return False
        return history.rate * abs(history.times[-1] - t) < self.threshold


# The frame motion (`frame_motion`) of a typical predicted clip: on the packaged model's benchmark
# prompts it lies in 0.00-0.10, so `m / MOTION_SCALE` runs from 0 (still) to about 2.
MOTION_SCALE = 0.05
# Flow time below which the adaptive policy computes every step (the end of the schedule).
LAST_TIME = 0.1


class Adaptive(StepPolicy):
    """Reuse while the drift the reuses put into the latents, scaled up by the clip's motion,
    stays under the threshold (AdaCache's change-driven caching rate with MoReg); the end of the
    schedule always computes."""

    name = "adaptive"

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        if not history.measured or t_next < LAST_TIME:
            return False
        change = history.rate * (1.0 + history.motion / MOTION_SCALE)  # MoReg: more motion, less
        drift = history.drift + change * abs(t_next - t) * abs(history.times[-1] - t)
        if drift >= self.threshold:
            return False
        history.drift = drift
        return True


class FirstBlock(StepPolicy):
    """Reuse the residual of the blocks after the first while the first block's residual changed
    less than the threshold since the last computed step (FBCache)."""

    name = "first-block"
    probes = True

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        raise TypeError("first-block decides inside the pass: use StepCache.reuse_probed")

    def reuse_probed(self, history: History, residual: torch.Tensor) -> bool:
        if history.first is None:
            return False
        return relative_l1(residual, history.first) < self.threshold


POLICIES: dict[str, type[StepPolicy]] = {p.name: p for p in (OutputChange, Adaptive, FirstBlock)}
assert set(POLICIES) == set(CACHE_POLICIES), "request.CACHE_POLICIES names the policies here"


class StepCache:
    """One request's step cache: its policy, a history per expert, and what ran."""

    def __init__(self, policy: StepPolicy):
        self.policy = policy
        self.histories: dict[int, History] = {}
        self.passes = 0  # steps whose pass this request joined
        self.reused = 0  # steps that took a cached output
        self._decided: tuple[int, int, bool] | None = None  # (step, key, reuse) of the last ask

    @classmethod
    def from_spec(cls, spec: CacheSpec | None) -> StepCache | None:
        """The cache a resolved request asks for (`ResolvedVideo.cache`); None when off."""
        if spec is None:
            return None
        return cls(POLICIES[spec.policy](spec.threshold))

    def reuse(self, step: int, t: float, t_next: float, key: int = 0) -> bool:
        """Whether step `step`, from flow time `t` to `t_next`, reuses the cached output of
        expert `key`; a False must be followed by `record` once the pass ran. Asking again for
        the same step (a pass retried after an error) gives the same answer and counts once."""
        return self._decide(step, key, lambda h: self.policy.reuse(h, float(t), float(t_next)))

    @property
    def probes(self) -> bool:
        """Whether this cache decides inside the pass, from the first block's residual."""
        return self.policy.probes

    def reuse_probed(self, step: int, residual: torch.Tensor, key: int = 0) -> bool:
        """Whether step `step` reuses the cached residual of the blocks after the first, decided
        from this step's first-block residual `(rows, N, D)` (a probing policy's `reuse`); a
        False must be followed by `record_probed` (and `record`) once the pass ran."""
        return self._decide(step, key, lambda h: self.policy.reuse_probed(h, residual))

    def _decide(self, step: int, key: int, ask) -> bool:
        """`ask(history)` once per (step, expert), counted once; a retried pass gets the same
        answer."""
        if self._decided is not None and self._decided[:2] == (step, key):
            return self._decided[2]
        decision = ask(self.histories.setdefault(key, History()))
        if decision:
            self.reused += 1
        else:
            self.passes += 1
        self._decided = (step, key, decision)
        return decision

    def tail(self, key: int = 0) -> torch.Tensor:
        """The residual `h_N - h_1` `(rows, N, D)` of the blocks after the first, last computed."""
        return self.histories[key].tail

    def record_probed(self, first: torch.Tensor, tail: torch.Tensor, key: int = 0) -> None:
        """Remember a computed step's first-block residual and the residual of the blocks after."""
        history = self.histories[key]
        history.first, history.tail = first, tail

    def output(self, key: int = 0) -> torch.Tensor:
        return self.histories[key].outputs[-1]

    def record(self, t: float, latents: torch.Tensor, output: torch.Tensor, key: int = 0) -> None:
        """Remember the output the step at flow time `t` computed from `latents`."""
        self.histories[key].record(float(t), latents, output)
