"""What diffusers' own Wan pipelines make of a request, and what MegaSlide makes of it, run so that
the two can be compared bit for bit on any x86 CPU.

Why the reference's weights are re-homed (the one place this is decided):
MKL picks its GEMM kernels by CPU (AVX-512 on most Intel servers; AVX2 or SSE paths on AMD and
older Intel), and some of those kernels sum in an order that depends on how a matrix is aligned in
memory: on the SSE4.2 path a one-row `Linear` (Wan's time embedder) gives a different last bit when
its weight starts 8 bytes past a 16-byte boundary. `from_pretrained` leaves every weight as a view
into the memory-mapped safetensors file, at the file's own offsets (8 or 40 bytes past a 64-byte
boundary); MegaSlide's loader and host stores put every tensor at a 64-byte boundary, as torch's
allocator does. Same maths, same inputs, different alignment: one uint8 level apart on an AMD EPYC
after a few steps, equal on an AVX-512 Intel machine by luck of the kernel.

So the reference runs with its weights copied into memory of torch's allocator (`rehome`), the
alignment MegaSlide gives them, and both sides are checked to be 64-byte aligned before any
comparison. MKL's own reproducibility mode (`MKL_CBWR=COMPATIBLE`) would also hide the difference,
but only for MKL's routines and only when set before MKL starts; equal alignment removes the cause
for every kernel. The tests marked `cpu_variants` also run in child processes on MKL's AVX2 and SSE4.2 code
paths, with torch's and oneDNN's vector width lowered to match (`CPU_VARIANTS`), so a machine with
AVX-512 checks what an AMD or older Intel machine would compute.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from megaslide.engine.streaming.host_store import ALIGN_BYTES

# Code paths of other x86 CPUs, by the environment variables each library reads at start:
# MKL's kernels, torch's own vectorised kernels (ATen) and oneDNN's.
CPU_VARIANTS = {
    "avx2": {  # AMD Zen 2/3, Intel before AVX-512
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "sse4_2": {  # the oldest x86-64 path the libraries keep
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
}
REPOSITORY = Path(__file__).resolve().parents[2]


def rehome(*modules: nn.Module) -> None:
    """Copy every parameter and buffer of `modules` into storage from torch's allocator (64-byte
    aligned), keeping tensors that shared storage shared."""
    copies: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            key = t.data_ptr()
            if key not in copies:
                copies[key] = t.detach().clone()
            t.data = copies[key]


def misaligned(*modules: nn.Module) -> list[str]:
    """Names of the tensors of `modules` that do not start at a 64-byte boundary."""
    return [
        name
        for module in modules
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if t.numel() and t.data_ptr() % ALIGN_BYTES
    ]


def diffusers_run(
    path,
    request,
    image=None,
    *,
    last_image=None,
    video=None,
    strength: float = 0.8,
    vace: dict | None = None,
    animate: dict | None = None,
    aligned: bool = True,
    step_generator: bool = False,
) -> tuple[list[torch.Tensor], np.ndarray]:
    """diffusers' pipeline at `path` (or a pipeline already loaded, with adapters say) on
    `request` (a VideoRequest), its weights re-homed unless not `aligned`: the latents after
    every step, and the frames as uint8, rounded as MegaSlide rounds. `image` and `last_image`
    (files): `WanImageToVideoPipeline`'s first and last frames; `video` (a file): the request's
    first frames of it remade by `WanVideoToVideoPipeline` at `strength`. `vace`:
    `WanVACEPipeline`'s conditioning (keys `reference_images`, a list of files; `control_video`
    and `mask`, files whose first frames are taken, the mask's as greyscale;
    `conditioning_scale`), for a VACE pipeline at `path`. `animate`: `WanAnimatePipeline`'s
    videos (keys `pose_video`, `face_video`, and for its replace mode `background_video` and
    `mask_video`: files whose first `frames` frames are the clip, in segments of the request's
    `segment_frame_length`, default `frames`), with `image` the character, for an Animate
    pipeline at `path`. `step_generator`: the
    scheduler's steps draw their noise from the generator that drew the starting noise
    (WanPipeline passes none: a consistency scheduler would draw from the global one)."""
    import diffusers
    from PIL import Image

    cls = diffusers.WanPipeline if image is None else diffusers.WanImageToVideoPipeline
    if vace is not None:
        cls = diffusers.WanVACEPipeline
    if animate is not None:
        cls = diffusers.WanAnimatePipeline
    pipe = cls.from_pretrained(path) if isinstance(path, (str, os.PathLike)) else path
    extra = {}
    if image is not None:
        extra = {"image": Image.open(image)}
    if last_image is not None:
        extra["last_image"] = Image.open(last_image)
    if video is not None:
        from megaslide.engine.video import read_video

        # WanVideoToVideoPipeline over the text-to-video pipeline's own modules.
        names = ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")
        pipe = diffusers.WanVideoToVideoPipeline(**{n: pipe.components[n] for n in names})
        frames = read_video(video, num_frames=request.frames, sampling="first")
        extra = {"video": [Image.fromarray(f) for f in frames], "strength": strength}
    if vace is not None:
        from megaslide.engine.video import read_video

        def frames_of(file, mode):
            return [
                Image.fromarray(f).convert(mode)
                for f in read_video(file, num_frames=request.frames, sampling="first")
            ]

        extra = {"conditioning_scale": vace.get("conditioning_scale", 1.0)}
        if vace.get("reference_images"):
            extra["reference_images"] = [Image.open(f) for f in vace["reference_images"]]
        if vace.get("control_video"):
            extra["video"] = frames_of(vace["control_video"], "RGB")
        if vace.get("mask"):
            extra["mask"] = frames_of(vace["mask"], "L")
    if animate is not None:
        from megaslide.engine.video import read_video

        def frames_of(file):
            frames = read_video(file, num_frames=request.frames, sampling="first")
            return [Image.fromarray(f) for f in frames]

        # The request's segments (default: one, the clip)
        extra["segment_frame_length"] = request.segment_frame_length or request.frames
        if request.prev_segment_conditioning_frames is not None:
            extra["prev_segment_conditioning_frames"] = request.prev_segment_conditioning_frames
        extra["mode"] = "replace" if animate.get("background_video") else "animate"
        for name, file in animate.items():
            if file is not None:
                extra[name] = frames_of(file)
    modules = [m for m in pipe.components.values() if isinstance(m, nn.Module)]
    if aligned:
        rehome(*modules)
        assert not misaligned(*modules)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(request.seed)
    if step_generator:
        step = pipe.scheduler.step
        pipe.scheduler.step = lambda *args, **kw: step(*args, generator=generator, **kw)
    latents = []

    def keep(_pipe, _i, _t, tensors):
        latents.append(tensors["latents"].clone())
        return {}

    out = pipe(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        height=request.height,
        width=request.width,
        **({} if video is not None or animate is not None else {"num_frames": request.frames}),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance,
        generator=generator,
        output_type="np",
        callback_on_step_end=keep,
        callback_on_step_end_tensor_inputs=["latents"],
        **extra,
    ).frames[0]
    return latents, np.round(out * 255).astype(np.uint8)


def megaslide_run(pipe, request) -> tuple[list[torch.Tensor], np.ndarray]:
    """MegaSlide's pipeline on `request`, alone: the latents after every step, and the frames."""
    parts = [pipe.encoders.text_encoder, pipe.encoders.vae, *pipe.experts]
    if pipe.encoders.image_encoder is not None:
        parts.append(pipe.encoders.image_encoder)
    assert not misaligned(*parts), misaligned(*parts)[:5]
    state = pipe.prepare(pipe.resolve(request))
    latents = []
    while not state.done:
        pipe.denoise_step([state])
        latents.append(state.latents.clone())
    return latents, pipe.finish(state)


def first_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> str | None:
    """Where two runs' per-step latents first differ, or None when they are bitwise equal."""
    if len(ours) != len(theirs):
        return f"{len(ours)} steps against {len(theirs)}"
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if not torch.equal(a, b):
            return f"step {step}: max |diff| {(a - b).abs().max().item():.3g}"
    return None


def on_cpu_variants(*values):
    """A parametrized case that also runs on the other CPUs' code paths (marked `cpu_variants`):
    one case per task is enough there, the kernels being what differs."""
    return pytest.param(*values, marks=pytest.mark.cpu_variants)


def run_on_cpu_variant(variant: str, marker: str, *test_files: Path) -> subprocess.CompletedProcess:
    """The tests of `test_files` marked `marker`, in one child pytest on another CPU's code
    paths."""
    env = {**os.environ, **CPU_VARIANTS[variant]}
    # -P: the repository root stays off sys.path (its kernels/ folder would hide the kernels
    # package that transformers imports).
    command = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*command, "-m", marker, *map(str, test_files)],
        cwd=REPOSITORY,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
