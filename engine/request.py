"""One video request, resolved once: defaults filled from the model, every limit checked.

The HTTP API, the CLI and the worker all speak `VideoRequest` (what was asked, `None` where the
model's default should apply) and `ResolvedVideo` (every field concrete and valid for one model).
`resolve(request, limits, defaults)` is the only place a video request is validated; its errors
(`RequestError`) name the parameter at fault. A resolved request is stored as it is and handed to
the model's pipeline unchanged.

No torch here: a request is checked against the model's `ModelLimits`, which come from its config.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from .native.config import SAMPLERS, SamplingDefaults

# Seeds are below 2**53, so that every client reads them back exactly: JavaScript's numbers (the
# playground's, any browser's JSON.parse) hold integers up to 2**53 and round above it.
SEED_LIMIT = 2**53
RANDOM_SEED_BITS = 31  # an unseeded request gets a seed below 2**31, echoed back

# Step caches (engine/sampling/step_cache.py holds the policies and their maths): a request names a policy
# and a threshold, or a preset. Off unless asked for. The presets are points measured on the
# packaged model at 20 steps (benchmarks/step_cache.py; their passes and PSNR are the table in
# docs/benchmarks.md, "Step caches"), adherence unchanged. All three are output-change: it
# decides per clip from the clip's own measured change, which protects the few clips that settle
# late; the adaptive policy's calibrated curve gives every clip the same steps, and its worst
# clip fell behind at these speeds (docs/history.md). Output-change needs no curve, so the
# presets mean the same on any model. quality and balanced forecast their reuses linearly (short
# runs of reuses: the worst clip rose); fast does not (it lost in PSNR).
CACHE_POLICIES = ("output-change", "adaptive", "first-block")
# What a reused step takes, with any policy: the last computed output as it is ("none"), or the
# output forecast at the step's flow time from the last two ("linear") or three ("quadratic")
# computed outputs (engine/sampling/step_cache.py, `extrapolate`).
CACHE_FORECASTS = ("none", "linear", "quadratic")
CACHE_PRESETS = {
    "quality": {"policy": "output-change", "threshold": 0.035, "forecast": "linear"},
    "balanced": {"policy": "output-change", "threshold": 0.05, "forecast": "linear"},
    "fast": {"policy": "output-change", "threshold": 0.13},
}
MAX_CACHE_THRESHOLD = 100.0

# Video-to-video: the fraction of the schedule a request runs from its noised input video when it
# names none (diffusers' `WanVideoToVideoPipeline` default).
DEFAULT_STRENGTH = 0.8

# VACE: the weight of the VACE blocks' hints when a request names none (diffusers'
# `WanVACEPipeline` default), the largest a request may set, and the reference images one request
# may bring (each adds a latent frame to the clip the transformer sees).
DEFAULT_CONDITIONING_SCALE = 1.0
MAX_CONDITIONING_SCALE = 10.0
MAX_REFERENCE_IMAGES = 4

TRAIN_TIMESTEPS = 1000  # the flow-matching models' timestep scale: 1000 is pure noise


class RequestError(ValueError):
    """A request a model cannot take; `param` names the field as the request spells it."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def count_utf8_bytes(prompt: str) -> int:
    return len(prompt.encode("utf-8"))


