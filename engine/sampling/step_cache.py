"""Step caches: skip a request's denoising pass when its model output would barely change.

Between neighbouring denoising steps a video DiT's output changes little over long stretches of
the schedule, so a step can reuse the output of an earlier one. For a streamed model a skipped
pass is worth more than elsewhere: it skips the compute *and* the whole transfer of the weights.

A cache sits in the sampler loop (loop.py, shared by every family), one per request:
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
  The final step computes whatever the estimate (as in TeaCache): a reused output there goes
  into the clip undamped by later steps, and the output changes fastest there; on the packaged
  model one clip in five reused it at the `quality` threshold, its three worst among them
  (docs/history.md).
- ``adaptive`` (after MagCache's calibrated curve, Ma et al. 2025, arXiv:2506.09045, and
  AdaCache's per-run error budget, Kahatapitiya et al. 2024, arXiv:2411.02397). How much a step's
  output changes, and how much of a wrong output at that step ends in the clip, both follow
  curves along the schedule that are nearly the same for every prompt of one model. A model's
  `StepCurve` holds them, measured once (`calibrate`, a few prompts: each sampled uncached, and
  once per step with that step alone reusing the step before) and stored beside the weights
  (`step_cache.json`): per step k, the mean relative change `c_k` of the output and the clip's
  MSE `e_k` (over 255^2) when step k alone reuses (one `e` per forecast calibrated, below). From them, the rate of change per unit of
  flow time, and the gain `g(t) = sqrt(e_k) / (dt_k c_k)`: RMS clip error per unit of latent
  error `dt |dv| / |v|` made at that point of the schedule. Reusing `v_a` (computed at `t_a`) at
  a step from `t` to `t_next` is predicted to cost the clip `g(t) |t_next - t| C(t_a, t)`, with
  `C` the calibrated change between the two flow times (the rate's integral); the reuses after a
  computed step go on while their summed cost stays under the threshold, so the threshold is an
  RMS error over 255 per run of reuses (0.01: about 40 dB). On the calibration's own schedule
  the cost of one reuse is exactly the error it was measured to make; other step counts or
  shifts read the curves by flow time. Steps where the clip is sensitive (on the packaged model
  the first seven, where a few prompts decide their shape, and the last) compute, the settled
  middle reuses. Why (docs/history.md): the measured rate of the last two steps said nothing
  of the sensitive steps ahead; scaling the curve by the row's own measured change, or by the
  motion term, did not improve on it consistently. A model without a curve falls back to the
  measured rate scaled by the predicted clip's motion `m` (MoReg: `r (1 + m / MOTION_SCALE)`), its drift
  `r (1 + m / MOTION_SCALE) sum_j |dt_j| |t_a - t_j|`, the last tenth of flow time always
  computing (`LAST_TIME`).
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

Several devices (sequence parallel, parallel/sequence.py). Every rank holds the whole latents and, after
the gather before the epilogue, the whole outputs, exactly equal on every rank: the policies that
decide from them decide alike on every rank, and the forecasts are element-wise. Only block 0's
residual is each rank's own shard of the tokens, so the first-block policy reduces its measure
over the ranks (`relative_l1` with `sp`: the sums of `|a - b|` and of `|b|` all-reduced), and
every rank takes the decision one process would (up to the order of the float sums); each keeps
the residuals of its own tokens. A rank deciding alone could skip a collective its peers wait in.

Forecasting (`CacheSpec.forecast`, with any policy; after FORA's feature reuse, Selvaraju et al.
2024, arXiv:2407.01425, and TaylorSeer's forecast of it, Liu et al. 2025, arXiv:2503.06923).
Without it (`none`, the default) a reuse takes the last computed output as it is. With it a
reuse at flow time `t` takes the polynomial through the last computed outputs, extrapolated in
flow time to `t` (`extrapolate`): `linear` through two, `v_a + (v_a - v_b) (t - t_a) / (t_a -
t_b)`, `quadratic` through three (linear while only two are held). A first-block reuse forecasts
the residual of the blocks after the first in the same way. The forecast comes from computed
outputs only, never from an earlier forecast. The adaptive policy reads the step curve of the
request's forecast: a curve holds the single-reuse clip errors measured without a forecast and,
per forecast calibrated (`calibrate(..., forecasts)`; the packaged model's has `linear`), with
it; a forecast reuse costs more than a plain one where the output bends (the first steps) and
less where it changes smoothly (the middle). Where a model's curve lacks the request's forecast
it reads the plain errors (`Adaptive.curve_forecast` says which), as the other policies decide
as without a forecast: their rate of change describes a plain reuse, so with a forecast they
overstate a reuse's error where the output changes smoothly and understate it where it bends.
"""

