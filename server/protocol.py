"""The one interface between the HTTP layer and whatever runs the jobs (after vLLM's `EngineClient`).

Routers see only `WorkerClient` and `ModelCard`: plain Python, no torch. Work reaches the workers
through the job store (request -> store -> worker), so this interface is small: which models are
served, whether the workers live, their metrics, a dataset check, and a nudge that the store has
new work. Workers in other processes publish their model cards in the store's registry, as
`card_to_dict` writes them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megaslide.engine.native.config import SamplingDefaults
from megaslide.engine.request import ModelLimits, count_utf8_bytes

if TYPE_CHECKING:
    from .metrics import Totals
    from .store import JobStore


@dataclass(frozen=True)
class ModelCard:
    """A servable model: its name, where it comes from, and its defaults and limits."""

    name: str
    kind: str  # "preset" | "model" | "fine-tune"
    created: int
    source: str  # preset name, or model directory
    limits: ModelLimits
    defaults: SamplingDefaults  # what a request gets for a field it leaves out
    parent: str | None = None  # the base model of a fine-tune
    owner: str | None = None  # the principal a fine-tune belongs to (base models: everyone's)
    # LoRA adapters registered on it: name, rank, modules, bytes, defaults (sampling defaults),
    # and for uploaded ones owner, created_at and sha256 (of the file).
    adapters: tuple[dict, ...] = ()

    def adapter_defaults(self) -> dict[str, dict]:
        """Adapter names with the sampling defaults each carries, as `request.resolve` takes them."""
        return {a["name"]: dict(a.get("defaults") or {}) for a in self.adapters}

    @property
    def inputs(self) -> tuple[str, ...]:
        """What a request may condition on: "text" (prompt, negative prompt), "image" for a
        model that takes a first frame (`input_reference`), "last_image" for one that takes a
        last frame besides (`last_frame`), "video" for one that remakes an input video
        (`input_video`, with a strength), and a VACE model's "reference_images", "control_video"
        and "mask" (with a conditioning scale), and a Wan Animate model's "pose_video",
        "face_video", "background_video" and "background_mask" (with "image", the character).
        The playground shows fields from it."""
        limits = self.limits
        takes = (limits.image_input, limits.last_image_input, limits.video_input)
        inputs = ("text", *(n for n, t in zip(("image", "last_image", "video"), takes) if t))
        if limits.vace_input:
            inputs += ("reference_images", "control_video", "mask")
        if limits.animate_input:
            inputs += ("pose_video", "face_video", "background_video", "background_mask")
        return inputs

    def replace(self, **changes) -> ModelCard:
        return dataclasses.replace(self, **changes)

    def seen_by(self, may_see: Callable[[str | None], bool], owner: str | None = None) -> ModelCard:
        """The card as `owner` sees it: only the adapters whose owner `may_see` allows (an
        uploaded adapter is its uploader's; one registered at start, owner None, everyone's),
        each under the name its viewer knows it by, its `id` beside it. Its own and those
        registered at start go by their names (its own first, should both share one); another
        key's, which only an admin sees, by their ids."""
        shown: dict[str, dict] = {}
        for a in sorted(self.adapters, key=lambda a: a.get("owner") is not None):
            if not may_see(a.get("owner")):
                continue
            name = adapter_name(a["name"]) if a.get("owner") in (None, owner) else a["name"]
            shown[name] = {**a, "name": name, "id": a["name"]}
        return self.replace(adapters=tuple(shown.values()))


OWNER_MARK = "~"  # in an uploaded adapter's id, between its owner and its name (in neither)


def adapter_id(owner: str | None, name: str) -> str:
    """The id an uploaded adapter is stored and registered under: its name qualified by its
    owner, so that each key has its own namespace (two keys may each have a `style`, and neither
    learns of the other's). Without keys there is no owner and the id is the name."""
    return name if owner is None else f"{owner}{OWNER_MARK}{name}"


def adapter_name(adapter_id: str) -> str:
    """The name an adapter's owner knows it by."""
    return adapter_id.rpartition(OWNER_MARK)[2]


def card_to_dict(card: ModelCard) -> dict:
    """A card as a worker publishes it: its limits as data (a model's own shape rule and token
    counter stay behind; `card_from_dict` finds them again where it can), and its defaults."""
    fields = ("name", "kind", "created", "source", "parent")
    return {
        **{f: getattr(card, f) for f in fields},
        "limits": card.limits.to_dict(),
        "defaults": card.defaults.to_dict(),
        "adapters": [dict(a) for a in card.adapters],
    }


