"""Request and response bodies of the API, in the OpenAI shapes, and the conversions from store rows.

Requests forbid unknown fields, so a misspelt parameter is an error that names it rather than a
silently ignored default. Responses carry the OpenAI fields first, then MegaSlide's own (seed, shape,
step counts), which OpenAI clients ignore.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from megaslide.engine.request import (
    MAX_CONDITIONING_SCALE,
    MAX_LORAS,
    MAX_REFERENCE_IMAGES,
    SAMPLERS,
    SEED_LIMIT,
    LoraChoice,
    RequestError,
    VideoRequest,
    parse_size,
)
from megaslide.engine.training.finetune_spec import TRAINING_STATES, OptimizerSpec, check_state

from .plain_text import NUL, NUL_MESSAGE
from .protocol import ModelCard, adapter_name
from .records import (
    CheckpointRecord,
    EventRecord,
    FileRecord,
    FineTuneRecord,
    VideoRecord,
    WebhookAttemptRecord,
    WebhookDeliveryRecord,
    WebhookEndpointRecord,
)

T = TypeVar("T")


MAX_NESTING = 32  # levels of lists and objects inside one request field


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _plain_text(cls, value):
        """Every string must have a UTF-8 form and no NUL character, and nothing may nest deeper
        than `MAX_NESTING`.

        JSON can escape half of a UTF-16 surrogate pair alone ("\\ud800"); such a string cannot be
        encoded, so the tokenizer, the store and the logs would each fail on it later. A structure
        nested hundreds deep would exhaust the recursion limit of whatever walks it next (hashing
        the request, storing it).
        """
        pending = [(value, 0)]
        while pending:
            item, depth = pending.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(
                        "must be Unicode text: a lone surrogate (such as \\ud800) is not"
                    ) from None
                if NUL in item:  # PostgreSQL's text cannot hold one (plain_text.py)
                    raise ValueError(NUL_MESSAGE)
            elif isinstance(item, dict | list | tuple):
                if depth == MAX_NESTING:
                    raise ValueError(f"is nested more than {MAX_NESTING} levels deep")
                items = [*item.keys(), *item.values()] if isinstance(item, dict) else item
                pending.extend((child, depth + 1) for child in items)
        return value


class ListPage(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope that every 4xx and 5xx answer carries."""

    error: ErrorDetail


ERROR_STATUSES = {
    400: "Invalid request: the message says what is wrong and `param` names the field",
    401: "Missing or unknown API key",
    403: "The API key may not do this (a priority above 0 needs an admin key)",
    404: "No such object",
    409: "Conflicts with the object's state, or an Idempotency-Key reused with another body",
    413: "The request body, or the file in it, is over this server's limit",
    416: "The range lies outside the file",
    429: "The queue, or this API key's share of it (or of event streams), is full; retry "
    "after Retry-After seconds. Or the key keeps as many adapters as it may: delete one",
    500: "An unexpected server error",
    503: "The models are still loading, the worker stopped, or the job store is unavailable",
    507: "The server's disk is full",
}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses=` for the error statuses a route can answer, each with the envelope."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
        for status in statuses
    }


def body_schema(model: type[BaseModel]) -> dict:
    """`model`'s JSON schema with its `$defs` written in place, for a body an operation declares
    by hand (`openapi_extra`): pydantic's `#/$defs/...` references would otherwise be looked up
    at the root of the OpenAPI document, which holds none. Caution: `model` must not refer to
    itself, which could not be written out."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        if (ref := node.get("$ref", "")).startswith("#/$defs/"):
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**inline(defs[ref.removeprefix("#/$defs/")]), **inline(rest)}
        return {key: inline(value) for key, value in node.items()}

    return inline(schema)


def page(items: list, has_more: bool) -> dict:
    return {
        "data": items,
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
        "has_more": has_more,
    }


# ---------------------------------------------------------------------------------------------
# videos


class LoraRef(Request):
    """One LoRA adapter a video applies: registered on the model under `name`."""

    name: str = Field(min_length=1, max_length=256)
    scale: float = Field(1.0, ge=-100, le=100)
    expert: Literal["high", "low"] | None = Field(
        None, description="only on Wan2.2's high- or low-noise expert (default: every expert)"
    )


