"""MegaSlide engine: the video DiT, its sampler, weight streaming, fine-tuning and video I/O.

Importing this package needs torch, numpy and safetensors only; PyAV is imported where videos are
read or written.
"""

from .checkpoint import load_model, save_model
from .dit import PRESETS, DiTConfig, VideoDiT, count_parameters, get_preset
from .flow import SampleState, denoise_step, flow_matching_loss, shifted_schedule
from .pipeline import GenerationRequest, VideoPipeline
from .streaming import StreamHandle, stream_module
from .text import BuiltinTextEncoder, TextEncoder, TextEncoderConfig

__all__ = [
    "PRESETS",
    "BuiltinTextEncoder",
    "DiTConfig",
    "GenerationRequest",
    "SampleState",
    "TextEncoder",
    "StreamHandle",
    "TextEncoderConfig",
    "VideoDiT",
    "VideoPipeline",
    "count_parameters",
    "denoise_step",
    "flow_matching_loss",
    "get_preset",
    "load_model",
    "save_model",
    "shifted_schedule",
    "stream_module",
]