from __future__ import annotations

import bisect
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..request import CACHE_FORECASTS, CACHE_POLICIES, CacheSpec


def relative_l1(a: torch.Tensor, b: torch.Tensor, sp=None) -> float:
    """`|a - b|_1 / |b|_1`, in fp32. `sp` (a `parallel.SequenceGroup`): `a` and `b` are this
    rank's shards of the tensors compared, and the norms are summed over the ranks (every rank
    calls it, in the same order: it is a collective), so every rank gets the same answer."""
    a, b = a.float(), b.float()
    if sp is None:
        # .item(): the answer decides on the host which rows join the next pass, so it must be
        # read back; one read per computed request and step.
        return ((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12)).item()
    import torch.distributed as dist

    sums = torch.stack([(a - b).abs().sum(), b.abs().sum()])  # (2,) of this rank's tokens
    dist.all_reduce(sums, group=sp.group)
    # .item(): read on the host as above; after the all-reduce, the same on every rank.
    return (sums[0] / sums[1].clamp_min(1e-12)).item()


def frame_motion(x0: torch.Tensor) -> float:
    """Relative L1 difference between neighbouring frames of a clip `(1, C, F, H, W)`: 0 for a
    still clip; about 1.1 for frames of independent noise. 0 for a single frame."""
    if x0.shape[2] < 2:
        return 0.0
    x0 = x0.float()
    diff = (x0[:, :, 1:] - x0[:, :, :-1]).abs().mean()
    # .item(): read on the host for the same reason as in `relative_l1`.
    return (diff / x0.abs().mean().clamp_min(1e-12)).item()


def extrapolate(times: Sequence[float], values: Sequence[torch.Tensor], t: float) -> torch.Tensor:
    """The polynomial through `(times[i], values[i])` (degree `len(times) - 1`), at `t`: in
    Lagrange's form, `sum_i values[i] prod_{j != i} (t - times[j]) / (times[i] - times[j])`.
    With two points, `v1 + (v1 - v0) (t - t1) / (t1 - t0)`. The weights are computed in float64
    on the host and the sum in fp32 at least (a bf16 output's rounding would otherwise be
    multiplied by the weights, which exceed 1); the result has the values' dtype."""
    if len(times) != len(values) or not values:
        raise ValueError("extrapolate needs as many values as times, and at least one")
    out = torch.zeros_like(values[-1], dtype=torch.promote_types(values[-1].dtype, torch.float32))
    for i, (ti, vi) in enumerate(zip(times, values)):
        w = math.prod((t - tj) / (ti - tj) for j, tj in enumerate(times) if j != i)
        out += w * vi.to(out.dtype)
    return out.to(values[-1].dtype)


FORECAST_ORDERS = {"none": 0, "linear": 1, "quadratic": 2}  # request.CACHE_FORECASTS's degrees
assert tuple(FORECAST_ORDERS) == CACHE_FORECASTS, "request.CACHE_FORECASTS names the orders here"