# The create body's file fields (multipart uploads), and what each must be; and those that take
# several files (multipart: the field repeated; JSON: a list of /v1/files ids), up to a number.
FILE_FIELDS = {
    "input_reference": "an image",
    "last_frame": "an image",
    "input_video": "a video",
    "control_video": "a video",
    "mask": "a video",
    "pose_video": "a video",
    "face_video": "a video",
    "background_video": "a video",
    "background_mask": "a video",
}
FILE_LIST_FIELDS = {"reference_images": ("images", MAX_REFERENCE_IMAGES)}


class VideoCreate(Request):
    """`POST /v1/videos`, as JSON or as multipart form fields (all strings, converted here)."""

    # The schema says what the server checks (request.py): some text besides white space.
    prompt: str = Field(json_schema_extra={"minLength": 1, "pattern": r"\S"})
    model: str | None = None
    seconds: float | None = Field(
        None, gt=0, description="clip length; frames = round(seconds * fps)"
    )
    size: str | None = Field(None, description="WIDTHxHEIGHT, both even")
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=120)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, le=100)
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    priority: int = Field(
        0, ge=-100, le=100, description="higher runs first; above 0 needs an admin key"
    )
    cache: str | dict[str, Any] | None = Field(
        None,
        description='step cache: a preset ("quality", "balanced", "fast"; "off", the default) or '
        '{"policy": "output-change" | "adaptive" | "first-block", "threshold": number, '
        '"forecast": "none" | "linear" | "quadratic"} (forecast optional, "none" by default: what '
        "a reused step takes, the last computed output or its extrapolation; a model lists the "
        "policies it takes in its limits' cache_policies)",
        examples=[
            "fast",
            {"policy": "adaptive", "threshold": 0.01},
            {"policy": "output-change", "threshold": 0.1, "forecast": "linear"},
        ],
    )
    sampler: Literal[SAMPLERS] | None = Field(
        None,
        description='"scheduler" (the model\'s own schedule and update rule), "euler" (flow Euler '
        'steps over `timesteps`) or "consistency" (predict the clean clip, re-noise it at the '
        "next timestep with the request's own generator: rCM, DMD and LCM samplers); default: "
        "the first adapter's sampling defaults, else the model's",
    )
    timesteps: list[int] | None = Field(
        None,
        min_length=1,
        description="the training timesteps an euler or consistency sampler visits, strictly "
        "decreasing in [1, 1000] (1000: pure noise), e.g. [1000, 750, 500, 250]; their count is "
        "the steps (a JSON list in a multipart form field)",
    )
    shift: float | None = Field(
        None, gt=0, le=100, description="the schedule's timestep shift (default: the model's)"
    )
    guidance_interval: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="[start, end]: classifier-free guidance only on the steps in this fraction "
        "of the schedule (step i of n when start * n <= i < end * n), e.g. [0, 0.5]; the other "
        "steps run the conditional row alone (default: every step)",
    )
    reuse: bool = Field(
        True,
        description="answer a request equal to one of this key's completed videos in everything "
        "that decides the pixels (model and its revision, adapters, seed, every sampling "
        "parameter, the image's bytes) with that video's MP4 at once, naming it in "
        "cached_from; false: run it again",
    )
    # Image-to-video: a first-frame image, uploaded as a multipart file (see the videos router) or
    # named by the id of a file uploaded with purpose "input" to /v1/files; first-last-frame-to-
    # video: a last-frame image besides; video-to-video: an input video (the clip's length by
    # default, its first num_frames frames otherwise) and a strength.
    input_reference: Any = None
    last_frame: Any = None
    input_video: Any = None
    strength: float | None = Field(
        None,
        gt=0,
        le=1,
        description="with input_video: the fraction of the schedule that runs from the input "
        "video noised to its start (1: from nearly pure noise; default 0.8)",
    )
    # VACE (a model whose inputs list them): reference images (the field repeated in a multipart
    # form, or a JSON list of /v1/files ids), a control video and a video of masks over it (the
    # clip's length by default, their first num_frames frames otherwise), the hints' weight.
    reference_images: Any = None
    control_video: Any = None
    mask: Any = None
    conditioning_scale: float | None = Field(
        None,
        ge=0,
        le=MAX_CONDITIONING_SCALE,
        description="a VACE model's: the weight of its VACE blocks' hints (default 1; 0 ignores "
        "the reference images, control video and mask)",
    )
    # Wan Animate (a model whose inputs list them; input_reference is the character): a pose
    # video and a face video, and for the replace mode a background video and its mask (their
    # first num_frames frames; the clip's length by default), made in segments.
    pose_video: Any = None
    face_video: Any = None
    background_video: Any = None
    background_mask: Any = None
    segment_frame_length: int | None = Field(
        None,
        description="a Wan Animate model's: the frames of each segment the clip is made in "
        "(4k + 1; default: the clip's, one segment)",
    )
    prev_segment_conditioning_frames: int | None = Field(
        None,
        description="a Wan Animate model's: the frames each segment after the first continues "
        "from the one before (1 or 5; default 1)",
    )
    loras: list[LoraRef] | None = Field(
        None,
        max_length=MAX_LORAS,
        description="LoRA adapters registered on the model, applied in order (a JSON list in a "
        "multipart form field)",
    )

    @field_validator("loras", "timesteps", "guidance_interval", mode="before")
    @classmethod
    def _lists(cls, value, info):
        # A multipart form sends every field as a string: a list comes as JSON text.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                what = {"loras": "{name, scale, expert}"}.get(info.field_name, "numbers")
                raise ValueError(f"must be a JSON list of {what}") from None
        return value

    @field_validator("reference_images", mode="before")
    @classmethod
    def _file_ids(cls, value):
        # In a form field: one /v1/files id, or a JSON list of them.
        if isinstance(value, str):
            try:
                return json.loads(value) if value.lstrip().startswith("[") else [value]
            except json.JSONDecodeError:
                raise ValueError("must be a file id or a JSON list of file ids") from None
        return value

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value):
        # The OpenAI API sends seconds as a string ("4"); accept numbers as well.
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise ValueError(f"must be a number of seconds, got {value!r}") from None
        return value

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, value):
        # A form field is text: an object arrives as JSON. Its values are checked where every
        # request is (engine/request.py: resolve).
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                return json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON object: {e}") from None
        return value

    def to_request(
        self,
        image: str | None = None,
        *,
        last_image: str | None = None,
        video: str | None = None,
        frames: int | None = None,
        control_video: str | None = None,
        mask: str | None = None,
        reference_images: tuple[str, ...] = (),
        animate: dict[str, str] | None = None,
    ) -> VideoRequest:
        """The engine's request: what was asked, `None` where the model's default applies;
        `image`, `last_image`, `video`, `control_video`, `mask` and `reference_images` are where
        the uploaded files were stored; `frames` stands in for a length the request leaves out
        (an input video's, or a control video's); `animate`: where Wan Animate's videos were
        stored, by field."""
        for field, what in FILE_FIELDS.items():
            if getattr(self, field) is not None:
                raise RequestError(
                    f"{field} must be {what} file uploaded as multipart/form-data", param=field
                )
        for field, (what, _) in FILE_LIST_FIELDS.items():
            if getattr(self, field) is not None:
                raise RequestError(
                    f"{field} must be {what} uploaded as multipart/form-data", param=field
                )
        if frames is not None and (self.num_frames is not None or self.seconds is not None):
            frames = None
        width, height = parse_size(self.size) if self.size else (None, None)
        return VideoRequest(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            frames=self.num_frames if frames is None else frames,
            seconds=self.seconds,
            width=width,
            height=height,
            fps=self.fps,
            steps=self.num_inference_steps,
            guidance=self.guidance_scale,
            seed=self.seed,
            image=image,
            last_image=last_image,
            video=video,
            strength=self.strength,
            reference_images=reference_images,
            control_video=control_video,
            mask=mask,
            conditioning_scale=self.conditioning_scale,
            **(animate or {}),
            segment_frame_length=self.segment_frame_length,
            prev_segment_conditioning_frames=self.prev_segment_conditioning_frames,
            cache=self.cache,
            loras=tuple(LoraChoice(r.name, r.scale, r.expert) for r in self.loras or ()),
            sampler=self.sampler,
            timesteps=None if self.timesteps is None else tuple(self.timesteps),
            shift=self.shift,
            guidance_interval=(
                None if self.guidance_interval is None else tuple(self.guidance_interval)
            ),
        )