@dataclass(frozen=True)
class ModelLimits:
    """What a model accepts, in pixel-space units (what it fills in for an absent field is its
    `SamplingDefaults`, native/config.py)."""

    max_frames: int
    max_size: int  # largest width or height
    size_multiple: tuple[int, int]  # (height, width) must be multiples of these
    frames_multiple: int  # frames - frames_offset must be a multiple of this
    max_prompt_tokens: int  # in the model's own tokens
    frames_offset: int = 0  # e.g. 1 for a causal video VAE (frames = 4k + 1)
    image_input: bool = False  # takes a first-frame image (image-to-video)
    image_required: bool = False  # and needs one (an image-to-video model makes nothing without)
    # A last-frame image besides the first (first-last-frame-to-video), and whether it needs one.
    last_image_input: bool = False
    last_image_required: bool = False
    video_input: bool = False  # takes an input video to remake (video-to-video, with a strength)
    # VACE: reference images, a control video and its mask, with a conditioning scale.
    vace_input: bool = False
    # Animate: a pose video and a face video (with `image`, the character), and for replacing a
    # person a background video and its mask.
    animate_input: bool = False
    experts: int = 1  # denoisers that split the noise levels (fine-tuning trains one at a time)
    cache_policies: tuple[str, ...] = CACHE_POLICIES  # the step-cache policies its sampler runs
    prompt_unit: str = "bytes (UTF-8)"
    count_tokens: Callable[[str], int] = count_utf8_bytes
    # The model's exact shape rule (ValueError naming the problem) beyond the fields above, e.g.
    # 3D-DSA's tiling of the token grid.
    check_shape: Callable[[int, int, int], None] | None = None

    def to_dict(self) -> dict:
        """The limits as the API lists them (defaults apart)."""
        return {
            "max_frames": self.max_frames,
            "max_size": self.max_size,
            "size_multiple": list(self.size_multiple),
            "frames_multiple": self.frames_multiple,
            "frames_offset": self.frames_offset,
            "max_prompt_tokens": self.max_prompt_tokens,
            "prompt_unit": self.prompt_unit,
            "image_input": self.image_input,
            "image_required": self.image_required,
            "last_image_input": self.last_image_input,
            "last_image_required": self.last_image_required,
            "video_input": self.video_input,
            "vace_input": self.vace_input,
            "animate_input": self.animate_input,
            "experts": self.experts,
            "cache_policies": list(self.cache_policies),
        }

    def check_clip(self, frames: int, width: int, height: int, *, param: str = "size") -> None:
        """Raise RequestError unless the model can make (or train on) a clip of this shape.

        `param` names the field the size came from; frame errors name "num_frames".
        """
        mh, mw = self.size_multiple
        if min(width, height) < 1 or max(width, height) > self.max_size:
            raise RequestError(
                f"size {width}x{height}: this model takes at most {self.max_size} pixels per side",
                param=param,
            )
        if height % mh or width % mw:
            raise RequestError(
                f"size {width}x{height}: width must be a multiple of {mw} and height of {mh} "
                "for this model",
                param=param,
            )
        if not 1 <= frames <= self.max_frames:
            raise RequestError(
                f"num_frames ({frames}): this model takes 1 to {self.max_frames} frames",
                param="num_frames",
            )
        if (frames - self.frames_offset) % self.frames_multiple:
            rule = (
                f"{self.frames_multiple}k + {self.frames_offset}"
                if self.frames_offset
                else (f"a multiple of {self.frames_multiple}")
            )
            raise RequestError(f"num_frames ({frames}) must be {rule}", param="num_frames")
        if self.check_shape is not None:
            try:
                self.check_shape(frames, height, width)
            except ValueError as e:
                raise RequestError(str(e), param=param) from None

    def fit_frames(self, available: int) -> int:
        """The longest clip this model makes from `available` frames (an input video's): the
        frame rule's largest length that is no longer (its shortest clip when none is)."""
        n = max(min(available, self.max_frames) - self.frames_offset, 0)
        shortest = 0 if self.frames_offset else self.frames_multiple
        return max(n - n % self.frames_multiple, shortest) + self.frames_offset

    def check_prompt(self, text: str, param: str, max_chars: int | None = None) -> None:
        if max_chars is not None and len(text) > max_chars:
            raise RequestError(
                f"{param} is {len(text)} characters; at most {max_chars} are accepted",
                param=param,
                code="prompt_too_long",
            )
        n = self.count_tokens(text)
        if n > self.max_prompt_tokens:
            raise RequestError(
                f"{param} is {n} {self.prompt_unit}; this model takes at most "
                f"{self.max_prompt_tokens}",
                param=param,
                code="prompt_too_long",
            )


@dataclass(frozen=True)
class LoraChoice:
    """One LoRA adapter a request applies: registered under `name`, at `scale`, on every expert
    of the model (`expert=None`) or only on Wan2.2's "high"- or "low"-noise one."""

    name: str
    scale: float = 1.0
    expert: str | None = None

    @classmethod
    def parse(cls, value) -> LoraChoice:
        """From a `LoraChoice`, a dict `{"name", "scale", "expert"}`, or `"NAME[:SCALE]"`."""
        if isinstance(value, LoraChoice):
            return value
        if isinstance(value, str):
            name, _, scale = value.partition(":")
            try:
                return cls(name, float(scale) if scale else 1.0)
            except ValueError:
                raise RequestError(
                    f"lora {value!r}: the scale after ':' must be a number", param="loras"
                ) from None
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"name", "scale", "expert"})
            if unknown or "name" not in value:
                problem = f"unknown field {unknown[0]!r}" if unknown else "no name"
                raise RequestError(f"loras entry {value!r}: {problem}", param="loras")
            return cls(value["name"], value.get("scale", 1.0), value.get("expert"))
        raise RequestError(f"loras entry {value!r} is not an object", param="loras")


MAX_LORAS = 8  # adapters one request may apply


