"""Typed results: the server's JSON objects with their fields as attributes.

Every class is a dataclass whose known fields default to None, so an older or newer server that
omits or adds fields still parses. Fields the class does not know are kept in `extra` and are
also readable as attributes (`video.some_new_field`); `to_dict()` gives back the JSON object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, TypeVar

__all__ = [
    "APIObject",
    "Video",
    "VideoError",
    "VideoDeleted",
    "VideoEvent",
    "FileObject",
    "FileDeleted",
    "FineTuningJob",
    "FineTuningJobError",
    "Hyperparameters",
    "FineTuningJobEvent",
    "FineTuningJobCheckpoint",
    "Model",
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
    _nested: ClassVar[Dict[str, type]] = {}

    extra: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls: type[T], data: Dict[str, Any]) -> T:
        """Parse one JSON object, converting nested objects and keeping unknown fields."""
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs: Dict[str, Any] = {}
        extra: Dict[str, Any] = {}
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

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object: declared fields that are set, nested objects expanded, plus `extra`."""
        out: Dict[str, Any] = {}
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

    code: Optional[str] = None
    message: Optional[str] = None


@dataclass
class Video(APIObject):
    """A video generation job and, once completed, its result."""

    _nested: ClassVar[Dict[str, type]] = {"error": VideoError}

    id: Optional[str] = None
    object: Optional[str] = None
    status: Optional[str] = None  # queued | in_progress | completed | failed | cancelled
    progress: Optional[float] = None  # 0-100; 100 only once the MP4 exists
    created_at: Optional[int] = None
    completed_at: Optional[int] = None
    expires_at: Optional[int] = None
    error: Optional[VideoError] = None
    model: Optional[str] = None
    prompt: Optional[str] = None
    seconds: Optional[str] = None
    size: Optional[str] = None
    seed: Optional[int] = None
    num_frames: Optional[int] = None
    fps: Optional[int] = None
    num_inference_steps: Optional[int] = None
    guidance_scale: Optional[float] = None
    negative_prompt: Optional[str] = None
    priority: Optional[int] = None
    step: Optional[int] = None  # denoising steps done
    remixed_from_video_id: Optional[str] = None

    @property
    def done(self) -> bool:
        """True once the video is completed, failed or cancelled."""
        return self.status in VIDEO_TERMINAL_STATUSES


@dataclass
class VideoDeleted(APIObject):
    """The answer to deleting a video: a queued or running one is cancelled (`status="cancelled"`,
    the record stays for pollers), a finished one is removed (`status="deleted"`)."""

    id: Optional[str] = None
    object: Optional[str] = None
    deleted: Optional[bool] = None
    status: Optional[str] = None


@dataclass
class VideoEvent:
    """One Server-Sent Event of a video's stream: its `event` name, `id` and parsed `data`.

    `video` is the data parsed as a Video when the event carries one (status and progress).
    """

    event: Optional[str]
    data: Any
    id: Optional[str] = None
    video: Optional[Video] = None


# ---------------------------------------------------------------------------------------------
# files


@dataclass
class FileObject(APIObject):
    """An uploaded file (a fine-tuning dataset archive)."""

    id: Optional[str] = None
    object: Optional[str] = None
    bytes: Optional[int] = None
    created_at: Optional[int] = None
    filename: Optional[str] = None
    purpose: Optional[str] = None
    status: Optional[str] = None
    status_details: Optional[str] = None
    expires_at: Optional[int] = None
    clips: Optional[int] = None  # training clips found in the archive


@dataclass
class FileDeleted(APIObject):
    """The answer to deleting a file."""

    id: Optional[str] = None
    object: Optional[str] = None
    deleted: Optional[bool] = None


# ---------------------------------------------------------------------------------------------
# fine-tuning


@dataclass
class Hyperparameters(APIObject):
    """A fine-tune's hyperparameters; "auto" or a number each."""

    n_epochs: Any = None
    batch_size: Any = None
    learning_rate_multiplier: Any = None


@dataclass
class FineTuningJobError(APIObject):
    """Why a fine-tuning job failed."""

    code: Optional[str] = None
    message: Optional[str] = None
    param: Optional[str] = None


@dataclass
class FineTuningJob(APIObject):
    """A fine-tuning job."""

    _nested: ClassVar[Dict[str, type]] = {"hyperparameters": Hyperparameters, "error": FineTuningJobError}

    id: Optional[str] = None
    object: Optional[str] = None
    status: Optional[str] = None  # queued | running | succeeded | failed | cancelled
    model: Optional[str] = None
    fine_tuned_model: Optional[str] = None
    training_file: Optional[str] = None
    validation_file: Optional[str] = None
    hyperparameters: Optional[Hyperparameters] = None
    method: Optional[Dict[str, Any]] = None
    seed: Optional[int] = None
    suffix: Optional[str] = None
    created_at: Optional[int] = None
    finished_at: Optional[int] = None
    estimated_finish: Optional[int] = None
    result_files: Optional[List[str]] = None
    error: Optional[FineTuningJobError] = None
    organization_id: Optional[str] = None
    trained_tokens: Optional[int] = None
    integrations: Optional[List[Any]] = None
    step: Optional[int] = None  # optimizer steps done
    total_steps: Optional[int] = None

    @property
    def done(self) -> bool:
        """True once the job succeeded, failed or was cancelled."""
        return self.status in JOB_TERMINAL_STATUSES


@dataclass
class FineTuningJobEvent(APIObject):
    """One event of a fine-tuning job: a message, or `type == "metrics"` with loss and lr in `data`."""

    id: Optional[str] = None
    object: Optional[str] = None
    created_at: Optional[int] = None
    level: Optional[str] = None
    message: Optional[str] = None
    type: Optional[str] = None
    data: Optional[Dict[str, Any]] = None


@dataclass
class FineTuningJobCheckpoint(APIObject):
    """A checkpoint saved during a fine-tune."""

    id: Optional[str] = None
    object: Optional[str] = None
    created_at: Optional[int] = None
    fine_tuned_model_checkpoint: Optional[str] = None
    fine_tuning_job_id: Optional[str] = None
    step_number: Optional[int] = None
    metrics: Optional[Dict[str, Any]] = None


# ---------------------------------------------------------------------------------------------
# models


@dataclass
class Model(APIObject):
    """A model the server can generate with: a base model or a fine-tuned `ft:` one."""

    id: Optional[str] = None
    object: Optional[str] = None
    created: Optional[int] = None
    owned_by: Optional[str] = None
    kind: Optional[str] = None  # preset | model | fine-tune
    parent: Optional[str] = None  # the base model of a fine-tune
    defaults: Optional[Dict[str, Any]] = None  # what a request gets for an absent field
    limits: Optional[Dict[str, Any]] = None  # max_frames, max_size, size_multiple, ...
