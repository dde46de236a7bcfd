"""Turning a request into a fully resolved job, with errors that name the field at fault.

Limits come from the model's card (frames, size, patch, prompt length) and the settings (steps,
prompt characters), so nothing here needs the model to be loaded.
"""

from __future__ import annotations

import secrets

from .client import ModelCard, VideoSpec
from .errors import InvalidRequest
from .schemas import Hyperparameters, VideoCreate
from .settings import Settings


def parse_size(text: str, param: str = "size") -> tuple[int, int]:
    """'WxH' -> (width, height); InvalidRequest naming `param` otherwise."""
    try:
        w, h = (int(v) for v in text.lower().strip().split("x"))
    except ValueError:
        raise InvalidRequest(
            f"{param} must look like WIDTHxHEIGHT (e.g. 64x64), got {text!r}", param=param
        ) from None
    if w < 1 or h < 1:
        raise InvalidRequest(f"{param} {text}: width and height must be positive", param=param)
    return w, h


def check_prompt(text: str, param: str, card: ModelCard, settings: Settings) -> None:
    if len(text) > settings.max_prompt_chars:
        raise InvalidRequest(
            f"{param} is {len(text)} characters; this server accepts at most "
            f"{settings.max_prompt_chars}",
            param=param,
            code="prompt_too_long",
        )
    n = card.prompt_tokens(text)
    if n > card.max_prompt_tokens:
        raise InvalidRequest(
            f"{param} is {n} {card.prompt_unit}; model {card.name} accepts at most "
            f"{card.max_prompt_tokens}",
            param=param,
            code="prompt_too_long",
        )


def resolve_video(body: VideoCreate, card: ModelCard, settings: Settings) -> VideoSpec:
    """Fill defaults from the model's card and check every limit."""
    if body.input_reference is not None:
        raise InvalidRequest(
            "input_reference (image-to-video) is not supported by this server",
            param="input_reference",
            code="unsupported_parameter",
        )
    if not body.prompt.strip():
        raise InvalidRequest("prompt must not be empty", param="prompt")
    check_prompt(body.prompt, "prompt", card, settings)
    negative = body.negative_prompt or ""
    check_prompt(negative, "negative_prompt", card, settings)

    width, height = parse_size(body.size) if body.size else (card.width, card.height)
    if width % 2 or height % 2:
        raise InvalidRequest(
            f"size {width}x{height}: width and height must be even (H.264 yuv420p)", param="size"
        )
    if max(width, height) > card.max_size:
        raise InvalidRequest(
            f"size {width}x{height}: model {card.name} takes at most {card.max_size} pixels "
            "per side",
            param="size",
        )
    _, ph, pw = card.patch
    if height % ph or width % pw:
        raise InvalidRequest(
            f"size {width}x{height}: width must be a multiple of {pw} and height of {ph} "
            f"for model {card.name}",
            param="size",
        )

    fps = body.fps or card.fps
    if body.num_frames is not None:
        frames, param = body.num_frames, "num_frames"
        if body.seconds is not None and round(body.seconds * fps) != frames:
            raise InvalidRequest(
                f"seconds ({body.seconds:g}) and num_frames ({frames}) disagree at {fps} fps; "
                "give one of them",
                param="seconds",
            )
    elif body.seconds is not None:
        frames, param = round(body.seconds * fps), "seconds"
    else:
        frames, param = card.frames, "num_frames"
    if not 1 <= frames <= card.max_frames:
        what = (
            f"seconds ({body.seconds:g} s at {fps} fps = {frames} frames)"
            if param == "seconds"
            else f"num_frames ({frames})"
        )
        raise InvalidRequest(
            f"{what}: model {card.name} takes 1 to {card.max_frames} frames "
            f"({card.max_frames / fps:g} s at {fps} fps)",
            param=param,
        )
    if frames % card.patch[0]:
        raise InvalidRequest(
            f"num_frames ({frames}) must be a multiple of {card.patch[0]} for model {card.name}",
            param=param,
        )

    steps = body.num_inference_steps or card.steps
    if steps > settings.max_steps:
        raise InvalidRequest(
            f"num_inference_steps ({steps}) exceeds this server's limit of {settings.max_steps}",
            param="num_inference_steps",
        )
    guidance = card.guidance if body.guidance_scale is None else body.guidance_scale
    # A chosen seed is echoed back, so an unseeded request can still be reproduced later.
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    return VideoSpec(
        model=card.name,
        prompt=body.prompt,
        negative_prompt=negative,
        frames=frames,
        width=width,
        height=height,
        fps=fps,
        steps=steps,
        guidance=guidance,
        seed=seed,
        priority=body.priority,
    )


def resolve_hyperparameters(h: Hyperparameters, settings: Settings) -> dict:
    """'auto' becomes the server's default; the clip shape is checked like a video's."""
    width = height = None
    if h.size is not None:
        width, height = parse_size(h.size, "hyperparameters.size")
        if width % 2 or height % 2:
            raise InvalidRequest(
                "hyperparameters.size: width and height must be even", param="hyperparameters.size"
            )
    return {
        "n_epochs": settings.finetune_epochs if h.n_epochs == "auto" else h.n_epochs,
        "batch_size": 1 if h.batch_size == "auto" else h.batch_size,
        "learning_rate_multiplier": 1.0
        if h.learning_rate_multiplier == "auto"
        else h.learning_rate_multiplier,
        "num_frames": h.num_frames,
        "width": width,
        "height": height,
    }