class VideoError(BaseModel):
    code: str | None
    message: str | None


class Video(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: str
    progress: int
    created_at: int
    completed_at: int | None
    expires_at: int | None
    error: VideoError | None
    model: str
    prompt: str
    seconds: str
    size: str
    remixed_from_video_id: str | None = None
    seed: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str
    priority: int
    step: int
    cache: dict[str, Any] | None = Field(None, description="the step cache, as resolved; null: off")
    passes: int = Field(description="steps that ran a pass of the model (fewer with a step cache)")
    loras: list[dict] = Field(default_factory=list)
    sampler: str = "scheduler"
    timesteps: list[int] | None = Field(None, description="an euler or consistency sampler's")
    shift: float | None = Field(
        None, description="the request's or an adapter's; null: the model's"
    )
    guidance_interval: list[float] | None = Field(None, description="null: guided on every step")
    strength: float | None = Field(
        None,
        description="with an input video: the fraction of the schedule run (its last "
        "int(num_inference_steps * strength) steps); null: none",
    )
    conditioning_scale: float | None = Field(
        None, description="a VACE model's: the weight of its VACE blocks' hints; null: not VACE"
    )
    segment_frame_length: int | None = Field(
        None, description="a Wan Animate model's: the frames of a segment; null: not Animate"
    )
    prev_segment_conditioning_frames: int | None = Field(
        None,
        description="a Wan Animate model's: the frames a segment continues from the one "
        "before; null: not Animate",
    )
    cached_from: str | None = Field(
        None,
        description="the completed video whose MP4 answered this request, which repeated it "
        "(no pass ran: passes is 0); null: made by its own run",
    )


class ContentLink(BaseModel):
    """A signed link to a video's content that needs no key, until `expires_at` (Unix seconds)."""

    object: Literal["video.content_link"] = "video.content_link"
    url: str
    expires_at: int


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool
    status: str | None = None


def seconds_text(frames: int, fps: int) -> str:
    """Clip length as the OpenAI API writes it (a string): "4", "0.5"."""
    return f"{frames / fps:g}"


def video_object(video: VideoRecord) -> Video:
    spec = video.spec
    error = (
        VideoError(code=video.error_code, message=video.error_message)
        if video.error_message
        else None
    )
    return Video(
        id=video.id,
        status=video.status,
        progress=video.progress,
        created_at=video.created_at,
        completed_at=video.completed_at,
        expires_at=video.expires_at,
        error=error,
        model=video.model,
        prompt=spec["prompt"],
        seconds=seconds_text(spec["frames"], spec["fps"]),
        size=f"{spec['width']}x{spec['height']}",
        seed=spec["seed"],
        num_frames=spec["frames"],
        fps=spec["fps"],
        num_inference_steps=spec["steps"],
        guidance_scale=spec["guidance"],
        negative_prompt=spec["negative_prompt"],
        priority=video.priority,
        step=video.step,
        cache=spec.get("cache"),
        passes=video.step if video.passes is None else video.passes,
        # An adapter under the name its owner gave it, not the id the workers know it by.
        loras=[{**c, "name": adapter_name(c["name"])} for c in spec.get("loras") or ()],
        sampler=spec.get("sampler", "scheduler"),
        timesteps=spec.get("timesteps"),
        shift=spec.get("shift"),
        guidance_interval=spec.get("guidance_interval"),
        strength=spec.get("strength"),
        conditioning_scale=spec.get("conditioning_scale"),
        segment_frame_length=spec.get("segment_frame_length"),
        prev_segment_conditioning_frames=spec.get("prev_segment_conditioning_frames"),
        cached_from=video.cached_from,
    )


# ---------------------------------------------------------------------------------------------
# files


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = Field(
        "processed", description="uploaded: being validated; processed: ready to train on"
    )
    status_details: str | None = Field(None, description="why validation failed")
    expires_at: int | None = None
    clips: int = Field(description="clips in the dataset, once processed")


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def file_object(file: FileRecord) -> FileObject:
    return FileObject(
        id=file.id,
        bytes=file.bytes,
        created_at=file.created_at,
        filename=file.filename,
        purpose=file.purpose,
        status=file.status,
        status_details=file.status_details,
        clips=file.clips,
    )


# ---------------------------------------------------------------------------------------------
# fine-tuning


def _ranged(kind: str = "integer", **bounds) -> WithJsonSchema:
    """The JSON schema of a number in a range, or "auto"."""
    return WithJsonSchema({"anyOf": [{"type": kind, **bounds}, {"const": "auto"}]})


class Hyperparameters(Request):
    """OpenAI's three knobs ("auto" = the server's default), the clip shape to train at and the
    optimizer's state format."""

    # The ranges are checked by the validators below, in their own words; `_ranged` documents
    # them in the schema too.
    n_epochs: Annotated[int | Literal["auto"], _ranged(minimum=1, maximum=100)] = Field(
        "auto", description="passes over the data (1-100)"
    )
    batch_size: Annotated[int | Literal["auto"], _ranged(minimum=1, maximum=256)] = "auto"
    learning_rate_multiplier: Annotated[
        float | Literal["auto"], _ranged("number", exclusiveMinimum=0, maximum=100)
    ] = "auto"
    num_frames: int | None = Field(
        None, ge=1, description="frames per training clip (default: the trainer's)"
    )
    size: str | None = Field(
        None,
        description="WIDTHxHEIGHT of training clips (default: the trainer's): every clip "
        "resized and cropped to it, unless buckets is true",
    )
    buckets: bool | None = Field(
        None,
        description="train clips as they come, each batch one aspect and length bucket (default: "
        "when the clips differ in size or length and no size is given); false: one size",
    )
    token_budget: int | None = Field(
        None,
        ge=1,
        description="in buckets, a clip's most tokens (default: those of one num_frames x size "
        "clip)",
    )
    expert: Literal["high", "low", "both"] | None = Field(
        None,
        description="a two-expert base (Wan2.2-A14B): which expert trains, the high- or "
        "low-noise one, or both in one job, each on its own noise levels (the default)",
    )
    optimizer_state: str = Field(
        "auto",
        description="how the optimizer keeps master weights and moments in host RAM: "
        f"{', '.join(TRAINING_STATES)} ('auto': fp32)",
    )
    optimizer_state_tier: Literal["ram", "disk", "auto"] = Field(
        "auto",
        description="where the optimizer keeps its moments between updates: host RAM, or files "
        "on the server's local disk read ahead and written behind per block ('auto': ram)",
    )
    validation_split: float = Field(
        0,
        ge=0,
        description="clips held out of training for a validation loss at every checkpoint: a "
        "fraction below 1 (at least one clip) or a whole number of clips; 0: none",
    )

    @field_validator("validation_split")
    @classmethod
    def _split(cls, v):
        if v >= 1 and not float(v).is_integer():
            raise ValueError("must be a fraction below 1 or a whole number of clips")
        return v

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v):
        if v != "auto" and not 1 <= v <= 100:
            raise ValueError("must be between 1 and 100")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v):
        if v != "auto" and not 1 <= v <= 256:
            raise ValueError("must be between 1 and 256")
        return v

    @field_validator("token_budget")
    @classmethod
    def _budget(cls, v, info):
        if v is not None and info.data.get("buckets") is False:
            raise ValueError("bounds buckets: not with buckets false")
        return v

    @field_validator("optimizer_state")
    @classmethod
    def _state(cls, v):
        return v if v == "auto" else check_state(v)

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _lr(cls, v):
        if v != "auto" and not 0 < v <= 100:
            raise ValueError("must be greater than 0 and at most 100")
        return v


