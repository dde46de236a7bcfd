"""Server settings: one pydantic-settings class, read from `MEGASLIDE_*` variables and the CLI.

`megaslide serve` passes its flags as keyword arguments, which take precedence over the
environment; anything not given falls back to the defaults below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy import make_url

from megaslide.engine.placement import Placement
from megaslide.engine.training.finetune_spec import OptimizerSpec, RunSpec

DEFAULT_CRASH_LIMIT = 3  # a job whose worker died under it this many times fails


class Settings(BaseSettings):
    """Everything the server needs to know at start-up."""

    model_config = SettingsConfigDict(env_prefix="MEGASLIDE_", frozen=True)

    host: str = "127.0.0.1"
    port: int = 8000
    # What to serve: model directories or packaged model names, and/or one preset's random weights.
    # With neither, the packaged default model (or the tiny preset when none ships) is served.
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    preset: str | None = None
    # LoRA adapters registered at start, "NAME=FILE" on every served model or "MODEL:NAME=FILE"
    # on one; comma-separated in MEGASLIDE_LORAS. A request names them in `loras`.
    loras: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Single-file transformer checkpoints, "NAME=FILE", over the pipeline directory served as NAME
    # (twice for a Wan2.2 two-expert model: high-noise expert first).
    transformers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    data_dir: Path = Path("megaslide-data")
    # The job store: SQLite in the data directory by default; postgresql://... for many hosts.
    database: str | None = None
    # Where videos, uploads, checkpoints and fine-tuned models live (default: the data
    # directory). With several hosts, a directory every host mounts at the same path.
    storage: Path | None = None
    # `megaslide serve` runs a worker in its own process unless this is off (an API-only host).
    worker: bool = True
    worker_name: str | None = None  # default: "<hostname>/<device>", one per device slot
    lease_s: float = Field(
        30.0,
        gt=0,
        description="a running job returns to the queue this long after its worker "
        "was last heard from (also how long a silent worker still counts as live)",
    )
    heartbeat_s: float = Field(2.0, gt=0, description="how often a worker proves it is alive")
    stall_s: float = Field(
        600.0,
        gt=0,
        description="a worker whose loop spends longer than this in one step is presumed hung: "
        "it withholds its heartbeat, so its jobs' leases expire and they run elsewhere (keep "
        "it above the slowest step, decode or checkpoint of the models served)",
    )
    crash_limit: int = Field(
        DEFAULT_CRASH_LIMIT,
        ge=1,
        description="a job whose worker died under it this many times fails instead of running "
        "again (a poison job cannot take down worker after worker)",
    )
    # Bearer keys; comma-separated in MEGASLIDE_API_KEYS. Each is a principal that owns what it
    # makes (auth.py). With neither these nor a keys file: no authentication.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Named keys, stored as SHA-256 digests, one `NAME DIGEST [admin]` per line (`megaslide keys`).
    api_keys_file: Path | None = None
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # Two or more devices ("cuda:0,cuda:1", "cpu,cpu"; comma-separated in MEGASLIDE_DEVICES):
    # each video's tokens split over them, one process per device kept between jobs
    # (engine/parallel/rank_group.py). Their blocks stream from one shared host copy
    # (offload="stream" unless set) in `weights`' format, or from the files on the disk tier;
    # `gpu_budget` is each device's; fine-tunes run on the first device. Every combination rule:
    # `placement`.
    devices: Annotated[list[str], NoDecode] = Field(default_factory=list)
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    # "stream": keep the DiT's blocks in host RAM and stream them to the device each step, so a
    # model larger than the device serves; gpu_budget (bytes) keeps as many blocks resident as fit.
    offload: Literal["none", "stream"] = "none"
    gpu_budget: int | None = Field(None, ge=0)
    # With offload="stream": the host format of the streamed blocks (engine/streaming/weight_formats.py):
    # "lossless" sends about 0.68x the bytes for bitwise the same video, "fp8" about half (lossy).
    weights: Literal["raw", "lossless", "fp8"] = "raw"
    # With offload="stream": where streamed blocks live between steps (engine/streaming/disk_store.py):
    # "disk" reads them from the model's safetensors files each step through a small ring (host
    # RAM smaller than the model); "auto" picks disk when they would not fit in available RAM.
    host_tier: Literal["ram", "disk", "auto"] = "auto"
    # With host_tier="disk": read through the page cache ("buffered") or around it ("direct").
    disk_io: Literal["buffered", "direct"] = "buffered"
    # Each denoiser's repeated block through torch.compile (engine/compiled_blocks.py), and a
    # step at the model's defaults when a worker loads it, so no request pays the compile.
    compile: bool = False
    compile_warm_up: bool = True
    # With weights="fp8": the streamed blocks' linears multiply by the stored fp8 weights
    # (torch._scaled_mm, activations quantized per token; engine/streaming/fp8_matmul.py).
    fp8_matmul: bool = False
    engine_threads: int | None = Field(
        None, ge=1, description="CPU threads for the engine's tensor math (None: torch's default)"
    )

    # Queue and scheduler.
    # Slow and many clients (connections.py, body_limit.py).
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's line and headers must arrive within this (408)"
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request body must arrive whole within this, plus a second per "
        "min_body_rate bytes received (408)",
    )
    min_body_rate: float = Field(
        64 * 1024,
        gt=0,
        description="bytes per second that earn a body a second more than body_timeout_s: a "
        "large upload at this rate or faster always has time",
    )
    max_connections: int = Field(
        512,
        ge=1,
        description="open connections beyond this are answered 503 at once (keep it below the "
        "process's file descriptor limit); at most half of them may be event streams",
    )
    # One address is one client here: behind a proxy every client has the proxy's address, so
    # raise both to max_connections there and let the proxy bound each client.
    max_connections_per_client: int = Field(
        64,
        ge=1,
        description="open connections one client address may hold; past this its new ones are "
        "answered 429 at once",
    )
    max_pending_per_client: int = Field(
        32,
        ge=1,
        description="connections one client address may hold still sending their headers; past "
        "this its new ones are answered 429 at once",
    )

    max_queue: int = Field(64, ge=1, description="queued jobs (videos + fine-tunes) before 429")
    max_queue_per_key: int = Field(
        16,
        ge=1,
        description="queued jobs one API key may hold before its own 429, so that one tenant "
        "cannot fill the queue for everyone (admin keys and a server without keys: no share)",
    )
    max_batch: int = Field(8, ge=1, description="video jobs sharing one denoising pass")
    max_steps: int = Field(200, ge=1, description="largest num_inference_steps accepted")
    max_prompt_chars: int = Field(4000, ge=1, description="hard cap before the model's own limit")
    max_image_pixels: int = Field(
        4096 * 4096,
        ge=1,
        description="largest image or video frame decoded (input_reference, last_frame, "
        "input_video, reference_images, control_video, mask, Animate's videos, training clips), "
        "in pixels; "
        "checked from the header, before decoding",
    )
    poll_after_ms: int = Field(1000, ge=0, description="openai-poll-after-ms hint for active jobs")
    cancel_wait_s: float = Field(
        10.0, ge=0, description="how long DELETE waits for the worker to stop"
    )
    video_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="how long a finished MP4 is kept")
    sse_interval_s: float = Field(
        0.2, gt=0, description="how often the API polls the job store for SSE streams' news"
    )
    max_streams_per_key: int = Field(
        100, ge=1, description="SSE streams one API key (or, without keys, everyone) may hold"
    )
    preview_every: int = Field(
        5,
        ge=0,
        description="send a running video's SSE stream a small image of its clean clip as "
        "predicted every this many denoising steps (a video.preview event); 0: never",
    )
    preview_size: int = Field(
        160, ge=16, le=1024, description="longest side of a preview image, in pixels"
    )
    event_ttl_s: int = Field(
        30 * 24 * 3600,
        ge=60,
        description="how long the events of a finished job are kept, and webhook deliveries "
        "once delivered or failed",
    )

    # Request bodies, counted as they arrive (413 above).
    max_body_bytes: int = Field(
        1024**2, ge=1, description="largest request body on routes that take no file"
    )
    max_image_bytes: int = Field(
        64 * 1024**2,
        ge=1,
        description="largest image upload (input_reference, last_frame, each of reference_images)",
    )
    max_video_bytes: int = Field(
        256 * 1024**2,
        ge=1,
        description="largest video upload (input_video, control_video, mask, pose_video, "
        "face_video, background_video, background_mask)",
    )
    max_video_frames: int = Field(
        1024,
        ge=1,
        description="most frames an uploaded video (input_video, control_video, mask, Animate's "
        "videos) may hold: each is decoded when it is uploaded",
    )

    # Files and fine-tuning.
    max_upload_bytes: int = Field(
        2 * 1024**3, ge=1, description="largest training archive (413 above)"
    )
    max_adapters_per_key: int = Field(
        20,
        ge=0,
        description="LoRA adapters one API key may keep uploaded, all models together (429 "
        "past that; admin keys and a server without keys: no cap)",
    )
    max_adapter_bytes_per_key: int = Field(
        8 * 1024**3,
        ge=0,
        description="bytes of LoRA adapter files one API key may keep uploaded (429 past that)",
    )
    max_extracted_bytes: int = Field(8 * 1024**3, ge=1, description="largest unpacked archive")
    max_dataset_clips: int = Field(
        10_000, ge=1, description="clips (lines of metadata.jsonl) in one training file"
    )
    max_metadata_line_bytes: int = Field(
        64 * 1024, ge=1, description="longest line of a training file's metadata.jsonl"
    )
    max_dataset_frames: int = Field(
        1_000_000,
        ge=1,
        description="frames decoded to check one training file, all clips together: "
        "the work one upload may cost",
    )
    finetune_lr: float = Field(
        OptimizerSpec.lr, gt=0, description="learning rate at learning_rate_multiplier=1"
    )
    finetune_epochs: int = Field(1, ge=1, description="n_epochs when the request says 'auto'")
    finetune_save_every: int = Field(
        RunSpec.save_every, ge=1, description="checkpoint interval in optimizer steps"
    )

    # Webhooks (webhooks.py).
    webhook_allow_private: bool = Field(
        False,
        description="let webhook endpoints resolve to loopback, private, link-local and other "
        "non-public addresses (a receiver on this machine or its network); off, such URLs are "
        "refused when registered and again before each delivery",
    )
    webhook_timeout_s: float = Field(
        10.0, gt=0, description="how long a receiver may take to answer one delivery"
    )
    # Seconds before each retry of a failed delivery; comma-separated in MEGASLIDE_WEBHOOK_RETRY_S.
    # A delivery is tried once and then once per entry, then it fails for good (about 17 hours
    # by default, Standard Webhooks' schedule).
    webhook_retry_s: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0]
    )
    webhook_concurrency: int = Field(
        16, ge=1, description="deliveries one API process has in flight at once"
    )
    webhook_poll_s: float = Field(
        1.0, gt=0, description="how often an API process looks for deliveries due"
    )

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.data_dir / 'megaslide.db'}"

    @property
    def database_url_shown(self) -> str:
        """The database URL without its password, for logs."""
        return make_url(self.database_url).render_as_string(hide_password=True)

    @property
    def max_streams(self) -> int:
        """Event streams one API process holds at once: half its connections, so that streams
        from many keys, each within its own limit, still leave room for every other client."""
        return max(1, self.max_connections // 2)

    @property
    def storage_dir(self) -> Path:
        return self.storage or self.data_dir

    @field_validator("webhook_retry_s")
    @classmethod
    def _retry_delays(cls, value):
        if any(delay < 0 for delay in value):
            raise ValueError(f"webhook_retry_s must hold delays of 0 s or more, got {value}")
        return value

    @model_validator(mode="after")
    def _heartbeat_within_lease(self):
        if self.heartbeat_s >= self.lease_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be shorter than lease_s ({self.lease_s}): "
                "a worker must renew its leases before they expire"
            )
        return self

    @property
    def placement(self) -> Placement:
        """Where the served models' weights live (engine/placement.py), from `device`,
        `devices`, `offload`, `gpu_budget`, `weights`, `host_tier`, `disk_io`, `compile` and
        `fp8_matmul`.
        Several devices stream (unless `offload` is set otherwise, which their placement
        refuses)."""
        devices = tuple(self.devices) or None
        offload = self.offload
        if devices and "offload" not in self.model_fields_set:
            offload = "stream"
        return Placement(
            device=None if devices and self.device == "auto" else self.device,
            devices=devices,
            offload=offload,
            gpu_budget_bytes=self.gpu_budget,
            weights=self.weights,
            host_tier=self.host_tier,
            disk_io=self.disk_io,
            compile=self.compile,
            fp8_matmul=self.fp8_matmul,
        )

    @model_validator(mode="after")
    def _placement_rules(self):
        self.placement.validate()
        return self

    @field_validator(
        "models", "api_keys", "loras", "transformers", "devices", "webhook_retry_s", mode="before"
    )
    @classmethod
    def _split_commas(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value