@dataclass(frozen=True)
class VideoRequest:
    """A video as asked for; `None` takes the model's default (a random seed for `seed`)."""

    prompt: str
    negative_prompt: str | None = None
    frames: int | None = None
    seconds: float | None = None  # clip length: frames = round(seconds * fps)
    width: int | None = None
    height: int | None = None
    fps: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    image: str | None = None  # a first-frame image file, for a model that takes one
    last_image: str | None = None  # a last-frame image file (first-last-frame-to-video)
    # An input video file to remake (video-to-video): its first `frames` frames, resized to the
    # clip, noised to the `strength` fraction of the schedule (default DEFAULT_STRENGTH) and
    # denoised from there.
    video: str | None = None
    strength: float | None = None
    # VACE (a model whose limits say `vace_input`): images of what the clip shows (each resized
    # into the clip's frame on white), a control video (its first `frames` frames, resized to the
    # clip) and a video of masks over it (white: generate, black: keep the control video), and the
    # weight of the VACE blocks' hints (default DEFAULT_CONDITIONING_SCALE).
    reference_images: tuple[str, ...] = ()
    control_video: str | None = None
    mask: str | None = None
    conditioning_scale: float | None = None
    # Animate (a model whose limits say `animate_input`; `image` is the character): a pose video
    # and a face video (their first `frames` frames), and to replace the person of a video rather
    # than animate the character on black, that background video and a mask video (white: the
    # person to replace), given together. Pose and face extraction stays outside. The clip is
    # made in segments of `segment_frame_length` frames (default: the clip, one segment), each
    # after the first continuing the last `prev_segment_conditioning_frames` (1 or 5, default 1)
    # frames of the one before, as diffusers' WanAnimatePipeline makes them.
    pose_video: str | None = None
    face_video: str | None = None
    background_video: str | None = None
    background_mask: str | None = None
    segment_frame_length: int | None = None
    prev_segment_conditioning_frames: int | None = None
    loras: tuple[LoraChoice, ...] = ()  # LoRA adapters to apply, in order
    # A step cache: a preset's name ("fast", ...), or {"policy": ..., "threshold": ...,
    # "forecast": ...} (forecast optional, "none" by default); None or "off": every step runs
    # its pass.
    cache: str | dict | None = None
    # A fine-tune of the model kept as a delta over it (deltas.py), by the name it was
    # registered under; None: the model itself.
    fine_tune: str | None = None
    sampler: str | None = None  # one of SAMPLERS
    # The timesteps an "euler" or "consistency" sampler visits, from 1000 (noise) down.
    timesteps: tuple[int, ...] | None = None
    shift: float | None = None  # the schedule's timestep shift
    # (start, end): classifier-free guidance only on the steps in this fraction of the
    # schedule, e.g. (0, 0.5) on the first half; None: on every step.
    guidance_interval: tuple[float, float] | None = None


@dataclass(frozen=True)
class CacheSpec:
    """A step cache as resolved: which policy, its threshold (0 reuses nothing), and what a
    reused step takes (`CACHE_FORECASTS`)."""

    policy: str
    threshold: float
    forecast: str = "none"

    def to_dict(self) -> dict:
        """As a request spells it; `forecast` only when on, so that a cache without one reads
        back as it always did."""
        d = {"policy": self.policy, "threshold": self.threshold}
        if self.forecast != "none":
            d["forecast"] = self.forecast
        return d


def resolve_cache(value: str | dict | None) -> CacheSpec | None:
    """A request's `cache` field as a `CacheSpec` (None: off); RequestError naming `cache`."""
    if value is None or value == "off":
        return None
    if isinstance(value, str):
        if value not in CACHE_PRESETS:
            raise RequestError(
                f"cache preset {value!r} is unknown; known: off, {', '.join(CACHE_PRESETS)}",
                param="cache",
            )
        return CacheSpec(**CACHE_PRESETS[value])
    if not isinstance(value, dict):
        raise RequestError(
            "cache must be a preset name or an object with policy and threshold", param="cache"
        )
    unknown = set(value) - {"policy", "threshold", "forecast"}
    if unknown:
        raise RequestError(
            f"cache: unknown field(s) {', '.join(sorted(unknown))}; give policy and threshold "
            "(and optionally forecast)",
            param="cache",
        )
    policy = value.get("policy")
    if policy == "off":
        return None
    if policy not in CACHE_POLICIES:
        raise RequestError(
            f"cache policy {policy!r} is unknown; known: off, {', '.join(CACHE_POLICIES)}",
            param="cache",
        )
    threshold = value.get("threshold")
    if threshold is None:
        raise RequestError(f"cache policy {policy!r} needs a threshold", param="cache")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not 0 <= threshold <= MAX_CACHE_THRESHOLD
    ):
        raise RequestError(
            f"cache threshold must be a number in [0, {MAX_CACHE_THRESHOLD:g}], got {threshold!r}",
            param="cache",
        )
    forecast = value.get("forecast", "none")
    if forecast not in CACHE_FORECASTS:
        raise RequestError(
            f"cache forecast {forecast!r} is unknown; known: {', '.join(CACHE_FORECASTS)}",
            param="cache",
        )
    return CacheSpec(policy, float(threshold), forecast)


# Wan Animate's videos, by their field on a request (and on the API).
ANIMATE_VIDEOS = ("pose_video", "face_video", "background_video", "background_mask")
# and the fields that cut its clip into segments.
ANIMATE_SEGMENTS = ("segment_frame_length", "prev_segment_conditioning_frames")

# The fields of `ResolvedVideo` that name a file the request brought (stored by a server, which
# keys repeats by their bytes and resolves them on the worker's side), and those that name several.
INPUT_FILES = ("image", "last_image", "video", "control_video", "mask", *ANIMATE_VIDEOS)
INPUT_FILE_LISTS = ("reference_images",)