class Supervised(Request):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


class Method(Request):
    type: Literal["supervised"] = "supervised"
    supervised: Supervised = Field(default_factory=Supervised)


MAX_VALIDATION_PROMPTS = 8


class ValidationPrompt(Request):
    """A video sampled with every checkpoint's weights, checked like a video request's."""

    prompt: str
    seed: int = Field(0, ge=0, lt=SEED_LIMIT)
    size: str | None = Field(None, description="WIDTHxHEIGHT, both even (default: the model's)")
    num_frames: int | None = Field(None, ge=1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0, le=100)


class FineTuningJobCreate(Request):
    model: str
    training_file: str
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    suffix: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_-]*$")
    validation_file: str | None = None
    validation: list[ValidationPrompt] | None = Field(
        None,
        max_length=MAX_VALIDATION_PROMPTS,
        description="prompts sampled with every checkpoint's weights: an MP4 each, listed with "
        "the checkpoint",
    )
    integrations: list | None = None
    metadata: dict[str, str] | None = None


class FineTuningError(BaseModel):
    code: str | None
    message: str | None
    param: str | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: FineTuningError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict
    method: dict
    model: str
    organization_id: str = "megaslide"
    result_files: list[str] = []
    seed: int
    status: str
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list = []
    suffix: str | None
    step: int
    total_steps: int | None
    validation: list[dict] = Field(
        default_factory=list, description="the validation prompts, as resolved against the model"
    )


