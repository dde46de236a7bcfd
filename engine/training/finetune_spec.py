"""What a fine-tuning run is asked to do: one spec in six sections, each default written once.

    FinetuneSpec(
        run=RunSpec(output="runs/a"),         # where it writes, its seed, what trains
        schedule=ScheduleSpec(epochs=2),      # how long, and the learning rate along the way
        optimizer=OptimizerSpec(lr=2e-5),     # AdamW, its state format, gradient clipping
        clips=ClipSpec(frames=17),            # the training clips and the batch
        runtime=RuntimeSpec(Placement(device="cuda", offload="stream")),  # where and how it runs
        validation=ValidationSpec(split=0.1),  # what each checkpoint is judged by (optional)
    )

Every front end maps onto it in one place: `megaslide finetune`'s flags (clients/cli), the API's
`hyperparameters` (server/finetunes.py), and a benchmark or test building one by hand. The trainer
(finetune.py) reads it; the optimizer section goes to `CPUAdamW` as it is. Where the weights live
is the one placement spec sampling takes too (placement.py): its fine-tuning rules refuse what
cannot train, and nothing in the runtime changes what the run computes. `to_dict` / `from_dict`
are its plain-data form; `from_dict` also reads a spec saved before the runtime held a placement.
Plain data, no torch: the server imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..native.config import TIME_SAMPLING
from ..placement import Placement
from .state_format import MASTERS, MOMENTS, StateFormat

LR_SCHEDULES = ("constant", "cosine")


def check_state(state: str) -> str:
    """The canonical name of an optimizer state format fine-tuning trains with (`fp32` or
    `<master>/<moments>`, state_format.py); ValueError naming the formats, or why a 'bf16'
    master (rounded to nearest, no compensation) does not train."""
    fmt = StateFormat.parse(state)
    if fmt.master == "bf16":
        raise ValueError(
            f"optimizer state {state!r}: a 'bf16' master rounds every update to nearest and loses "
            "those under half a bf16 ulp (the baseline the compact formats are tested against); "
            f"train with one of {', '.join(TRAINING_STATES)}"
        )
    return fmt.name


# Every format fine-tuning trains with, the default first.
TRAINING_STATES = ("fp32",) + tuple(
    f"{master}/{moments}"
    for master in MASTERS
    for moments in MOMENTS
    if master != "bf16" and (master, moments) != ("fp32", "fp32")
)


STATE_TIERS = ("ram", "disk")


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW (torch.optim.AdamW's algorithm, engine/training/optim.py) on the masters, stored
    in the `state` format."""

    lr: float = 1e-4  # the peak rate; the schedule scales it
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None  # clip the global gradient norm to this
    grad_accum: int = 1  # micro-batches per optimizer step
    # How the optimizer stores master and moments on the host: "fp32", or "<master>/<moments>"
    # such as "bf16-sr/8bit" (state_format.py: the formats and their bytes per parameter). A
    # bf16 master is the model's weights themselves: the trainer opens the model in bf16 and
    # computes under bf16 autocast; "bf16-sr" rounds keyed by `run.seed`.
    state: str = "fp32"
    # Where the state that only the optimizer reads (moments; a bf16-split master's low halves)
    # lives between updates: "ram", or "disk": one file per block under `state_dir` (default
    # `<run.output>/optimizer-state`), read ahead and written behind through a ring of a few
    # blocks' buffers (optim_disk.py). The masters stay in RAM either way.
    state_tier: str = "ram"
    state_dir: str | None = None

    def __post_init__(self) -> None:
        StateFormat.parse(self.state)  # ValueError naming the formats
        if self.state_tier not in STATE_TIERS:
            raise ValueError(f"state_tier must be one of {STATE_TIERS}, got {self.state_tier!r}")

    @property
    def state_bytes_per_param(self) -> float:
        """Host bytes per trained parameter of this state format (master, m, v, compute copy)."""
        return StateFormat.parse(self.state).bytes_per_param()


@dataclass(frozen=True)
class ScheduleSpec:
    """How long the run trains (`steps`, or `epochs` over the dataset; neither: one epoch) and
    the learning rate at each step (`learning_rate` in finetune.py)."""

    steps: int | None = None
    epochs: float | None = None
    lr_schedule: str = "constant"  # LR_SCHEDULES; "cosine" decays to 0 at the run's last step
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr
    until: int | None = None  # stop after this step of the schedule; a resumed run continues it

    @property
    def length(self) -> tuple[int | None, float | None]:
        """(steps, epochs), exactly one of them set."""
        if self.steps is None and self.epochs is None:
            return None, 1.0
        return self.steps, self.epochs