@dataclass(frozen=True)
class ResolvedVideo:
    """A video request with every field concrete and valid for the model it names."""

    model: str
    prompt: str
    negative_prompt: str
    frames: int
    width: int
    height: int
    fps: int
    steps: int
    guidance: float
    seed: int
    image: str | None = None
    last_image: str | None = None
    video: str | None = None
    strength: float | None = None  # with `video` only: the fraction of the schedule that runs
    reference_images: tuple[str, ...] = ()
    control_video: str | None = None
    mask: str | None = None
    conditioning_scale: float | None = None  # a VACE model's requests only (others: None)
    pose_video: str | None = None
    face_video: str | None = None
    background_video: str | None = None
    background_mask: str | None = None
    # An Animate model's requests only (others: None): the frames of a segment and those each
    # segment after the first carries over from the one before.
    segment_frame_length: int | None = None
    prev_segment_conditioning_frames: int | None = None
    cache: CacheSpec | None = None  # rows with and without a cache share a pass
    loras: tuple[LoraChoice, ...] = ()
    # The sampling schedule's shift when the request or an adapter sets one (a step-distilled
    # adapter); None: the model's own.
    shift: float | None = None
    fine_tune: str | None = None  # a fine-tune served as a delta over `model`'s base weights
    sampler: str = "scheduler"  # one of SAMPLERS
    timesteps: tuple[int, ...] | None = None  # an explicit schedule's: one per step
    guidance_interval: tuple[float, float] | None = None  # None: guidance on every step

    def guided_at(self, step: int) -> bool:
        """Whether step `step` is in the guidance interval (`guided_at` below)."""
        return guided_at(self.guidance_interval, step, self.steps)

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one denoising pass: same base weights, latent shape
        and schedule length (adapters are applied per row, and fine-tunes kept as deltas per
        group of rows, so neither splits a batch). VACE's reference images are latent frames
        of their own."""
        frames = (self.frames, len(self.reference_images)) if self.reference_images else self.frames
        if self.segment_frame_length is not None:  # Animate: a segment's latents, whatever the clip
            frames = ("segment", self.segment_frame_length)
        return (self.model, frames, self.height, self.width, self.steps)

    @property
    def seconds(self) -> float:
        return self.frames / self.fps

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cache"] = None if self.cache is None else self.cache.to_dict()
        d["loras"] = [dataclasses.asdict(c) for c in self.loras]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ResolvedVideo:
        fields = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in fields}
        if d.get("cache") is not None:
            d["cache"] = CacheSpec(**d["cache"])
        d["loras"] = tuple(LoraChoice(**c) for c in d.get("loras") or ())
        for key in ("timesteps", "guidance_interval", "reference_images"):  # JSON gives lists
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)


def guided_at(interval: tuple[float, float] | None, step: int, steps: int) -> bool:
    """Whether step `step` of `steps` lies in a guidance interval (start, end), fractions of the
    schedule: step i of n does when `start * n <= i < end * n`; every step does when `interval`
    is None. (The guidance scale decides whether a request is guided at all.)"""
    if interval is None:
        return True
    start, end = interval
    return start * steps <= step < end * steps


def parse_size(text: str, param: str = "size") -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height), both positive; RequestError naming `param` otherwise."""
    try:
        w, h = (int(v) for v in text.lower().strip().split("x"))
    except ValueError:
        raise RequestError(
            f"{param} must look like WIDTHxHEIGHT (e.g. 64x64), got {text!r}", param=param
        ) from None
    if w < 1 or h < 1:
        raise RequestError(f"{param} {text}: width and height must be positive", param=param)
    return w, h


def check_even(width: int, height: int, param: str = "size") -> None:
    """H.264 in yuv420p keeps one chroma sample per 2x2 pixels: an MP4's sides must be even."""
    if width % 2 or height % 2:
        raise RequestError(
            f"size {width}x{height}: width and height must be even (H.264 yuv420p)", param=param
        )


def _positive(value, name: str) -> None:
    if value is not None and value < 1:
        raise RequestError(f"{name} must be at least 1, got {value}", param=name)