def finetune_object(job: FineTuneRecord) -> FineTuningJob:
    hyper = job.hyperparameters
    public = {k: hyper[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")}
    public["optimizer_state"] = hyper.get("optimizer_state", OptimizerSpec.state)  # (older jobs)
    public["optimizer_state_tier"] = hyper.get("optimizer_state_tier", OptimizerSpec.state_tier)
    for asked in ("buckets", "token_budget"):  # shown when asked for
        if hyper.get(asked) is not None:
            public[asked] = hyper[asked]
    if hyper.get("expert") is not None:  # a two-expert base: which trains (high, low or both)
        public["expert"] = hyper["expert"]
    if hyper.get("validation_split"):
        public["validation_split"] = hyper["validation_split"]
    error = (
        FineTuningError(code=job.error_code, message=job.error_message)
        if job.error_message
        else None
    )
    return FineTuningJob(
        id=job.id,
        created_at=job.created_at,
        error=error,
        fine_tuned_model=job.fine_tuned_model,
        finished_at=job.finished_at,
        hyperparameters=public,
        method={"type": "supervised", "supervised": {"hyperparameters": public}},
        model=job.model,
        seed=job.seed,
        status=job.status,
        training_file=job.training_file,
        suffix=job.suffix,
        step=job.step,
        total_steps=job.total_steps,
        validation=[api_prompt(p) for p in hyper.get("validation", [])],
    )


def api_prompt(prompt: dict) -> dict:
    """A resolved validation prompt (the spec's names) in the API's names."""
    return {
        "prompt": prompt["prompt"],
        "seed": prompt["seed"],
        "size": f"{prompt['width']}x{prompt['height']}",
        "num_frames": prompt["frames"],
        "num_inference_steps": prompt["steps"],
        "guidance_scale": prompt["guidance"],
    }


class FineTuningEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict | None


def event_object(event: EventRecord) -> FineTuningEvent:
    return FineTuningEvent(
        id=f"ftevent-{event.seq}",
        created_at=event.created_at,
        level=event.level,
        message=event.message,
        type=event.type,
        data=event.data,
    )


class ValidationVideo(BaseModel):
    """One validation prompt sampled from one checkpoint."""

    object: Literal["fine_tuning.job.checkpoint.validation_video"] = (
        "fine_tuning.job.checkpoint.validation_video"
    )
    index: int
    prompt: str
    seed: int
    size: str
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    status: Literal["succeeded", "failed"]
    error: str | None = None
    content_url: str | None = Field(None, description="GET it for the MP4 (succeeded only)")


class Checkpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict
    step_number: int
    validation: list[ValidationVideo] = Field(
        default_factory=list,
        description="the validation prompts sampled with this checkpoint's weights, in the job's "
        "order; a succeeded one's MP4 is at its content_url",
    )


def checkpoint_object(checkpoint: CheckpointRecord, job: FineTuneRecord) -> Checkpoint:
    step = checkpoint.step
    name = f"ft:{job.model}:{job.suffix or ''}:{job.id.removeprefix('ftjob-')}:ckpt-step-{step}"
    base = f"/v1/fine_tuning/jobs/{job.id}/checkpoints/{checkpoint.id}/validation"
    videos = [
        ValidationVideo(
            index=v["index"],
            **api_prompt(v),
            status=v["status"],
            error=v.get("error"),
            content_url=f"{base}/{v['index']}/content" if v["status"] == "succeeded" else None,
        )
        for v in checkpoint.validation or []
    ]
    return Checkpoint(
        id=checkpoint.id,
        created_at=checkpoint.created_at,
        fine_tuned_model_checkpoint=name,
        fine_tuning_job_id=checkpoint.job_id,
        metrics=checkpoint.metrics or {},
        step_number=step,
        validation=videos,
    )


# ---------------------------------------------------------------------------------------------
# adapters


class AdapterObject(BaseModel):
    """A LoRA adapter of a base model: `uploaded` (waiting for the workers), `ready` (a video
    request may name it in `loras`) or `error` (`status_details` says why)."""

    id: str
    object: Literal["adapter"] = "adapter"
    model: str
    status: Literal["uploaded", "ready", "error"]
    status_details: str | None = None
    owned_by: str | None = Field(
        None, description="the key that uploaded it; null: registered at start, every key's"
    )
    created_at: int | None = None
    rank: int | None = None
    bytes: int | None = Field(None, description="device bytes of its factors")
    defaults: dict = Field(default_factory=dict, description="sampling defaults it carries")


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    model: str
    deleted: bool


# ---------------------------------------------------------------------------------------------
# models


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: str
    parent: str | None
    inputs: list[str]
    defaults: dict
    limits: dict
    adapters: list[dict] = Field(
        default_factory=list, description="LoRA adapters registered on it: name, rank, defaults"
    )


def model_object(card: ModelCard) -> Model:
    limits, defaults = card.limits, card.defaults
    return Model(
        id=card.name,
        created=card.created,
        owned_by="user" if card.kind == "fine-tune" else "megaslide",
        kind=card.kind,
        parent=card.parent,
        inputs=list(card.inputs),
        defaults={
            "num_frames": defaults.frames,
            "size": f"{defaults.width}x{defaults.height}",
            "fps": defaults.fps,
            "num_inference_steps": defaults.steps,
            "guidance_scale": defaults.guidance,
            "sampler": defaults.sampler,
            **({"timesteps": list(defaults.timesteps)} if defaults.timesteps else {}),
        },
        limits=limits.to_dict(),
        adapters=[{k: v for k, v in a.items() if k != "id"} for a in card.adapters],
    )


# ---------------------------------------------------------------------------------------------
# webhooks

WebhookEvent = Literal[
    "video.completed",
    "video.failed",
    "fine_tuning.job.succeeded",
    "fine_tuning.job.failed",
    "fine_tuning.job.checkpoint.created",
]
MAX_URL_CHARS = 2048


class WebhookEndpointCreate(Request):
    """`POST /v1/webhooks/endpoints`: where to send which events of this key's jobs."""

    url: str = Field(min_length=1, max_length=MAX_URL_CHARS, description="http:// or https://")
    events: list[WebhookEvent] = Field(min_length=1, max_length=16)
    description: str | None = Field(None, max_length=512)


class WebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    url: str
    events: list[str]
    description: str | None
    disabled: bool = Field(
        description="set once a delivery failed for good; its events wait until it is enabled"
    )
    secret: str | None = Field(
        None,
        description="whsec_...: what its deliveries are signed with (Standard Webhooks); "
        "shown once, in the answer that creates the endpoint",
    )


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    deleted: bool


class WebhookAttempt(BaseModel):
    created_at: int
    status_code: int | None = Field(description="the receiver's answer; null: none came")
    error: str | None = Field(description="why the try failed; null: it was delivered")
    duration_ms: int


class WebhookDelivery(BaseModel):
    id: str = Field(description="the message id, sent as webhook-id on every try")
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    type: str
    job_id: str
    created_at: int
    status: Literal["pending", "delivered", "failed"]
    attempts: list[WebhookAttempt]
    next_attempt_at: int | None = Field(description="when it is tried next, while pending")
    delivered_at: int | None


def webhook_endpoint_object(
    endpoint: WebhookEndpointRecord, *, with_secret: bool = False
) -> WebhookEndpoint:
    return WebhookEndpoint(
        id=endpoint.id,
        created_at=endpoint.created_at,
        url=endpoint.url,
        events=endpoint.events,
        description=endpoint.description,
        disabled=endpoint.disabled,
        secret=endpoint.secret if with_secret else None,
    )


def webhook_delivery_object(
    delivery: WebhookDeliveryRecord, attempts: list[WebhookAttemptRecord]
) -> WebhookDelivery:
    pending = delivery.status == "pending"
    return WebhookDelivery(
        id=delivery.id,
        endpoint_id=delivery.endpoint_id,
        type=delivery.type,
        job_id=delivery.job_id,
        created_at=delivery.created_at,
        status=delivery.status,
        attempts=[
            WebhookAttempt(
                created_at=a.created_at,
                status_code=a.status_code,
                error=a.error,
                duration_ms=a.duration_ms,
            )
            for a in attempts
        ],
        next_attempt_at=int(delivery.next_attempt_at) if pending else None,
        delivered_at=delivery.delivered_at,
    )