@dataclass(frozen=True)
class ClipSpec:
    """The training clips (default shape: the model's sampling default) and the batch.

    `buckets` (training/buckets.py): True trains clips as they come, each batch one aspect and
    length bucket, each clip at most `frames` long and `token_budget` tokens (default: the tokens
    of one clip of frames x height x width); False resizes and crops every clip to that one shape;
    None (the default) buckets when the dataset's clips differ in size or length, unless a size
    (`height`, `width`) is given."""

    frames: int | None = None
    height: int | None = None
    width: int | None = None
    batch_size: int = 1
    buckets: bool | None = None
    token_budget: int | None = None
    caption_dropout: float = 0.1  # captions replaced by "" so guidance has an unconditional model
    time_sampling: str = "logit-normal"  # training flow times: config.TIME_SAMPLING


@dataclass(frozen=True)
class RunSpec:
    """Where the run writes (metrics, checkpoints, the export), its seed, and what it trains."""

    output: str
    seed: int = 0
    save_every: int = 50  # checkpoint every N optimizer steps (and at the end)
    attention: str | None = None  # train with this self-attention backend (default: the model's)
    # A two-expert model (Wan2.2-A14B): "high" or "low" noise, or "both" (the default: each on
    # its own flow times in one run, experts.py).
    expert: str | None = None


@dataclass(frozen=True)
class ValidationPrompt:
    """A video sampled with every checkpoint's weights; None takes the model's default."""

    prompt: str
    seed: int = 0
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None


@dataclass(frozen=True)
class ValidationSpec:
    """What every checkpoint is judged by: `prompts` sampled with its weights (an MP4 each, beside
    the checkpoint), and the loss on a held-out part of the dataset. `split` is that part: a
    fraction of the clips (0 < split < 1, at least one clip) or a whole number of clips; 0 holds
    none out. Which clips is fixed by `run.seed`; they never train."""

    prompts: tuple[ValidationPrompt, ...] = ()
    split: float = 0

    def held_out(self, clips: int) -> int:
        """How many of `clips` clips the split holds out."""
        if self.split <= 0:
            return 0
        if self.split < 1:
            return max(1, round(self.split * clips))
        return int(self.split)

    def checks(self) -> list[tuple[bool, str, Any]]:
        """(ok, rule, value) for `FinetuneSpec.validate`."""
        checks = [
            (self.split >= 0, "validation.split must be >= 0", self.split),
            (
                self.split < 1 or float(self.split).is_integer(),
                "validation.split is a fraction below 1 or a whole number of clips",
                self.split,
            ),
        ]
        for i, p in enumerate(self.prompts):
            checks.append((bool(p.prompt.strip()), f"validation.prompts[{i}].prompt is empty", ""))
            for name in ("width", "height", "frames", "steps"):
                value = getattr(p, name)
                ok = value is None or value >= 1
                checks.append((ok, f"validation.prompts[{i}].{name} must be at least 1", value))
        return checks


# RuntimeSpec's flat fields before it held a `Placement`: still taken as keywords (a spec saved
# then, `spec.replace(runtime={"device": "cuda"})`), laid over the placement.
FLAT_PLACEMENT = ("device", "offload", "devices", "timing")
CACHE_MB = 1024


@dataclass(frozen=True, init=False)
class RuntimeSpec:
    """Where and how the run executes: none of it changes what it computes.

    `placement` is where the weights live (placement.py), refused with its fine-tuning rules
    (`problems("finetune")`); a rank of several devices opens `placement.on(its device)`.
    `RuntimeSpec(device=, offload=, devices=, timing=)` still builds one: see `with_flat`."""

    placement: Placement = Placement(device="cpu")
    cache_mb: int = CACHE_MB  # decoded training clips kept in RAM (a small dataset decodes once)

    def __init__(
        self, placement: Placement | None = None, cache_mb: int = CACHE_MB, **flat: Any
    ) -> None:
        base = RuntimeSpec.placement if placement is None else placement
        object.__setattr__(self, "placement", with_flat(base, flat))
        object.__setattr__(self, "cache_mb", cache_mb)

    @property
    def device(self) -> str:
        """The one device the run trains on ("cpu" unless named; a rank's, in a rank's spec)."""
        return self.placement.device or "cpu"

    @property
    def offload(self) -> str:
        return self.placement.offload

    @property
    def devices(self) -> tuple[str, ...] | None:
        """Data parallel over these devices, a process each, in place of `device` (see
        parallel/data_parallel.py): the batch is split over them, one optimizer updates one master."""
        return self.placement.devices

    @property
    def timing(self) -> bool:
        return self.placement.timing


def with_flat(placement: Placement, flat: Mapping[str, Any]) -> Placement:
    """`placement` with RuntimeSpec's old flat fields `flat` laid over it, as they meant: `devices`
    stand in for `device` (which an old spec always held, "cpu" by default)."""
    unknown = sorted(set(flat) - set(FLAT_PLACEMENT))
    if unknown:
        raise TypeError(f"RuntimeSpec has no field {unknown[0]!r}")
    if not flat:
        return placement
    old = {
        "device": placement.device,
        "devices": placement.devices,
        "offload": placement.offload,
        "timing": placement.timing,
    }
    new = old | dict(flat)
    devices = tuple(new["devices"]) if new["devices"] is not None else None
    device = None if devices is not None else new["device"] or "cpu"
    return placement.replace(
        device=device, devices=devices, offload=new["offload"], timing=new["timing"]
    )


