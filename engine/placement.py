"""Where and how a model's weights live: one spec, every combination rule written once.

    Placement(
        device="cuda",               # one device (None: the front end's default, the CPU here)
        devices=None,                # or several, one process each ("cuda:0", "cuda:1")
        offload="stream",            # "none": every weight on the device; "stream": blocks in host
        gpu_budget_bytes=20 * 2**30, # streaming: device bytes for weights, the rest stream
        prefetch=2,                  # streaming: device slots a block is copied into
        weights="lossless",          # streaming: the host store's format (weight_formats.py)
        host_tier="ram",             # streaming: blocks in RAM, on disk, or "auto" (disk_store.py)
        disk_io="buffered",          # the disk tier: through the page cache or "direct"
        timing=False,                # the streamer's copy and compute times (stats, traces)
        compile=False,               # the repeated block through torch.compile (compiled_blocks.py)
        fp8_matmul=False,            # weights="fp8": streamed linears multiply by the fp8 bytes
    )                                #   (streaming/fp8_matmul.py)

None of it changes what a model computes, apart from the lossy `weights="fp8"` and, with it,
`fp8_matmul` (the streamed blocks' linears quantize their activations to fp8 too).
`open_pipeline`, `open_model` and `stream_module` take it whole; `megaslide generate`'s flags
(clients/cli), the server's settings (server/settings.py) and the planner's `Workload`
(planner.py) are built from it, so a combination is refused in one place with one reason, whichever front end asked. Plain data, no torch: the server imports it.

A rule is `lasting` when the combination can never work (a format of the host store in RAM
cannot live on disk), or not when it is what today's code lacks (streamer timings from the ranks
of a fine-tune over several devices): the planner accounts for the latter, only the runtime
refuses it.

On several devices every streaming lever works as on one: each rank streams from one shared host
copy (a coded format encoded once, in shared memory; a disk tier read by each rank through the
shared page cache; "auto" resolved once for the host), keeps its budget's blocks resident on its
own device, and reports its own streamer timings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

OFFLOADS = ("none", "stream")
WEIGHT_FORMATS = ("raw", "lossless", "fp8")  # weight_formats.py's codecs, and no codec
HOST_TIERS = ("ram", "disk", "auto")
DISK_IO = ("buffered", "direct")
MODES = ("infer", "finetune")


class PlacementError(ValueError):
    """A placement that cannot run, with the rule that refuses it."""


@dataclass(frozen=True)
class Placement:
    """Where and how the weights live (see the module docstring)."""

    device: str | None = None  # None: "cpu" when opened; front ends fill their own default
    devices: tuple[str, ...] | None = None  # several devices, in place of `device`
    offload: str = "none"  # OFFLOADS
    gpu_budget_bytes: int | None = None  # None: every block streams
    prefetch: int = 2
    weights: str = "raw"  # WEIGHT_FORMATS
    host_tier: str = "ram"  # HOST_TIERS
    disk_io: str = "buffered"  # DISK_IO
    timing: bool = False
    compile: bool = False  # each denoiser's repeated block compiled, one graph for all of them
    # weights="fp8": the streamed blocks' linears run torch._scaled_mm on the stored fp8 weights
    # (activations quantized per token) instead of dequantizing them into the slot
    fp8_matmul: bool = False

    @property
    def streams(self) -> bool:
        return self.offload == "stream"

    def replace(self, **fields) -> Placement:
        return dataclasses.replace(self, **fields)

    def on(self, device: str) -> Placement:
        """This placement on `device` alone: one rank's of several (an "auto" host tier there is
        the one the shared copy was made for, resolved once for the host), or one device
        resolved."""
        return dataclasses.replace(self, device=device, devices=None)

    def problems(self, mode: str = "infer", *, lasting_only: bool = False) -> list[str]:
        """Why this placement cannot run `mode` ("infer" or "finetune"), each rule's reason; an
        empty list when it can. `lasting_only`: leave out what only today's code lacks."""
        found = [
            f"{name} must be one of {', '.join(allowed)}, got {value!r}"
            for name, allowed, value in self._choices(mode)
            if value not in allowed
        ]
        if found:  # the rules below read the choices: one out of range answers alone
            return found
        return [
            rule.reason.format(p=self)
            for rule in RULES
            if (rule.lasting or not lasting_only) and rule.refuses(self, mode)
        ]

    def validate(self, mode: str = "infer", *, lasting_only: bool = False) -> Placement:
        """This placement, or PlacementError naming the first rule it breaks."""
        found = self.problems(mode, lasting_only=lasting_only)
        if found:
            raise PlacementError(found[0])
        return self

    def _choices(self, mode: str) -> list[tuple[str, tuple, Any]]:
        return [
            ("mode", MODES, mode),
            ("offload", OFFLOADS, self.offload),
            ("weights", WEIGHT_FORMATS, self.weights),
            ("host_tier", HOST_TIERS, self.host_tier),
            ("disk_io", DISK_IO, self.disk_io),
        ]

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """`options` as (placement fields, the rest): a front door that takes both in one
        `**options` (`open_pipeline`'s architecture overrides) sorts them here."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in options.items() if k in names}
        return fields, {k: v for k, v in options.items() if k not in names}

    @classmethod
    def of(cls, placement: Placement | None, fields: Mapping[str, Any]) -> Placement:
        """`placement`, or one made of loose keyword `fields` (the documented Python API of
        `open_pipeline(device=..., offload=...)`); TypeError for both at once."""
        if placement is not None:
            if fields:
                raise TypeError(f"give a placement or its fields, not both: {sorted(fields)}")
            return placement
        if "device" in fields and fields["device"] is not None:
            fields = {**fields, "device": str(fields["device"])}  # a torch.device too
        if fields.get("devices") is not None:
            fields = {**fields, "devices": tuple(fields["devices"])}
        return cls(**fields)


@dataclass(frozen=True)
class Rule:
    """A combination refused: `refuses(placement, mode)` says when, `reason` says why (formatted
    with the placement as `p`)."""

    refuses: Callable[[Placement, str], bool]
    reason: str
    lasting: bool = True  # False: today's code lacks it; the planner still accounts for it


def _coded(p: Placement) -> bool:
    return p.weights != "raw"


RULES: tuple[Rule, ...] = (
    Rule(
        lambda p, mode: p.prefetch < 1,
        "prefetch must be at least 1 (the device slots streamed blocks are copied into), "
        "got {p.prefetch}",
    ),
    Rule(
        lambda p, mode: p.gpu_budget_bytes is not None and p.gpu_budget_bytes < 0,
        "gpu_budget_bytes must be >= 0, got {p.gpu_budget_bytes}",
    ),
    # Streaming's levers: each works on the streamed blocks' host store or their slots.
    Rule(
        lambda p, mode: p.gpu_budget_bytes is not None and not p.streams,
        "gpu_budget_bytes needs offload='stream': the budget chooses which streamed blocks stay "
        "on the device",
    ),
    Rule(
        lambda p, mode: _coded(p) and not p.streams,
        "weights={p.weights!r} is a format of the streamed host store: needs offload='stream'",
    ),
    Rule(
        lambda p, mode: p.host_tier == "disk" and not p.streams,
        "host_tier='disk' keeps streamed blocks on disk: needs offload='stream'",
    ),
    Rule(
        lambda p, mode: p.host_tier == "disk" and _coded(p),
        "weights={p.weights!r} is a format of the host store in RAM: the disk tier streams the "
        "files' bytes as they are (weights='raw')",
    ),
    Rule(
        lambda p, mode: p.fp8_matmul and p.weights != "fp8",
        "fp8_matmul multiplies by the streamed blocks' stored fp8 weights: needs weights='fp8'",
    ),
    Rule(
        lambda p, mode: p.fp8_matmul and p.compile,
        "fp8_matmul is checked eagerly: not with compile yet",
        lasting=False,
    ),
    # Fine-tuning updates the streamed blocks' host store in place after every step.
    Rule(
        lambda p, mode: mode == "finetune" and _coded(p),
        "fine-tuning writes the host store every step: it needs weights='raw'",
    ),
    Rule(
        lambda p, mode: mode == "finetune" and p.host_tier == "disk",
        "fine-tuning writes the host store every step: it needs host_tier='ram'",
    ),
    Rule(
        lambda p, mode: mode == "finetune" and p.gpu_budget_bytes is not None,
        "fine-tuning updates every streamed block's host store: no gpu_budget_bytes yet",
        lasting=False,
    ),
    # Several devices: a process each, every rank streaming from one shared host copy (or, on
    # the disk tier, from the files through the one page cache).
    Rule(
        lambda p, mode: p.devices is not None and len(p.devices) < 2,
        "devices must name two or more (one device: device), got {p.devices}",
    ),
    Rule(
        lambda p, mode: p.devices is not None and p.device is not None,
        "devices names the devices itself: leave out device",
    ),
    Rule(
        lambda p, mode: p.devices is not None and not p.streams,
        "devices streams every rank from one shared host copy: needs offload='stream'",
    ),
    Rule(
        lambda p, mode: mode == "finetune" and p.devices is not None and p.timing,
        "fine-tuning on several devices keeps no streamer timings of its ranks: no timing yet",
        lasting=False,
    ),
    # Compiled blocks (compiled_blocks.py) are measured where they were built: sampling on one
    # device.
    Rule(
        lambda p, mode: mode == "finetune" and p.compile,
        "compile applies to sampling: fine-tuning runs its blocks eagerly (no compile yet)",
        lasting=False,
    ),
    Rule(
        lambda p, mode: p.devices is not None and p.compile,
        "compile is checked on one device: not with devices yet",
        lasting=False,
    ),
)
