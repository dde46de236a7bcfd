"""Typed results: the server's JSON objects with their fields as attributes.

Every class is a dataclass whose known fields default to None, so an older or newer server that
omits or adds fields still parses. Fields the class does not know are kept in `extra` and are
also readable as attributes (`video.some_new_field`); `to_dict()` gives back the JSON object.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

__all__ = [
    "APIObject",
    "Video",
    "VideoError",
    "VideoDeleted",
    "VideoContentLink",
    "VideoEvent",
    "FileObject",
    "FileDeleted",
    "AdapterDeleted",
    "FineTuningJob",
    "FineTuningJobError",
    "Hyperparameters",
    "FineTuningJobEvent",
    "FineTuningJobCheckpoint",
    "ValidationVideo",
    "Model",
    "WebhookEndpoint",
    "WebhookEndpointDeleted",
    "WebhookDelivery",
    "WebhookAttempt",
    "VIDEO_TERMINAL_STATUSES",
    "JOB_TERMINAL_STATUSES",
]

T = TypeVar("T", bound="APIObject")

VIDEO_TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
JOB_TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


@dataclass
class APIObject:
    """A JSON object from the server; unknown fields land in `extra`."""

    # field name -> APIObject subclass, for fields holding a nested object.
    _nested: ClassVar[dict[str, type]] = {}

    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Parse one JSON object, converting nested objects and keeping unknown fields."""
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                extra[key] = value
            elif key in cls._nested and isinstance(value, dict):
                kwargs[key] = cls._nested[key].from_dict(value)
            else:
                kwargs[key] = value
        return cls(**kwargs, extra=extra)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: serve fields this class does not declare.
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(f"{type(self).__name__!s} has no field {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: declared fields that are set, nested objects expanded, plus `extra`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value.to_dict() if isinstance(value, APIObject) else value
        out.update(self.extra)
        return out


# ---------------------------------------------------------------------------------------------
# videos


@dataclass
class VideoError(APIObject):
    """Why a video failed."""

    code: str | None = None
    message: str | None = None


@dataclass
class Video(APIObject):
    """A video generation job and, once completed, its result."""

    _nested: ClassVar[dict[str, type]] = {"error": VideoError}

    id: str | None = None
    object: str | None = None
    status: str | None = None  # queued | in_progress | completed | failed | cancelled
    progress: float | None = None  # 0-100; 100 only once the MP4 exists
    created_at: int | None = None
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    model: str | None = None
    prompt: str | None = None
    seconds: str | None = None
    size: str | None = None
    seed: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    priority: int | None = None
    step: int | None = None  # denoising steps done
    cache: dict | None = None  # the step cache as the server resolved it; None: off
    passes: int | None = None  # steps that ran a pass of the model (fewer with a step cache)
    remixed_from_video_id: str | None = None
    loras: list[dict[str, Any]] | None = None  # the adapters applied: name, scale, expert
    sampler: str | None = None  # scheduler | euler | consistency
    timesteps: list[int] | None = None  # an euler or consistency sampler's
    shift: float | None = None  # the request's or an adapter's; None: the model's
    guidance_interval: list[float] | None = None  # None: guided on every step
    # With an input video: the fraction of the schedule run (its last int(steps * strength)).
    strength: float | None = None
    # A VACE model's: the weight of its VACE blocks' hints; None: not a VACE model.
    conditioning_scale: float | None = None
    # A Wan Animate model's segments: their frames, and those each continues from the one
    # before; None: not an Animate model.
    segment_frame_length: int | None = None
    prev_segment_conditioning_frames: int | None = None
    # The completed video whose MP4 answered this request, which repeated it in everything that
    # decides the pixels (no pass ran); None: made by its own run.
    cached_from: str | None = None

    @property
    def done(self) -> bool:
        """True once the video is completed, failed or cancelled."""
        return self.status in VIDEO_TERMINAL_STATUSES


@dataclass
class VideoContentLink(APIObject):
    """A signed URL to a video's content that works without a key until `expires_at` (Unix
    seconds): for a player's `src`, or to share one video."""

    url: str | None = None
    expires_at: int | None = None
    object: str | None = None


@dataclass
class VideoDeleted(APIObject):
    """The answer to deleting a video: a queued or running one is cancelled (`status="cancelled"`,
    the record stays for pollers), a finished one is removed (`status="deleted"`)."""

    id: str | None = None
    object: str | None = None
    deleted: bool | None = None
    status: str | None = None


@dataclass
class VideoEvent:
    """One Server-Sent Event of a video's stream: its `event` name, `id` and parsed `data`.

    `video` is the data parsed as a Video when the event carries one (status and progress).
    """

    event: str | None
    data: Any
    id: str | None = None
    video: Video | None = None

    @property
    def preview(self) -> bytes | None:
        """A `video.preview` event's JPEG: one frame of the clip as its step `data["step"]`
        predicts it, while it renders; None for any other event."""
        uri = self.data.get("preview") if isinstance(self.data, dict) else None
        if self.event != "video.preview" or not isinstance(uri, str) or "," not in uri:
            return None
        return base64.b64decode(uri.partition(",")[2])


# ---------------------------------------------------------------------------------------------
# files


@dataclass
class FileObject(APIObject):
    """An uploaded file (a fine-tuning dataset archive)."""

    id: str | None = None
    object: str | None = None
    bytes: int | None = None
    created_at: int | None = None
    filename: str | None = None
    purpose: str | None = None
    status: str | None = None
    status_details: str | None = None
    expires_at: int | None = None
    clips: int | None = None  # training clips found in the archive


@dataclass
class Adapter(APIObject):
    """A LoRA adapter of a base model: `uploaded`, `ready` (name it in a video's `loras`) or
    `error` (`status_details` names what did not fit)."""

    id: str | None = None  # its name
    object: str | None = None
    model: str | None = None
    status: str | None = None
    status_details: str | None = None
    owned_by: str | None = None  # the key that uploaded it; None: registered at start
    created_at: int | None = None
    rank: int | None = None
    bytes: int | None = None  # device bytes of its factors
    defaults: dict[str, Any] | None = None  # sampling defaults it carries


@dataclass
class AdapterDeleted(APIObject):
    """The answer to deleting an adapter."""

    id: str | None = None
    object: str | None = None
    model: str | None = None
    deleted: bool | None = None


@dataclass
class FileDeleted(APIObject):
    """The answer to deleting a file."""

    id: str | None = None
    object: str | None = None
    deleted: bool | None = None


# ---------------------------------------------------------------------------------------------
# fine-tuning


@dataclass
class Hyperparameters(APIObject):
    """A fine-tune's hyperparameters; "auto" or a number each, and the optimizer's state format
    ("fp32", or "<master>/<moments>" such as "bf16-sr/8bit")."""

    n_epochs: Any = None
    batch_size: Any = None
    learning_rate_multiplier: Any = None
    optimizer_state: str | None = None
    optimizer_state_tier: str | None = None  # "ram" or "disk": where the moments live
    buckets: bool | None = None  # clips in aspect and length buckets (shown when asked for)
    token_budget: int | None = None  # a bucketed clip's most tokens (shown when asked for)
    validation_split: float | None = None  # clips held out for a validation loss (when asked)


@dataclass
class FineTuningJobError(APIObject):
    """Why a fine-tuning job failed."""

    code: str | None = None
    message: str | None = None
    param: str | None = None


@dataclass
class FineTuningJob(APIObject):
    """A fine-tuning job."""

    _nested: ClassVar[dict[str, type]] = {
        "hyperparameters": Hyperparameters,
        "error": FineTuningJobError,
    }

    id: str | None = None
    object: str | None = None
    status: str | None = None  # queued | running | succeeded | failed | cancelled
    model: str | None = None
    fine_tuned_model: str | None = None
    training_file: str | None = None
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None
    method: dict[str, Any] | None = None
    seed: int | None = None
    suffix: str | None = None
    created_at: int | None = None
    finished_at: int | None = None
    estimated_finish: int | None = None
    result_files: list[str] | None = None
    error: FineTuningJobError | None = None
    organization_id: str | None = None
    trained_tokens: int | None = None
    integrations: list[Any] | None = None
    step: int | None = None  # optimizer steps done
    total_steps: int | None = None
    # The prompts every checkpoint samples, as resolved: prompt, seed, size, num_frames,
    # num_inference_steps, guidance_scale.
    validation: list[dict[str, Any]] | None = None

    @property
    def done(self) -> bool:
        """True once the job succeeded, failed or was cancelled."""
        return self.status in JOB_TERMINAL_STATUSES


@dataclass
class FineTuningJobEvent(APIObject):
    """One event of a fine-tuning job: a message, or `type == "metrics"` with loss and lr in `data`."""

    id: str | None = None
    object: str | None = None
    created_at: int | None = None
    level: str | None = None
    message: str | None = None
    type: str | None = None
    data: dict[str, Any] | None = None


@dataclass
class ValidationVideo(APIObject):
    """A validation prompt sampled with one checkpoint's weights."""

    object: str | None = None
    index: int | None = None  # the prompt's place in the job's `validation`
    prompt: str | None = None
    seed: int | None = None
    size: str | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    status: str | None = None  # succeeded | failed
    error: str | None = None  # why it failed
    content_url: str | None = None  # the MP4 (succeeded only)


@dataclass
class FineTuningJobCheckpoint(APIObject):
    """A checkpoint saved during a fine-tune, with the validation videos sampled from it."""

    id: str | None = None
    object: str | None = None
    created_at: int | None = None
    fine_tuned_model_checkpoint: str | None = None
    fine_tuning_job_id: str | None = None
    step_number: int | None = None
    metrics: dict[str, Any] | None = None  # loss, lr; validation_loss with a validation split
    validation: list[ValidationVideo] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FineTuningJobCheckpoint:
        checkpoint = super().from_dict(data)
        if checkpoint.validation is not None:
            checkpoint.validation = [ValidationVideo.from_dict(v) for v in checkpoint.validation]
        return checkpoint


# ---------------------------------------------------------------------------------------------
# models


@dataclass
class Model(APIObject):
    """A model the server can generate with: a base model or a fine-tuned `ft:` one."""

    id: str | None = None
    object: str | None = None
    created: int | None = None
    owned_by: str | None = None
    kind: str | None = None  # preset | model | fine-tune
    parent: str | None = None  # the base model of a fine-tune
    inputs: list[str] | None = None  # "text", and "image" for a model that takes a first frame
    defaults: dict[str, Any] | None = None  # what a request gets for an absent field
    limits: dict[str, Any] | None = None  # max_frames, max_size, size_multiple, ...
    adapters: list[dict[str, Any]] | None = None  # LoRA adapters: name, rank, bytes, defaults


# ---------------------------------------------------------------------------------------------
# webhooks


@dataclass
class WebhookEndpoint(APIObject):
    """Where the events of this key's jobs are POSTed, signed with `secret` (set only in the
    answer that created it)."""

    id: str | None = None
    object: str | None = None
    created_at: int | None = None
    url: str | None = None
    events: list[str] | None = None
    description: str | None = None
    disabled: bool | None = None
    secret: str | None = None


@dataclass
class WebhookEndpointDeleted(APIObject):
    """The answer to deleting a webhook endpoint."""

    id: str | None = None
    object: str | None = None
    deleted: bool | None = None


@dataclass
class WebhookAttempt(APIObject):
    """One try of a delivery: the receiver's `status_code`, or the `error` that stopped it."""

    created_at: int | None = None
    status_code: int | None = None
    error: str | None = None
    duration_ms: int | None = None


@dataclass
class WebhookDelivery(APIObject):
    """An event owed to an endpoint: `pending`, `delivered`, or `failed` once retries are spent."""

    id: str | None = None  # the message id (webhook-id), the same on every try
    object: str | None = None
    endpoint_id: str | None = None
    type: str | None = None
    job_id: str | None = None
    created_at: int | None = None
    status: str | None = None
    attempts: list[WebhookAttempt] | None = None
    next_attempt_at: int | None = None
    delivered_at: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WebhookDelivery:
        delivery = super().from_dict(data)
        if delivery.attempts is not None:
            delivery.attempts = [WebhookAttempt.from_dict(a) for a in delivery.attempts]
        return delivery