@dataclass
class History:
    """What one expert of one request remembers: its last computed steps (two, or `order + 1`
    when a reuse forecasts from them) and the drift accumulated by the steps that reused since."""

    order: int = 0  # the degree of the forecast a reuse takes (`FORECAST_ORDERS`); 0: none
    times: list[float] = field(
        default_factory=list
    )  # flow times of the computed steps, newest last
    outputs: list[torch.Tensor] = field(default_factory=list)
    rate: float = 0.0  # relative change of the output per unit of flow time
    change: float = 0.0  # relative change of the output between the last two computed steps
    changes: list[float] = field(default_factory=list)  # every such change, oldest first
    motion: float = 0.0  # frame motion of the predicted clip at the newest computed step
    drift: float = 0.0  # adaptive: estimated relative drift of the reuses since the last compute
    # first-block: the first block's residual `(rows, N, D)` at the newest computed step, and the
    # residuals of the blocks after it, `h_N - h_1`, at the computed steps held (newest last).
    first: torch.Tensor | None = None
    tails: list[torch.Tensor] = field(default_factory=list)

    @property
    def depth(self) -> int:
        """How many computed steps are held: two for the rate of change, more to forecast."""
        return max(2, self.order + 1)

    def record(self, t: float, latents: torch.Tensor, output: torch.Tensor) -> None:
        if self.outputs:
            span = abs(self.times[-1] - t)
            self.change = relative_l1(output, self.outputs[-1])
            self.rate = self.change / span if span > 0 else float("inf")
            self.changes.append(self.change)
        self.motion = frame_motion(latents.float() - t * output.float())
        self.times = [*self.times[1 - self.depth :], t]
        self.outputs = [*self.outputs[1 - self.depth :], output]
        self.drift = 0.0

    def record_probed(self, first: torch.Tensor, tail: torch.Tensor) -> None:
        """A computed step's first-block residual and the residual of the blocks after it (its
        `record` follows, with the step's flow time)."""
        self.first = first
        if self.tails and self.tails[-1].shape != tail.shape:  # other rows: a new history
            self.tails = []
        self.tails = [*self.tails[1 - self.depth :], tail]

    @property
    def measured(self) -> bool:
        """Two computed steps: a rate of change to go on."""
        return len(self.outputs) >= 2

    def forecast(self, values: list[torch.Tensor], t: float) -> torch.Tensor:
        """What a reuse at flow time `t` takes from `values` (outputs or tails, one per computed
        step held, newest last): the newest as it is without a forecast (the very tensor); with
        one, the polynomial of degree `order` through the newest `order + 1` (fewer while fewer
        are held) extrapolated to `t`."""
        n = min(self.order + 1, len(values))
        if n == 1:
            return values[-1]
        return extrapolate(self.times[-n:], values[-n:], t)


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
    threshold (TeaCache's accumulated estimate, MagCache's measured rate of change); the final
    step, the one that lands on the clip, always computes (as TeaCache's)."""

    name = "output-change"

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        if not history.measured or t_next <= 0:
            return False
        return history.rate * abs(history.times[-1] - t) < self.threshold


# The frame motion (`frame_motion`) of a typical predicted clip: on the packaged model's benchmark
# prompts it lies in 0.00-0.10, so `m / MOTION_SCALE` runs from 0 (still) to about 2.
MOTION_SCALE = 0.05
# Flow time below which the adaptive policy computes every step on a model without a step curve.
LAST_TIME = 0.1
CURVE_FILE = "step_cache.json"  # a model directory's step curve (`StepCurve`, `calibrate`)
CURVE_FORMAT = "megaslide-step-curve/1"


@dataclass(frozen=True)
class StepCurve:
    """What a model's uncached trajectories say about reusing an output at each step, measured
    once per model (`calibrate`) and stored beside its weights (`CURVE_FILE`)."""

    times: tuple[float, ...]  # flow times of the calibration schedule, from 1 down to 0
    change: tuple[float, ...]  # mean relative L1 change of the output over step k-1 -> k, k >= 1
    error: tuple[float, ...]  # mean clip MSE / 255^2 when step k alone reuses step k-1's output
    # The same errors with step k's reuse forecasting (`linear`, `quadratic`), per forecast
    # measured; a forecast not here reads `error`.
    forecast_error: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self):
        errors = [self.error, *self.forecast_error.values()]
        if not all(len(self.times) - 2 == len(self.change) == len(e) for e in errors):
            raise ValueError("a step curve has steps + 1 times and steps - 1 changes and errors")
        unknown = set(self.forecast_error) - (set(FORECAST_ORDERS) - {"none"})
        if unknown:
            raise ValueError(f"forecast errors for {sorted(unknown)}: only linear, quadratic")

    @property
    def forecasts(self) -> tuple[str, ...]:
        """The forecasts whose single reuses this curve measured (`none` always)."""
        return ("none", *self.forecast_error)

    def for_forecast(self, forecast: str) -> StepCurve:
        """The curve of reuses that take `forecast` (`none`: plain reuses): the errors those single
        reuses made, the same changes. Raises KeyError for a forecast not measured."""
        error = self.error if forecast == "none" else self.forecast_error[forecast]
        return StepCurve(self.times, self.change, error)

    def rate(self, t: float) -> float:
        """Relative change of the output per unit of flow time at `t` (constant within each
        calibration interval, the end intervals' beyond them)."""
        k = self._interval(t)
        return self.change[k] / max(self.times[k] - self.times[k + 1], 1e-12)

    def _interval(self, t: float) -> int:
        """Index k of the interval `times[k+1] <= t < times[k]` of the changes, clamped."""
        down = [-x for x in self.times[: len(self.change) + 1]]  # ascending
        return min(max(bisect.bisect_right(down, -t) - 1, 0), len(self.change) - 1)

    def between(self, a: float, b: float) -> float:
        """Calibrated relative change of the output from flow time `a` to `b` (the rate's
        integral: a sum of the steps' changes over a stretch of several)."""
        hi, lo = max(a, b), min(a, b)
        edges = sorted({hi, lo, *(x for x in self.times if lo < x < hi)}, reverse=True)
        return sum(self.rate((x + y) / 2) * (x - y) for x, y in zip(edges, edges[1:]))

    def gain(self, t: float) -> float:
        """How much of a latent error `dt * |dv| / |v|` made by a step at flow time `t` ends in
        the clip (RMS over 255), interpolated between the calibration steps."""
        ts = self.times[1:-1]  # the steps that can reuse
        gains = [
            math.sqrt(e) / max((ts[k] - self.times[k + 2]) * self.change[k], 1e-12)
            for k, e in enumerate(self.error)
        ]
        return float(np.interp(-t, [-x for x in ts], gains))

    def to_json(self) -> dict:
        out = {"format": CURVE_FORMAT, **{k: list(getattr(self, k)) for k in _CURVE_KEYS}}
        if self.forecast_error:  # left out without: such a file is the same as before
            out["forecast_error"] = {f: list(e) for f, e in self.forecast_error.items()}
        return out

    @classmethod
    def read(cls, directory: Path | str | None) -> StepCurve | None:
        """A model directory's step curve; None without one. A file written before curves per
        forecast (no `forecast_error`) reads as a curve of plain reuses only."""
        path = Path(directory) / CURVE_FILE if directory is not None else None
        if path is None or not path.is_file():
            return None
        raw = json.loads(path.read_text())
        if raw.get("format") != CURVE_FORMAT:
            raise ValueError(f"{path}: format {raw.get('format')!r}, expected {CURVE_FORMAT}")
        return cls(
            **{k: tuple(float(x) for x in raw[k]) for k in _CURVE_KEYS},
            forecast_error={
                f: tuple(float(x) for x in e) for f, e in raw.get("forecast_error", {}).items()
            },
        )