@dataclass(frozen=True)
class FinetuneSpec:
    """A fine-tuning run: its six sections."""

    run: RunSpec
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    clips: ClipSpec = field(default_factory=ClipSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    validation: ValidationSpec = field(default_factory=ValidationSpec)

    def replace(self, **sections) -> FinetuneSpec:
        """This spec with some fields changed, by section: `spec.replace(runtime={"device":
        "cuda"})`."""
        changed = {
            name: dataclasses.replace(getattr(self, name), **fields)
            for name, fields in sections.items()
        }
        return dataclasses.replace(self, **changed)

    def to_dict(self) -> dict:
        """Plain data (JSON once its tuples are lists): what a checkpoint records."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FinetuneSpec:
        """A spec from `to_dict()`'s form, or from the one before the runtime held a placement
        (its device, offload, devices and timing flat in `runtime`); lists for tuples."""
        optimizer = dict(d.get("optimizer", {}))
        if "betas" in optimizer:
            optimizer["betas"] = tuple(optimizer["betas"])
        runtime = dict(d.get("runtime", {}))
        placement = runtime.pop("placement", None)
        validation = dict(d.get("validation", {}))
        validation["prompts"] = tuple(ValidationPrompt(**p) for p in validation.get("prompts", ()))
        return cls(
            run=RunSpec(**d["run"]),
            schedule=ScheduleSpec(**d.get("schedule", {})),
            optimizer=OptimizerSpec(**optimizer),
            clips=ClipSpec(**d.get("clips", {})),
            runtime=RuntimeSpec(
                Placement.of(None, placement) if placement is not None else None, **runtime
            ),
            validation=ValidationSpec(**validation),
        )

    def validate(self) -> None:
        """ValueError naming the first field out of range, as `section.field`."""
        s, o, c, r = self.schedule, self.optimizer, self.clips, self.run
        if s.steps is not None and s.epochs is not None:
            raise ValueError("give at most one of schedule.steps and schedule.epochs")
        at_least_one = {
            "schedule.steps": s.steps,
            "schedule.until": s.until,
            "optimizer.grad_accum": o.grad_accum,
            "clips.frames": c.frames,
            "clips.height": c.height,
            "clips.width": c.width,
            "clips.batch_size": c.batch_size,
            "clips.token_budget": c.token_budget,
            "run.save_every": r.save_every,
        }
        for name, value in at_least_one.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        checks = [
            (s.epochs is None or s.epochs > 0, "schedule.epochs must be positive", s.epochs),
            (s.lr_schedule in LR_SCHEDULES, f"schedule.lr_schedule: {LR_SCHEDULES}", s.lr_schedule),
            (s.warmup_steps >= 0, "schedule.warmup_steps must be >= 0", s.warmup_steps),
            (o.lr > 0, "optimizer.lr must be positive", o.lr),
            (o.weight_decay >= 0, "optimizer.weight_decay must be >= 0", o.weight_decay),
            (all(0 <= b < 1 for b in o.betas), "optimizer.betas must be in [0, 1)", o.betas),
            (
                o.max_grad_norm is None or o.max_grad_norm > 0,
                "optimizer.max_grad_norm must be positive",
                o.max_grad_norm,
            ),
            (
                0 <= c.caption_dropout < 1,
                "clips.caption_dropout must be in [0, 1)",
                c.caption_dropout,
            ),
            (
                c.time_sampling in TIME_SAMPLING,
                f"clips.time_sampling: {TIME_SAMPLING}",
                c.time_sampling,
            ),
            (self.runtime.cache_mb >= 0, "runtime.cache_mb must be >= 0", self.runtime.cache_mb),
        ]
        devices = self.runtime.devices
        if devices is not None:
            checks.append(
                (
                    c.batch_size % max(len(devices), 1) == 0,
                    f"clips.batch_size must be a multiple of the {len(devices)} runtime.devices",
                    c.batch_size,
                )
            )
        if c.buckets is False and c.token_budget is not None:
            checks.append(
                (
                    False,
                    "clips.token_budget bounds buckets: not with clips.buckets false",
                    c.token_budget,
                )
            )
        checks.append(
            (
                r.attention != "sage",
                "run.attention: sage is inference only (int8 rounding has no gradient); "
                "fine-tune with dense or dsa",
                r.attention,
            )
        )
        checks += self.validation.checks()
        for ok, rule, value in checks:
            if not ok:
                raise ValueError(f"{rule}, got {value!r}")
        try:
            check_state(o.state)
        except ValueError as e:
            raise ValueError(f"optimizer.state: {e}") from None
        # Where the weights live: the placement's rules for a fine-tune (placement.py).
        problems = self.runtime.placement.problems("finetune")
        if problems:
            raise ValueError(f"runtime: {problems[0]}")