def resolve(
    request: VideoRequest,
    limits: ModelLimits,
    defaults: SamplingDefaults,
    *,
    model: str,
    max_steps: int | None = None,
    max_prompt_chars: int | None = None,
    adapters: Mapping[str, Mapping] | None = None,
    fine_tunes: Collection[str] = (),
) -> ResolvedVideo:
    """Fill `request`'s absent fields from the model's `defaults` and check every `limits`.

    `max_steps` and `max_prompt_chars` are a server's own caps on top of the model's. `adapters`
    maps the model's registered LoRA adapters to the sampling defaults each carries (a
    step-distilled adapter: few steps, no guidance, its own shift); the first adapter a request
    names that has defaults fills the steps and guidance the request leaves out, and sets the
    schedule's shift. `fine_tunes` names the fine-tunes registered on the model as deltas.
    Raises RequestError naming the parameter at fault (as the HTTP API spells it).
    """
    if request.fine_tune is not None and request.fine_tune not in fine_tunes:
        raise RequestError(
            f"{model} has no fine-tune {request.fine_tune!r} registered", param="fine_tune"
        )
    loras = check_loras(request.loras, limits, adapters)
    adapter_defaults = next((adapters[c.name] for c in loras if adapters and adapters[c.name]), {})
    if not request.prompt.strip():
        raise RequestError("prompt must not be empty", param="prompt")
    negative = request.negative_prompt or ""
    limits.check_prompt(request.prompt, "prompt", max_prompt_chars)
    limits.check_prompt(negative, "negative_prompt", max_prompt_chars)
    for name, value in (("num_frames", request.frames), ("fps", request.fps)):
        _positive(value, name)
    _positive(request.steps, "num_inference_steps")

    width = defaults.width if request.width is None else request.width
    height = defaults.height if request.height is None else request.height
    check_even(width, height)
    fps = request.fps or defaults.fps
    frames = _clip_frames(request, limits, defaults.frames, fps, width, height)

    sampler, timesteps, steps, shift = _schedule(request, defaults, adapter_defaults, max_steps)
    guidance = _guidance(request, defaults, adapter_defaults)
    interval = _guidance_interval(request.guidance_interval)
    # The video first: a model that takes none says so before asking for the image it needs.
    strength = check_video(request.video, request.strength, request.image, limits)
    check_image(request.image, limits)
    check_last_image(request.last_image, request.image, frames, limits)
    scale = check_vace(request, frames, limits)
    segments = check_animate(request, frames, limits)
    if strength is not None and kept_steps(steps, strength) < 1:
        raise RequestError(
            f"strength {strength:g} of {steps} steps runs none of them: at least "
            f"{1 / steps:.3g} is needed",
            param="strength",
        )
    cache = _cache_for(request.cache, limits)
    seed = _seed(request.seed)
    return ResolvedVideo(
        model=model,
        prompt=request.prompt,
        negative_prompt=negative,
        frames=frames,
        width=width,
        height=height,
        fps=fps,
        steps=steps,
        guidance=guidance,
        seed=seed,
        image=request.image,
        last_image=request.last_image,
        video=request.video,
        strength=strength,
        reference_images=tuple(request.reference_images),
        control_video=request.control_video,
        mask=request.mask,
        conditioning_scale=scale,
        pose_video=request.pose_video,
        face_video=request.face_video,
        background_video=request.background_video,
        background_mask=request.background_mask,
        segment_frame_length=segments and segments[0],
        prev_segment_conditioning_frames=segments and segments[1],
        cache=cache,
        loras=loras,
        shift=shift,
        fine_tune=request.fine_tune,
        sampler=sampler,
        timesteps=timesteps,
        guidance_interval=interval,
    )


def _clip_frames(
    request: VideoRequest, limits: ModelLimits, default: int, fps: int, width: int, height: int
) -> int:
    """The clip's frames, from `num_frames` or `seconds` at `fps`, checked against the model's
    limits (a limit the seconds broke names `seconds`)."""
    frames = default if request.frames is None else request.frames
    if request.seconds is not None:
        seconds = request.seconds
        if not math.isfinite(seconds) or seconds <= 0:
            raise RequestError(
                f"seconds must be a positive number, got {seconds!r}", param="seconds"
            )
        if seconds * fps > limits.max_frames + 0.5:  # also keeps huge values from overflowing
            raise RequestError(
                f"seconds ({seconds:g} s at {fps} fps = {seconds * fps:.0f} frames): this model "
                f"takes 1 to {limits.max_frames} frames ({limits.max_frames / fps:g} s at {fps} fps)",
                param="seconds",
            )
        from_seconds = round(request.seconds * fps)
        if request.frames is not None and from_seconds != request.frames:
            raise RequestError(
                f"seconds ({request.seconds:g}) and num_frames ({request.frames}) disagree at "
                f"{fps} fps; give one of them",
                param="seconds",
            )
        frames = from_seconds
    try:
        limits.check_clip(frames, width, height)
    except RequestError as e:
        if e.param == "num_frames" and request.frames is None and request.seconds is not None:
            raise RequestError(
                f"seconds ({request.seconds:g} s at {fps} fps = {frames} frames): {e}",
                param="seconds",
            ) from None
        raise
    return frames


def _schedule(
    request: VideoRequest,
    defaults: SamplingDefaults,
    adapter_defaults: Mapping,
    max_steps: int | None,
) -> tuple[str, tuple[int, ...] | None, int, float | None]:
    """The sampler, its timesteps, the number of steps and the shift: each the request's, else
    the first adapter's defaults, else the model's. An explicit schedule's steps are its
    timesteps; one left out is spread evenly over `steps` (`even_timesteps`). A default list of
    timesteps is kept only while the request asks for as many steps as it holds."""
    sampler = request.sampler or adapter_defaults.get("sampler") or defaults.sampler
    if sampler not in SAMPLERS:
        raise RequestError(
            f"sampler {sampler!r} is unknown; known: {', '.join(SAMPLERS)}", param="sampler"
        )
    if request.shift is not None and not (math.isfinite(request.shift) and request.shift > 0):
        raise RequestError(f"shift must be a positive number, got {request.shift}", param="shift")
    shift = request.shift if request.shift is not None else adapter_defaults.get("shift")
    timesteps = None
    if request.timesteps is not None:
        if sampler == "scheduler":
            raise RequestError(
                "timesteps need the euler or consistency sampler (the model's scheduler spaces "
                "its own)",
                param="timesteps",
            )
        timesteps = check_timesteps(request.timesteps, param="timesteps")
        if request.steps is not None and request.steps != len(timesteps):
            raise RequestError(
                f"num_inference_steps ({request.steps}) and timesteps ({len(timesteps)} of them) "
                "disagree; give one of them",
                param="num_inference_steps",
            )
    elif sampler != "scheduler":
        listed = adapter_defaults.get("timesteps") or defaults.timesteps
        if listed is not None and request.steps in (None, len(listed)):
            timesteps = tuple(listed)
    steps = (
        len(timesteps)
        if timesteps is not None
        else request.steps or adapter_defaults.get("steps") or defaults.steps
    )
    if max_steps is not None and steps > max_steps:
        raise RequestError(
            f"num_inference_steps ({steps}) exceeds this server's limit of {max_steps}",
            param="num_inference_steps",
        )
    if sampler != "scheduler" and timesteps is None:
        timesteps = even_timesteps(steps)
    return sampler, timesteps, steps, shift