_CURVE_KEYS = ("times", "change", "error")


class Adaptive(StepPolicy):
    """Reuse while the clip error the reuses are predicted to make, from the model's step curve,
    stays under the threshold (MagCache's calibrated change, AdaCache's per-run error budget);
    without a curve, from the measured rate scaled by the clip's motion (MoReg), the end of the
    schedule always computing."""

    name = "adaptive"

    def __init__(self, threshold: float, curve: StepCurve | None = None, forecast: str = "none"):
        """`curve`: the model's step curve, None without one; `forecast`: what the request's
        reuses take, whose curve is read where the model's has one (`curve_forecast` says
        which was read: `none`, the plain reuses', where it has none for `forecast`)."""
        super().__init__(threshold)
        self.curve_forecast = "none"
        if curve is not None and forecast in curve.forecasts:
            self.curve_forecast = forecast
        self.curve = None if curve is None else curve.for_forecast(self.curve_forecast)

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        if not history.measured:
            return False
        if self.curve is None:
            if t_next < LAST_TIME:
                return False
            change = history.rate * (1.0 + history.motion / MOTION_SCALE)  # MoReg
            error = change * abs(history.times[-1] - t) * abs(t_next - t)
        else:
            change = self.curve.between(history.times[-1], t)  # of the output since computed
            error = self.curve.gain(t) * abs(t_next - t) * change
        drift = history.drift + error
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

    def reuse_probed(self, history: History, residual: torch.Tensor, sp=None) -> bool:
        """`sp`: the residual is this rank's shard of the tokens (see the module docstring).
        A step with other rows than the last computed one (a guidance interval ended: one row
        where there were two) has nothing to compare with, and computes."""
        if history.first is None or history.first.shape != residual.shape:
            return False
        return relative_l1(residual, history.first, sp) < self.threshold


