"""MegaSlide's engine: the video DiT, its sampler, weight streaming, fine-tuning and video I/O.

The front door is `open_pipeline` (sampling) and `open_trainer` (fine-tuning); a request is a
`VideoRequest`, checked once by `resolve` against a model's limits; where the weights live is a
`Placement`. Importing this package costs nothing: the names below load their modules (and torch)
on first use, and the configs, sources, requests and placement (native/config.py, sources.py,
request.py, placement.py) never need torch, so the server reads them without it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "open_pipeline": "loader",
    "open_model": "loader",
    "open_trainer": "training.finetune",
    "FinetuneSpec": "training.finetune_spec",
    "RunSpec": "training.finetune_spec",
    "ScheduleSpec": "training.finetune_spec",
    "OptimizerSpec": "training.finetune_spec",
    "ClipSpec": "training.finetune_spec",
    "RuntimeSpec": "training.finetune_spec",
    "Placement": "placement",
    "PlacementError": "placement",
    "Trainer": "training.finetune",
    "Pipeline": "sampling.pipeline",
    "ModelSource": "sources",
    "ModelInfo": "sources",
    "describe": "sources",
    "resolve_source": "sources",
    "packaged_models": "sources",
    "VideoRequest": "request",
    "ResolvedVideo": "request",
    "RequestError": "request",
    "ModelLimits": "request",
    "resolve": "request",
    "DiTConfig": "native.config",
    "SamplingDefaults": "native.config",
    "TextEncoderConfig": "native.config",
    "PRESETS": "native.config",
    "get_preset": "native.config",
    "StreamHandle": "streaming.streamer",
    "stream_module": "streaming.streamer",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