def even_timesteps(steps: int) -> tuple[int, ...]:
    """`steps` timesteps spread evenly from 1000 down: 4 -> (1000, 750, 500, 250)."""
    return tuple(int(TRAIN_TIMESTEPS - i * TRAIN_TIMESTEPS / steps) for i in range(steps))


def check_timesteps(value, *, param: str) -> tuple[int, ...]:
    """An explicit schedule: whole numbers in [1, 1000], strictly decreasing (RequestError
    naming `param` otherwise)."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise RequestError(f"{param} must be a list of whole numbers", param=param)
    steps = list(value)
    whole = all(
        isinstance(t, int | float) and not isinstance(t, bool) and float(t).is_integer()
        for t in steps
    )
    if not steps or not whole:
        raise RequestError(
            f"{param} must be a non-empty list of whole numbers, got {value!r}", param=param
        )
    steps = [int(t) for t in steps]
    if not all(1 <= t <= TRAIN_TIMESTEPS for t in steps):
        raise RequestError(
            f"{param} must lie in [1, {TRAIN_TIMESTEPS}] ({TRAIN_TIMESTEPS}: pure noise), got "
            f"{steps}",
            param=param,
        )
    if any(a <= b for a, b in zip(steps, steps[1:])):
        raise RequestError(f"{param} must be strictly decreasing, got {steps}", param=param)
    return tuple(steps)


def _guidance(
    request: VideoRequest, defaults: SamplingDefaults, adapter_defaults: Mapping
) -> float:
    """The guidance scale: the request's, else the first adapter's default, else the model's."""
    guidance = request.guidance
    if guidance is None:
        guidance = adapter_defaults.get("guidance", defaults.guidance)
    if not math.isfinite(guidance) or guidance < 0:
        raise RequestError(
            f"guidance_scale must be a finite number >= 0, got {guidance}", param="guidance_scale"
        )
    return guidance


def _guidance_interval(value) -> tuple[float, float] | None:
    """`guidance_interval` as (start, end) with 0 <= start < end <= 1; None: every step."""
    if value is None:
        return None
    try:
        start, end = (float(v) for v in value)
    except (TypeError, ValueError):
        raise RequestError(
            f"guidance_interval must be two numbers [start, end], got {value!r}",
            param="guidance_interval",
        ) from None
    if not 0 <= start < end <= 1:
        raise RequestError(
            f"guidance_interval [{start:g}, {end:g}] must satisfy 0 <= start < end <= 1 "
            "(fractions of the schedule)",
            param="guidance_interval",
        )
    return None if (start, end) == (0.0, 1.0) else (start, end)


def _cache_for(value: str | dict | None, limits: ModelLimits) -> CacheSpec | None:
    """The request's step cache, when the model takes its policy."""
    cache = resolve_cache(value)
    if cache is not None and cache.policy not in limits.cache_policies:
        raise RequestError(
            f"cache policy {cache.policy!r} is not available for this model; it takes "
            f"{', '.join(limits.cache_policies) or 'none'}",
            param="cache",
            code="unsupported_parameter",
        )
    return cache


def _seed(seed: int | None) -> int:
    """The request's seed, or a random one when it names none."""
    if seed is None:
        seed = secrets.randbelow(2**RANDOM_SEED_BITS)
    elif not 0 <= seed < SEED_LIMIT:
        raise RequestError(f"seed must be in [0, 2**53), got {seed}", param="seed")
    return seed


def check_adapter_defaults(defaults: Mapping, max_steps: int | None) -> None:
    """RequestError when an adapter's sampling defaults (see `resolve`) ask for more steps than
    a request may: every video naming it would be refused, so it is refused once instead."""
    steps = len(defaults["timesteps"]) if defaults.get("timesteps") else defaults.get("steps")
    if steps is not None and max_steps is not None and steps > max_steps:
        raise RequestError(
            f"sampling default steps={steps} exceeds this server's limit of {max_steps} "
            "num_inference_steps",
            param="steps",
        )


def check_image(image: str | None, limits: ModelLimits) -> None:
    """RequestError unless the model takes this first-frame image (a file that exists), or does
    without one."""
    if image is None:
        if limits.image_required:
            raise RequestError(
                "this model makes a video from a first-frame image: give one (input_reference)",
                param="input_reference",
            )
        return
    if not limits.image_input:
        raise RequestError(
            "this model does not take a first-frame image (input_reference)",
            param="input_reference",
            code="unsupported_parameter",
        )
    if not Path(image).is_file():
        raise RequestError(f"image {image} not found", param="input_reference")