POLICIES: dict[str, type[StepPolicy]] = {p.name: p for p in (OutputChange, Adaptive, FirstBlock)}
assert set(POLICIES) == set(CACHE_POLICIES), "request.CACHE_POLICIES names the policies here"


class StepCache:
    """One request's step cache: its policy, what a reuse takes (`order`: the degree of the
    forecast, 0 for the last computed output as it is), a history per expert, and what ran."""

    def __init__(self, policy: StepPolicy, order: int = 0):
        if order not in FORECAST_ORDERS.values():
            raise ValueError(f"forecast order must be one of {sorted(FORECAST_ORDERS.values())}")
        self.policy = policy
        self.order = order
        self.histories: dict[int, History] = {}
        self.passes = 0  # steps whose pass this request joined
        self.reused = 0  # steps that took a cached output
        self._decided: tuple[int, int, bool] | None = None  # (step, key, reuse) of the last ask

    @classmethod
    def from_spec(cls, spec: CacheSpec | None, curve: StepCurve | None = None) -> StepCache | None:
        """The cache a resolved request asks for (`ResolvedVideo.cache`); None when off. `curve`:
        the model's step curve, for the policies that read one."""
        if spec is None:
            return None
        if spec.policy == Adaptive.name:
            policy = Adaptive(spec.threshold, curve, spec.forecast)
        else:
            policy = POLICIES[spec.policy](spec.threshold)
        return cls(policy, FORECAST_ORDERS[spec.forecast])

    def restart(self) -> None:
        """A new trajectory from fresh noise (an Animate clip's next segment): the outputs held
        say nothing of it, so they go; the counts of passes and reuses go on."""
        self.histories.clear()

    def reuse(self, step: int, t: float, t_next: float, key: int = 0) -> bool:
        """Whether step `step`, from flow time `t` to `t_next`, reuses the cached output of
        expert `key`; a False must be followed by `record` once the pass ran. Asking again for
        the same step (a pass retried after an error) gives the same answer and counts once."""
        return self._decide(step, key, lambda h: self.policy.reuse(h, float(t), float(t_next)))

    @property
    def probes(self) -> bool:
        """Whether this cache decides inside the pass, from the first block's residual."""
        return self.policy.probes

    def reuse_probed(self, step: int, residual: torch.Tensor, key: int = 0, sp=None) -> bool:
        """Whether step `step` reuses the cached residual of the blocks after the first, decided
        from this step's first-block residual `(rows, N, D)` (a probing policy's `reuse`); a
        False must be followed by `record_probed` (and `record`) once the pass ran. `sp` (a
        `parallel.SequenceGroup`): the residual holds this rank's `n` of the `N` tokens, and every
        rank of it asks in the same order (the measure is reduced over them)."""
        return self._decide(step, key, lambda h: self.policy.reuse_probed(h, residual, sp))

    def _decide(self, step: int, key: int, ask) -> bool:
        """`ask(history)` once per (step, expert), counted once; a retried pass gets the same
        answer."""
        if self._decided is not None and self._decided[:2] == (step, key):
            return self._decided[2]
        decision = ask(self.histories.setdefault(key, History(self.order)))
        if decision:
            self.reused += 1
        else:
            self.passes += 1
        self._decided = (step, key, decision)
        return decision

    def tail(self, t: float, key: int = 0) -> torch.Tensor:
        """The residual `h_N - h_1` `(rows, N, D)` of the blocks after the first that a reuse at
        flow time `t` takes: the last computed, or its forecast at `t`."""
        history = self.histories[key]
        return history.forecast(history.tails, float(t))

    def record_probed(self, first: torch.Tensor, tail: torch.Tensor, key: int = 0) -> None:
        """Remember a computed step's first-block residual and the residual of the blocks after."""
        self.histories[key].record_probed(first, tail)

    def output(self, t: float, key: int = 0) -> torch.Tensor:
        """The output a reuse at flow time `t` takes: the last computed, or its forecast at `t`."""
        history = self.histories[key]
        return history.forecast(history.outputs, float(t))

    def record(self, t: float, latents: torch.Tensor, output: torch.Tensor, key: int = 0) -> None:
        """Remember the output the step at flow time `t` computed from `latents`."""
        self.histories[key].record(float(t), latents, output)