def card_from_dict(d: dict) -> ModelCard:
    """A published card. Its exact limits come from the model's own config when this host can
    read it (a preset, or a model directory on shared storage); otherwise from the published
    numbers alone, without the model's shape rule, and with prompts counted here only when the
    model counts them in bytes. The worker checks every request again with the model's own
    rules, so nothing it cannot make is run."""
    limits = _described_limits(d) or _plain_limits(d["limits"])
    fields = ("name", "kind", "created", "source", "parent")
    adapters = tuple(dict(a) for a in d.get("adapters") or ())
    return ModelCard(
        **{f: d.get(f) for f in fields},
        limits=limits,
        defaults=_defaults(d),
        adapters=adapters,
    )


def _defaults(d: dict) -> SamplingDefaults:
    """A published card's defaults; a card written before they were apart from the limits
    carried them among its limits (and no shift: the default one)."""
    if "defaults" in d:
        return SamplingDefaults.from_dict(d["defaults"])
    return SamplingDefaults(**{k: d["limits"][k] for k in DEFAULT_FIELDS})


DEFAULT_FIELDS = ("frames", "height", "width", "fps", "steps", "guidance")


def _described_limits(d: dict) -> ModelLimits | None:
    from megaslide.engine.sources import ModelSource, describe, resolve_source

    try:
        if d["kind"] == "preset":
            return describe(resolve_source(preset=d["source"])).limits
        path = Path(d["source"])
        if path.is_dir():
            return describe(ModelSource("directory", d["name"], path=path)).limits
    except (ValueError, OSError, KeyError):
        pass  # not a preset this version knows, or a directory it cannot read
    return None


def _plain_limits(d: dict) -> ModelLimits:
    counted_here = d["prompt_unit"] == ModelLimits.prompt_unit
    return ModelLimits(
        **{
            k: v
            for k, v in d.items()
            if k not in ("size_multiple", "prompt_unit", "cache_policies", *DEFAULT_FIELDS)
        },
        size_multiple=tuple(d["size_multiple"]),
        # A card written before the field: every policy of the time (all but first-block) ran.
        cache_policies=tuple(d.get("cache_policies", ("output-change", "adaptive"))),
        prompt_unit=d["prompt_unit"],
        count_tokens=count_utf8_bytes if counted_here else _not_counted,
    )


def _not_counted(text: str) -> int:
    return 0  # the worker's tokenizer counts (see card_from_dict)


class WorkerClient(ABC):
    """What the HTTP layer may ask of the workers that run its jobs: those in this process, and
    those elsewhere that the store's registry lists as alive."""

    @abstractmethod
    async def start(self, store: JobStore) -> None:
        """Begin serving `store`; returns at once while weights load in the background."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop at the next step boundary, requeue unfinished work, release the models."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once some live worker has its models loaded and can run jobs."""

    @property
    @abstractmethod
    def dead(self) -> str | None:
        """Why this process's worker died, or None while it lives (or none runs here). A
        failed job does not kill it."""

    @property
    def trouble(self) -> str | None:
        """Why this process's worker cannot record its work (the job store fails), while that
        lasts; it retries meanwhile."""
        return None

    @property
    @abstractmethod
    def metrics(self) -> Totals:
        """Counters and histograms of the live workers, added up (step latency, H2D bytes...)."""

    @abstractmethod
    def live_workers(self) -> list[dict]:
        """The workers heard from lately: name, host, device, ready, and the models served."""

    @abstractmethod
    def models(self) -> list[ModelCard]:
        """Base models the live workers serve, then fine-tuned ones of those, in order."""

    def model(self, name: str) -> ModelCard | None:
        return next((m for m in self.models() if m.name == name), None)

    @abstractmethod
    def check_dataset(self, root: Path) -> int:
        """Validate an unpacked training set; return its clip count or raise ValueError naming
        the member. May decode videos: call it off the event loop."""

    @abstractmethod
    def wake(self) -> None:
        """The store has new work or a cancellation: look now rather than at the next poll."""

    @abstractmethod
    def retry_after(self) -> int:
        """Seconds until a queue slot is likely to free, for 429 answers."""