def check_last_image(
    last_image: str | None, image: str | None, frames: int, limits: ModelLimits
) -> None:
    """RequestError unless the model takes this last-frame image (with a first frame, a clip of
    two frames or more), or does without one."""
    if last_image is None:
        if limits.last_image_required and image is not None:
            raise RequestError(
                "this model makes a video from a first and a last frame: give the last one too "
                "(last_frame)",
                param="last_frame",
            )
        return
    if not limits.last_image_input:
        raise RequestError(
            "this model does not take a last-frame image (last_frame)",
            param="last_frame",
            code="unsupported_parameter",
        )
    if image is None:
        raise RequestError(
            "a last frame (last_frame) needs a first frame (input_reference)", param="last_frame"
        )
    if frames < 2:
        raise RequestError(
            f"num_frames ({frames}): a clip from a first and a last frame has two or more",
            param="num_frames",
        )
    if not Path(last_image).is_file():
        raise RequestError(f"image {last_image} not found", param="last_frame")


def check_video(
    video: str | None, strength: float | None, image: str | None, limits: ModelLimits
) -> float | None:
    """The strength of a video-to-video request (RequestError unless the model takes an input
    video, the file exists and the strength is in (0, 1]); None without an input video."""
    if video is None:
        if strength is not None:
            raise RequestError("strength goes with an input video (input_video)", param="strength")
        return None
    if not limits.video_input:
        raise RequestError(
            "this model does not take an input video (input_video)",
            param="input_video",
            code="unsupported_parameter",
        )
    if image is not None:
        raise RequestError(
            "give an input video or a first-frame image (input_reference), not both",
            param="input_video",
        )
    strength = DEFAULT_STRENGTH if strength is None else strength
    if isinstance(strength, bool) or not (math.isfinite(strength) and 0 < strength <= 1):
        raise RequestError(
            f"strength must be a number in (0, 1], got {strength!r}", param="strength"
        )
    if not Path(video).is_file():
        raise RequestError(f"video {video} not found", param="input_video")
    return float(strength)


def check_vace(
    request: VideoRequest | ResolvedVideo, frames: int, limits: ModelLimits
) -> float | None:
    """The conditioning scale of a VACE request (RequestError naming the field unless the model
    takes VACE's inputs, the files exist, a mask comes with a control video, the reference images
    fit the model's frames beside the clip and the scale is in [0, MAX_CONDITIONING_SCALE]);
    None for a model without VACE blocks."""
    given = [
        ("reference_images", bool(request.reference_images)),
        ("control_video", request.control_video is not None),
        ("mask", request.mask is not None),
        ("conditioning_scale", request.conditioning_scale is not None),
    ]
    if not limits.vace_input:
        for name, present in given:
            if present:
                raise RequestError(
                    f"this model does not take VACE's {name} (a Wan VACE model does)",
                    param=name,
                    code="unsupported_parameter",
                )
        return None
    references = request.reference_images
    if isinstance(references, str) or not isinstance(references, (tuple, list)):
        raise RequestError(
            "reference_images must be a list of image files", param="reference_images"
        )
    if len(references) > MAX_REFERENCE_IMAGES:
        raise RequestError(
            f"{len(references)} reference images: a request takes at most {MAX_REFERENCE_IMAGES}",
            param="reference_images",
        )
    # Each reference image takes a latent frame of the clip the transformer sees: a clip's
    # worth of frames_multiple pixel frames.
    if references and frames + len(references) * limits.frames_multiple > limits.max_frames:
        room = (limits.max_frames - frames) // limits.frames_multiple
        raise RequestError(
            f"{len(references)} reference images beside a clip of {frames} frames: this model "
            f"takes {limits.max_frames} frames in all, each image counting {limits.frames_multiple} "
            f"(room for {room})",
            param="reference_images",
        )
    for i, image in enumerate(references):
        if not Path(image).is_file():
            raise RequestError(f"reference image {i} ({image}) not found", param="reference_images")
    if request.mask is not None and request.control_video is None:
        raise RequestError("a mask goes with a control video (control_video)", param="mask")
    for name in ("control_video", "mask"):
        file = getattr(request, name)
        if file is not None and not Path(file).is_file():
            raise RequestError(f"{name} {file} not found", param=name)
    scale = request.conditioning_scale
    scale = DEFAULT_CONDITIONING_SCALE if scale is None else scale
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not (math.isfinite(scale) and 0 <= scale <= MAX_CONDITIONING_SCALE)
    ):
        raise RequestError(
            f"conditioning_scale must be a number in [0, {MAX_CONDITIONING_SCALE:g}], got {scale!r}",
            param="conditioning_scale",
        )
    return float(scale)