class _Trace(StepPolicy):
    """Never reuses; notes the flow time of each step and the output's change at each record."""

    name = "trace"

    def __init__(self):
        super().__init__(0.0)
        self.times: list[float] = []

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        self.times[len(self.times) - 1 :] = [t, t_next]
        return False


class _ReuseAt(StepPolicy):
    """Reuses at step `step` only (the sensitivity of the clip to that one step)."""

    name = "reuse-at"

    def __init__(self, step: int):
        super().__init__(0.0)
        self.step, self.asked = step, 0

    def reuse(self, history: History, t: float, t_next: float) -> bool:
        self.asked += 1
        return self.asked - 1 == self.step


def calibrate(pipe, requests: Sequence, forecasts: Sequence[str] = ("none",)) -> StepCurve:
    """Measure a model's step curve: each request (`VideoRequest`, no cache) is sampled once
    uncached, noting the output's relative change at every step, and, per forecast in
    `forecasts` (plain reuse, `none`, always), once per step k >= 1 with only step k reusing
    (step k-1's output as it is, or forecast from the steps before), noting the clip's MSE
    against the uncached one. The curve is the mean over the requests (deterministic: seeded
    requests, no randomness here). Costs `1 + (steps - 1) n` samples per request, `n` the
    forecasts measured (`none` counted)."""
    forecasts = ["none", *(f for f in dict.fromkeys(forecasts) if f != "none")]
    unknown = set(forecasts) - set(FORECAST_ORDERS)
    if unknown:
        raise ValueError(f"forecasts {sorted(unknown)} are unknown; known: {CACHE_FORECASTS}")
    changes, times = [], None
    errors: dict[str, list[list[float]]] = {f: [] for f in forecasts}
    for request in requests:
        video = pipe.resolve(request)
        state = pipe.prepare(video)
        trace = _Trace()
        state.cache = StepCache(trace)
        reference = _run(pipe, state)
        times = times or trace.times
        changes.append(state.cache.histories[0].changes)
        for forecast in forecasts:
            errors[forecast].append([])
            for k in range(1, len(trace.times) - 1):
                state = pipe.prepare(video)
                state.cache = StepCache(_ReuseAt(k), FORECAST_ORDERS[forecast])
                clip = _run(pipe, state)
                mse = float(np.mean((clip.astype(np.float64) - reference) ** 2)) / 255**2
                errors[forecast][-1].append(mse)
    mean = {f: tuple(np.mean(e, axis=0).tolist()) for f, e in errors.items()}
    return StepCurve(
        tuple(times),
        tuple(np.mean(changes, axis=0).tolist()),
        mean.pop("none"),
        forecast_error=mean,
    )


def _run(pipe, state) -> np.ndarray:
    while not state.done:
        pipe.denoise_step([state])
    return pipe.finish(state).astype(np.float64)