def check_animate(
    request: VideoRequest | ResolvedVideo, frames: int, limits: ModelLimits
) -> tuple[int, int] | None:
    """An Animate request's segments, `(segment_frame_length, prev_segment_conditioning_frames)`
    (RequestError naming the field unless its videos are right: the model takes them, the pose
    and face videos are given, the background video and its mask come together, each file
    exists; and its segments are: `segment_frame_length` on the frame rule, of at least two
    latent frames, and more than twice `prev_segment_conditioning_frames`, which is 1 or 5 as in
    diffusers' WanAnimatePipeline); None for a model that takes no Animate videos. A clip of
    `frames` longer than a segment is made in several (`wan/animate.py`). Each video is read for
    its first `frames` frames when the request runs (a shorter one is refused then, naming its
    file)."""
    given = [name for name in ANIMATE_VIDEOS if getattr(request, name) is not None]
    given += [name for name in ANIMATE_SEGMENTS if getattr(request, name) is not None]
    if not limits.animate_input:
        if given:
            raise RequestError(
                f"this model does not take Animate's {given[0]} (a Wan Animate model does)",
                param=given[0],
                code="unsupported_parameter",
            )
        return None
    for name in ("pose_video", "face_video"):
        if getattr(request, name) is None:
            raise RequestError(f"a Wan Animate model needs a {name}", param=name)
    if (request.background_video is None) != (request.background_mask is None):
        missing = "background_mask" if request.background_mask is None else "background_video"
        raise RequestError(
            "background_video and background_mask go together (replacing the person the mask "
            f"shows); {missing} is missing",
            param=missing,
        )
    for name in ANIMATE_VIDEOS:
        file = getattr(request, name)
        if file is not None and (not isinstance(file, str) or not Path(file).is_file()):
            raise RequestError(f"{name} {file} not found", param=name)
    shortest = limits.frames_multiple + limits.frames_offset
    if frames <= limits.frames_multiple:
        raise RequestError(
            f"a Wan Animate clip has at least {shortest} frames (the pipeline's segment carries "
            f"a frame over), got {frames}",
            param="frames",
        )
    carried = request.prev_segment_conditioning_frames
    if carried is None:
        carried = 1
    if isinstance(carried, bool) or carried not in (1, 5):
        raise RequestError(
            f"prev_segment_conditioning_frames must be 1 or 5 (WanAnimatePipeline's choices), "
            f"got {carried!r}",
            param="prev_segment_conditioning_frames",
        )
    segment = request.segment_frame_length
    if segment is None:
        segment = frames  # the clip in one segment
    name = "segment_frame_length"
    if isinstance(segment, bool) or not isinstance(segment, int):
        raise RequestError(f"{name} must be a whole number of frames, got {segment!r}", param=name)
    if not shortest <= segment <= limits.max_frames:
        raise RequestError(
            f"{name} ({segment}): a Wan Animate segment is {shortest} to {limits.max_frames} "
            "frames (the pipeline's segment carries a frame over)",
            param=name,
        )
    if (segment - limits.frames_offset) % limits.frames_multiple:
        raise RequestError(
            f"{name} ({segment}) must be {limits.frames_multiple}k + {limits.frames_offset}",
            param=name,
        )
    if segment <= 2 * carried:
        # Each later segment makes `segment - carried` new frames and carries `carried` over
        # from those of the one before (diffusers' loop needs as many).
        raise RequestError(
            f"{name} ({segment}) must be more than twice prev_segment_conditioning_frames "
            f"({carried}): a segment carries its last {carried} over to the next",
            param=name,
        )
    return segment, carried


def kept_steps(steps: int, strength: float | None) -> int:
    """The steps a video-to-video request runs of `steps`: the last `strength` of them, as
    diffusers' `WanVideoToVideoPipeline.get_timesteps` keeps them (`resolve` refuses a strength
    that keeps none)."""
    if strength is None:
        return steps
    return min(int(steps * strength), steps)


def check_loras(
    loras, limits: ModelLimits, adapters: Mapping[str, Mapping] | None, *, list_known: bool = True
) -> tuple[LoraChoice, ...]:
    """A request's adapters as `LoraChoice`s, each checked: a known name (when `adapters` says
    which are known), a finite scale, an expert the model has, no adapter twice on one expert.
    `list_known=False` names none of the known ones in the refusal (a pipeline serving several
    tenants holds adapters the requester may not know of)."""
    choices = tuple(LoraChoice.parse(c) for c in loras or ())
    if len(choices) > MAX_LORAS:
        raise RequestError(
            f"loras: {len(choices)} adapters; at most {MAX_LORAS} per request", param="loras"
        )
    seen = set()
    for c in choices:
        if not isinstance(c.name, str) or not c.name:
            raise RequestError("loras: every entry needs a name", param="loras")
        if adapters is not None and c.name not in adapters:
            known = ", ".join(sorted(adapters)) or "none are registered"
            raise RequestError(
                f"loras: no adapter named {c.name!r} for this model"
                + (f" (known: {known})" if list_known else ""),
                param="loras",
                code="unknown_adapter",
            )
        if (
            isinstance(c.scale, bool)
            or not isinstance(c.scale, int | float)
            or not math.isfinite(c.scale)
            or abs(c.scale) > 100
        ):
            raise RequestError(
                f"loras: {c.name!r} scale must be a number in [-100, 100], got {c.scale!r}",
                param="loras",
            )
        experts = ("high", "low") if limits.experts > 1 else ()
        if c.expert is not None and c.expert not in experts:
            which = f"one of {', '.join(experts)}" if experts else "left out (one denoiser)"
            raise RequestError(
                f"loras: {c.name!r} expert {c.expert!r}: this model's expert must be {which}",
                param="loras",
            )
        for e in (c.expert,) if c.expert else experts or (None,):
            if (c.name, e) in seen:
                raise RequestError(f"loras: {c.name!r} is named twice", param="loras")
            seen.add((c.name, e))
    return tuple(LoraChoice(c.name, float(c.scale), c.expert) for c in choices)
