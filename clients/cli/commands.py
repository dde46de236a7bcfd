"""Local commands of the CLI: each `register_*` adds a subcommand whose `run` does the work."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

from megaslide.engine.native.config import SAMPLERS, TIME_SAMPLING
from megaslide.engine.placement import DISK_IO, Placement
from megaslide.engine.training.finetune_spec import (
    LR_SCHEDULES,
    TRAINING_STATES,
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    RuntimeSpec,
    ScheduleSpec,
    ValidationPrompt,
    ValidationSpec,
)

from .args import (
    UsageError,
    add_model_args,
    check_positive,
    in_flag_words,
    model_source,
    parse_bytes,
    parse_cache,
    print_json,
    progress_bar,
)

# ---------------------------------------------------------------------------------------------
# generate


def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a video from a prompt")
    p.add_argument("prompt")
    _add_sampling_args(p)
    _add_conditioning_args(p)
    _add_placement_args(p)
    p.add_argument("--stats", help="write streaming and step-time stats as JSON here")
    p.add_argument(
        "--trace", help="write a Chrome trace (Perfetto) of block copies and computes here"
    )
    p.add_argument("--server", help="generate on a MegaSlide server at this URL instead of locally")
    p.add_argument("--api-key", help="API key for --server (default: $MEGASLIDE_API_KEY)")
    p.add_argument(
        "--no-reuse",
        action="store_true",
        help="with --server: run the video even when one of your finished videos there repeats "
        "it in everything that decides the pixels (by default that video's MP4 is the answer)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(run=run_generate)


def _add_sampling_args(p) -> None:
    """What a video is: its output, model, length, size and sampling."""
    p.add_argument("-o", "--output", default="out.mp4", help="MP4 file to write (default: out.mp4)")
    add_model_args(p)
    p.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, help="number of frames (default: the model's)")
    p.add_argument("--size", help="WIDTHxHEIGHT, both even (default: the model's)")
    p.add_argument("--fps", type=int, help="frames per second of the MP4 (default: the model's)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (1 = off)")
    p.add_argument(
        "--guidance-interval",
        metavar="START,END",
        help="guide only the steps in this fraction of the schedule, e.g. 0,0.5 (default: all)",
    )
    p.add_argument("--negative-prompt", default="", help="what to steer away from")
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        help="the model's own scheduler, flow Euler or consistency sampling over --timesteps "
        "(default: an adapter's, else the model's)",
    )
    p.add_argument(
        "--timesteps",
        metavar="T,T,...",
        help="the timesteps an euler or consistency sampler visits, from 1000 (noise) down, e.g. "
        "1000,750,500,250 (default: spread evenly over --steps)",
    )
    p.add_argument(
        "--shift", type=float, help="the schedule's timestep shift (default: the model's)"
    )


def _add_conditioning_args(p) -> None:
    """What steers it besides the prompt: a first (and last) frame, an input video, a step
    cache, single-file transformers and LoRA adapters."""
    p.add_argument(
        "--image",
        help="first-frame image, for a model that takes one (Wan2.2-TI2V) or needs one (the I2V "
        "models); with --server it is uploaded",
    )
    p.add_argument(
        "--last-image",
        help="last-frame image besides --image, for a model that takes one (Wan2.2-I2V-A14B) or "
        "needs one (Wan2.1-FLF2V); with --server it is uploaded",
    )
    p.add_argument(
        "--video",
        help="input video to remake (video-to-video, text-to-video Wan models): its first "
        "--frames frames (default: as many as it holds, to the model's frame rule), resized to "
        "--size; with --server it is uploaded",
    )
    p.add_argument(
        "--strength",
        type=float,
        help="with --video: the fraction of the schedule that runs from the noised video "
        "(0 < S <= 1, default 0.8; 1 starts from nearly pure noise)",
    )
    p.add_argument(
        "--reference-image",
        action="append",
        dest="reference_images",
        metavar="IMAGE",
        help="a VACE model's reference image (repeat for several, at most 4): what the clip "
        "shows, fitted into its frame on white; with --server it is uploaded",
    )
    p.add_argument(
        "--control-video",
        help="a VACE model's control video: its first --frames frames (default: as many as it "
        "holds, to the model's frame rule), resized to --size; with --server it is uploaded",
    )
    p.add_argument(
        "--mask",
        help="with --control-video: a video of masks over it (white: generate, black: keep the "
        "control video); with --server it is uploaded",
    )
    p.add_argument(
        "--pose-video",
        help="a Wan Animate model's pose video (with --image, the character): its first --frames "
        "frames (default: as many as it holds, to the model's frame rule), resized to --size; "
        "with --server it is uploaded",
    )
    p.add_argument(
        "--face-video",
        help="a Wan Animate model's face video (the face's frames, resized to its motion "
        "encoder's square); with --server it is uploaded",
    )
    p.add_argument(
        "--background-video",
        help="a Wan Animate model's replace mode: the video whose person the character replaces "
        "(with --background-mask); with --server it is uploaded",
    )
    p.add_argument(
        "--background-mask",
        help="with --background-video: a video of masks over it (white: the person to replace); "
        "with --server it is uploaded",
    )
    p.add_argument(
        "--segment-frame-length",
        type=int,
        metavar="FRAMES",
        help="a Wan Animate model's segments: the clip is made in segments of FRAMES frames "
        "(4k + 1; default: the clip's, one segment)",
    )
    p.add_argument(
        "--prev-segment-conditioning-frames",
        type=int,
        choices=(1, 5),
        help="with --segment-frame-length: the frames each segment after the first continues "
        "from the one before (default 1)",
    )
    p.add_argument(
        "--conditioning-scale",
        type=float,
        help="a VACE model's weight of its VACE blocks' hints (0 to 10, default 1)",
    )
    p.add_argument(
        "--cache",
        help="step cache: a preset (quality, balanced, fast; default off), "
        "POLICY:THRESHOLD[:FORECAST] (output-change, adaptive or first-block; forecast none, "
        "linear or quadratic; e.g. adaptive:0.01 or adaptive:0.02:linear), or a JSON object",
    )
    p.add_argument(
        "--transformer",
        action="append",
        default=[],
        metavar="FILE",
        help="a single-file transformer checkpoint (original Wan, ComfyUI or diffusers keys; fp8 "
        "scaled upcast) over the --model pipeline directory; Wan2.2-A14B: high, then low",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="apply the LoRA adapter in FILE (repeatable); with --server, NAME alone names an "
        "adapter registered there",
    )
    p.add_argument(
        "--lora-scale",
        action="append",
        default=[],
        metavar="NAME=SCALE",
        help="an adapter's scale (default: 1)",
    )
    p.add_argument(
        "--lora-expert",
        action="append",
        default=[],
        metavar="NAME=high|low",
        help="apply an adapter to one expert of a Wan2.2 two-expert model only (default: both)",
    )


def _add_placement_args(p) -> None:
    """Where the weights live (a `Placement`) and how the model attends."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--devices",
        metavar="DEV,DEV,...",
        help="split the video's tokens over these devices (sequence parallel, one process each, "
        "streaming from one shared host copy of the blocks, in --weights' format, or from the "
        "files with --host-tier disk): cpu,cpu or cuda:0,cuda:1",
    )
    p.add_argument(
        "--attention",
        choices=("dense", "dsa", "sage"),
        help="self-attention backend (default: the model's); sage: 8-bit attention over all "
        "tokens for a dense model as it is (inference only, SageAttention's accuracy)",
    )
    p.add_argument(
        "--offload",
        choices=("none", "stream"),
        help="stream block weights from host RAM (default: none, all weights on the device; "
        "stream with --devices)",
    )
    p.add_argument(
        "--gpu-budget",
        type=parse_bytes,
        help="device bytes for weights when streaming, e.g. 20GB (each device's, with --devices)",
    )
    p.add_argument(
        "--weights",
        choices=("raw", "lossless", "fp8"),
        default="raw",
        help="with --offload stream: how block weights are kept in host RAM and sent each step; "
        "lossless codes bf16 exponents (about 0.68x the bytes, bitwise the same video), fp8 "
        "halves linear weights with per-channel scales (lossy; linears an fp8 --transformer file "
        "stores in fp8 are kept as stored, bitwise the upcast video) (default: raw)",
    )
    p.add_argument(
        "--host-tier",
        choices=("ram", "disk", "auto"),
        default="auto",
        help="with --offload stream: keep streamed blocks in host RAM, or read them from the "
        "model's safetensors files each step through a small ring (host RAM smaller than the "
        "model); auto picks disk when the blocks would not fit in the available RAM (default: auto)",
    )
    p.add_argument(
        "--disk-io",
        choices=DISK_IO,
        default="buffered",
        help="with --host-tier disk: read blocks through the page cache (buffered) or around it "
        "(direct, O_DIRECT where the filesystem takes it) (default: buffered)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run the denoiser's repeated block through torch.compile, one graph for all blocks "
        "(resident or streamed; the first step pays the compile, tens of seconds on a CPU; "
        "docs/models.md)",
    )
    p.add_argument(
        "--fp8-matmul",
        action="store_true",
        help="with --weights fp8: the streamed blocks' linears multiply by the stored fp8 weights "
        "(torch._scaled_mm, activations quantized per token) instead of dequantizing them; "
        "where _scaled_mm cannot run it dequantizes and --stats says why (docs/streaming.md)",
    )


def lora_flags(args, *, remote: bool) -> tuple[dict[str, str], tuple]:
    """`--lora`, `--lora-scale` and `--lora-expert` as (files by name, the request's choices)."""
    from megaslide.engine.request import LoraChoice

    files: dict[str, str] = {}
    names: list[str] = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not name or (sep and not path) or (not sep and not remote):
            raise UsageError(
                f"--lora {spec!r}: expected NAME=FILE" + (" or NAME" if remote else "")
            )
        if name in names:
            raise UsageError(f"--lora {name}: given twice")
        if sep:
            if remote:
                raise UsageError("--lora NAME=FILE is local: with --server name an adapter there")
            if not Path(path).is_file():
                raise UsageError(f"--lora {spec}: {path} not found")
            files[name] = path
        names.append(name)
    options: dict[str, dict] = {n: {} for n in names}
    for flag, values, key in (
        ("--lora-scale", args.lora_scale, "scale"),
        ("--lora-expert", args.lora_expert, "expert"),
    ):
        for spec in values:
            name, sep, value = spec.partition("=")
            if not sep or name not in options:
                raise UsageError(f"{flag} {spec!r}: expected NAME=VALUE for a NAME given to --lora")
            if key == "scale":
                try:
                    value = float(value)
                except ValueError:
                    raise UsageError(f"{flag} {spec!r}: the scale must be a number") from None
            options[name][key] = value
    return files, tuple(LoraChoice(n, **options[n]) for n in names)


def parse_numbers(text: str | None, flag: str, kind: type) -> tuple | None:
    """A comma-separated list of numbers (`kind`), or a UsageError naming `flag`."""
    if text is None:
        return None
    try:
        return tuple(kind(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def video_frames(path: str, limits, flag: str = "--video") -> int:
    """The longest clip the model makes of the video at `path` (every frame decoded)."""
    from megaslide.engine.video import count_frames

    if not Path(path).is_file():
        raise UsageError(f"{flag}: {path} not found")
    try:
        return limits.fit_frames(count_frames(path))
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def run_generate(args) -> int:
    from megaslide.engine.request import VideoRequest, parse_size, resolve
    from megaslide.engine.sources import describe

    width, height = parse_size(args.size, "--size") if args.size else (None, None)
    check_positive(steps=args.steps, frames=args.frames, fps=args.fps)
    if not args.output.lower().endswith(".mp4"):
        raise UsageError(f"--output must be an .mp4 file, got {args.output}")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():
        raise UsageError(f"--output: directory {out_dir} does not exist")
    request = VideoRequest(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        frames=args.frames,
        width=width,
        height=height,
        fps=args.fps,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        image=args.image,
        last_image=args.last_image,
        video=args.video,
        strength=args.strength,
        reference_images=tuple(args.reference_images or ()),
        control_video=args.control_video,
        mask=args.mask,
        conditioning_scale=args.conditioning_scale,
        pose_video=args.pose_video,
        face_video=args.face_video,
        background_video=args.background_video,
        background_mask=args.background_mask,
        segment_frame_length=args.segment_frame_length,
        prev_segment_conditioning_frames=args.prev_segment_conditioning_frames,
        cache=parse_cache(args.cache),
        sampler=args.sampler,
        timesteps=parse_numbers(args.timesteps, "--timesteps", int),
        shift=args.shift,
        guidance_interval=parse_numbers(args.guidance_interval, "--guidance-interval", float),
    )
    lora_files, choices = lora_flags(args, remote=bool(args.server))
    request = dataclasses.replace(request, loras=choices)
    if args.server:
        from .remote import generate_remote

        return generate_remote(args, request)
    placement = generate_placement(args)
    overrides = {"attention": args.attention} if args.attention else {}
    if args.transformer:
        if describe(model_source(args)).family != "wan":
            raise UsageError("--transformer needs --model naming a Wan pipeline directory")
        overrides["transformer_files"] = tuple(args.transformer)
    info = describe(model_source(args), **overrides)
    from megaslide.engine.loader import load_adapter, open_pipeline

    # Adapters are converted and checked against the model on the meta device, and the request
    # against the model and them, before any weights load.
    adapters = [load_adapter(info, name, path) for name, path in lora_files.items()]
    defaults = {a.name: a.defaults for a in adapters}
    if request.frames is None:  # an input, control or pose video's length, to the frame rule
        for flag, path in (
            ("--video", request.video),
            ("--control-video", request.control_video),
            ("--pose-video", request.pose_video),
        ):
            if path is not None:
                frames = video_frames(path, info.limits, flag)
                request = dataclasses.replace(request, frames=frames)
                break
    video = resolve(request, info.limits, info.sampling, model=info.name, adapters=defaults)
    if placement.devices:
        return run_generate_on_devices(args, info, video, placement, adapters)
    pipe = open_pipeline(info, placement)
    for adapter in adapters:
        pipe.register_adapter(adapter)
    step_times = []
    state = pipe.prepare(video)
    # Video-to-video runs the last of its steps; Wan Animate runs them once a segment.
    with progress_bar(state.num_steps, "denoising", disable=args.no_progress) as bar:
        while not state.done:
            start = time.perf_counter()
            pipe.denoise_step([state])
            step_times.append(time.perf_counter() - start)
            bar.update(1)
    from megaslide.engine.video import write_mp4_chunks

    # The MP4 encoder takes each chunk of frames on its own thread while the next one decodes.
    frames = write_mp4_chunks(args.output, pipe.finish_chunks(state), fps=video.fps)
    if args.stats:
        stats = {
            "steps": video.steps,
            "passes": state.passes,  # fewer than steps when a step cache reused outputs
            # Rows through the model: two a guided step, one otherwise (a guidance interval).
            "row_passes": state.row_passes,
            "sampler": video.sampler,
            "timesteps": video.timesteps,
            "guidance_interval": video.guidance_interval,
            "cache": video.cache.to_dict() if video.cache else None,
            "step_times_s": step_times,
            "components": pipe.stats(),
            # Each compiled denoiser's graphs, recompiles and graph breaks (with --compile).
            "compile": pipe.compile_stats(),
        }
        Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n")
    if args.trace:
        pipe.write_trace(args.trace)
    cached = f", {state.passes} passes for {video.steps} steps" if video.cache else ""
    print(
        f"wrote {args.output} ({frames} frames, {video.width}x{video.height}, {video.fps} fps"
        f"{cached})",
        file=sys.stderr,
    )
    return 0


def generate_placement(args) -> Placement:
    """Where `generate`'s flags put the weights, checked by the placement's rules (a UsageError
    naming the flags of the first one they break)."""
    devices = None
    if args.devices:
        from megaslide.engine.parallel.ranks import parse_devices

        try:
            devices = tuple(parse_devices(args.devices))
        except ValueError as e:
            raise UsageError(f"--devices: {e}") from None
    timing = bool(args.stats or args.trace)
    placement = Placement(
        device=None if devices and args.device == "cpu" else args.device,
        devices=devices,
        offload=args.offload or ("stream" if devices else "none"),
        gpu_budget_bytes=args.gpu_budget,
        weights=args.weights,
        host_tier=args.host_tier,
        disk_io=args.disk_io,
        timing=timing,
        compile=args.compile,
        fp8_matmul=args.fp8_matmul,
    )
    try:
        placement.validate()
    except ValueError as e:
        raise UsageError(in_flag_words(str(e))) from None
    if args.trace and not placement.streams:  # what it draws is the streamer's
        raise UsageError("--trace records the streamed blocks: needs --offload stream")
    if args.stats and not (placement.streams or placement.compile):
        raise UsageError(
            "--stats records the streamed blocks or the compiled ones: needs --offload stream "
            "or --compile"
        )
    return placement


def run_generate_on_devices(args, info, video, placement: Placement, adapters) -> int:
    """`generate --devices`: one video split over several devices
    (engine/parallel/multidevice.py), the LoRA `adapters` registered on every rank."""
    from megaslide.engine.parallel.multidevice import RankFailed, generate_on_devices

    if args.trace:
        raise UsageError("--trace draws one device's streams: with --devices, --stats has each's")
    devices = placement.devices
    per_rank: list[dict] = []
    step_ends = [time.perf_counter()]

    def stepped(step: int, total: int) -> None:
        step_ends.append(time.perf_counter())
        bar.update(1)

    with progress_bar(video.steps, "denoising", disable=args.no_progress) as bar:
        try:
            frames = generate_on_devices(
                info,
                video,
                placement,
                adapters=adapters,
                output=args.output,
                progress=stepped,
                stats=per_rank.extend if args.stats else None,
            )
        except RankFailed as e:  # the other ranks were stopped; no output was written
            print(f"megaslide generate: error: {e}", file=sys.stderr)
            return 1
    if args.stats:
        stats = {
            "steps": video.steps,
            "devices": list(devices),
            # As each step came back here (the ranks step in lock step).
            "step_times_s": [b - a for a, b in zip(step_ends, step_ends[1:])],
            "ranks": per_rank,  # each rank's streamed components, rank order
        }
        Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n")
    print(
        f"wrote {args.output} ({frames} frames, {video.width}x{video.height}, {video.fps} fps, "
        f"{len(devices)} devices)",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------------------------------
# info


def register_info(sub) -> None:
    p = sub.add_parser("info", help="print a preset's or model's config and exact parameter count")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_info)


def run_info(args) -> int:
    from megaslide.engine.family import family
    from megaslide.engine.sources import describe

    info = describe(model_source(args))
    config, counts = info.config, family(info.family).count_parameters(info)
    out = {
        "name": info.name,
        "family": info.family,
        "parameters": counts["total"],
        "parameter_counts": counts,
        "config": config.to_dict(),
        "sampling": info.sampling.to_dict(),
        "limits": info.limits.to_dict(),
    }
    if args.json:
        print_json(out)
    else:
        experts = f"{counts['experts']} experts x " if counts["experts"] > 1 else ""
        print(
            f"{info.name} ({info.family}): {counts['total']:,} parameters "
            f"({counts['total'] / 1e9:.3g}B); {experts}{counts['blocks']} blocks of "
            f"{counts['per_block']:,}; dim {config.dim}, heads {config.heads}"
        )
    return 0


# ---------------------------------------------------------------------------------------------
# plan


def register_plan(sub) -> None:
    p = sub.add_parser("plan", help="memory and time accounting of a model on a machine")
    _add_plan_workload_args(p)
    _add_plan_machine_args(p)
    _add_plan_training_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_plan)


def _add_plan_workload_args(p) -> None:
    """The model and the clips it runs."""
    add_model_args(p)
    p.add_argument("--mode", choices=("infer", "finetune"), default="infer")
    p.add_argument(
        "--frames", type=int, help="clip frames in pixels-space frames (default: the model's)"
    )
    p.add_argument("--size", help="clip WIDTHxHEIGHT in pixels (default: the model's)")
    p.add_argument(
        "--batch", type=int, default=1, help="requests (inference) or clips (fine-tuning) per step"
    )
    p.add_argument(
        "--no-guidance", action="store_true", help="inference without the unconditional pass"
    )


def _add_plan_machine_args(p) -> None:
    """The machine: its memories, links and speeds, and the streamer's placement."""
    p.add_argument(
        "--gpu-mem", type=parse_bytes, default="141GB", help="device memory (default: 141GB)"
    )
    p.add_argument(
        "--host-mem", type=parse_bytes, default="1.5TB", help="host RAM (default: 1.5TB)"
    )
    p.add_argument(
        "--gpu-budget",
        type=parse_bytes,
        help="device bytes for weights (default: stream every block)",
    )
    p.add_argument(
        "--weights",
        choices=("raw", "lossless", "fp8"),
        default="raw",
        help="inference: host format of streamed blocks (default: raw)",
    )
    p.add_argument(
        "--fp8-matmul",
        action="store_true",
        help="with --weights fp8: streamed linears multiply by the fp8 weights (no decode of "
        "them; their FLOPs at --fp8-tflops)",
    )
    p.add_argument(
        "--host-tier",
        choices=("ram", "disk", "auto"),
        default="auto",
        help="inference: streamed blocks in host RAM or read from disk each step; auto picks "
        "disk when they need more than 80%% of --host-mem (default: auto)",
    )
    p.add_argument(
        "--disk-gbps",
        type=float,
        default=3.0,
        help="disk tier: read GB/s of the model's files, cold page cache (default: 3; "
        "benchmarks/disk_streaming.py measures it)",
    )
    p.add_argument(
        "--decode-gbps",
        type=float,
        default=200.0,
        help="decoded GB/s of the lossless/fp8 decode on the device (default: 200)",
    )
    p.add_argument("--h2d-gbps", type=float, default=55.0, help="host-to-device GB/s (default: 55)")
    p.add_argument("--d2h-gbps", type=float, default=55.0, help="device-to-host GB/s (default: 55)")
    p.add_argument(
        "--tflops", type=float, default=790.0, help="achieved bf16 TFLOP/s (default: 790)"
    )
    p.add_argument(
        "--fp8-tflops",
        type=float,
        default=1580.0,
        help="achieved fp8 TFLOP/s, for --fp8-matmul (default: 1580, twice bf16's)",
    )
    p.add_argument(
        "--host-gbps", type=float, default=200.0, help="host memory GB/s for the CPU optimizer"
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=32,
        help="threads the CPU optimizer updates on: the 8-bit moments' codecs bound the "
        "update when too few (default: 32)",
    )
    p.add_argument(
        "--prefetch", type=int, default=2, help="device slots for streamed blocks (default: 2)"
    )


def _add_optimizer_state_arg(p) -> None:
    p.add_argument(
        "--optimizer-state",
        metavar="FORMAT",
        help="how the optimizer keeps master weights and moments in host RAM: "
        f"{', '.join(TRAINING_STATES)} (default: fp32; bf16-sr/8bit needs about a third of "
        "fp32's bytes per parameter)",
    )
    p.add_argument(
        "--optimizer-state-tier",
        choices=("ram", "disk"),
        help="where the optimizer keeps its moments (and a bf16-split master's low halves) "
        "between updates: host RAM, or files on local disk read ahead and written behind "
        "per block (default: ram)",
    )


def _add_plan_training_args(p) -> None:
    """Fine-tuning's optimizer step, LoRA adapters and several devices."""
    p.add_argument(
        "--max-grad-norm", action="store_true", help="fine-tuning with global-norm clipping"
    )
    _add_optimizer_state_arg(p)
    p.add_argument("--grad-accum", type=int, default=1, help="fine-tuning micro-batches per step")
    p.add_argument(
        "--expert",
        choices=("high", "low", "both"),
        help="fine-tuning a two-expert model (Wan2.2-A14B): one expert, or both in one run "
        "(default: both)",
    )
    p.add_argument(
        "--dtype-bytes",
        type=int,
        default=2,
        help="bytes per compute-dtype value (default: 2, bf16)",
    )
    p.add_argument(
        "--loras", type=int, default=0, help="LoRA adapters registered (inference; Wan models)"
    )
    p.add_argument("--lora-rank", type=int, default=32, help="their rank (default: 32)")
    p.add_argument(
        "--fine-tunes",
        type=int,
        default=0,
        help="fine-tunes of the model served as deltas over it (inference)",
    )
    p.add_argument(
        "--delta-ratio",
        type=float,
        default=None,
        help="each one's delta bytes over its denoiser's bf16 bytes (default: the planner's)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="devices: inference splits one clip's tokens over them, fine-tuning the batch "
        "(default: 1)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=300.0,
        help="all-to-all GB/s sent per device between devices (default: 300, assumed NVLink)",
    )


def run_plan(args) -> int:
    from megaslide.engine.planner import Machine, Workload, format_plan, plan
    from megaslide.engine.request import parse_size
    from megaslide.engine.sources import describe

    width, height = parse_size(args.size, "--size") if args.size else (None, None)
    check_positive(
        batch=args.batch,
        prefetch=args.prefetch,
        frames=args.frames,
        devices=args.devices,
        cpu_threads=args.cpu_threads,
    )
    machine = Machine(
        gpu_mem=args.gpu_mem,
        host_mem=args.host_mem,
        h2d_gbps=args.h2d_gbps,
        d2h_gbps=args.d2h_gbps,
        tflops=args.tflops,
        fp8_tflops=args.fp8_tflops,
        host_gbps=args.host_gbps,
        cpu_threads=args.cpu_threads,
        decode_gbps=args.decode_gbps,
        link_gbps=args.link_gbps,
        disk_gbps=args.disk_gbps,
    )
    # The planner plans streaming, on `--devices` devices (a count: no names needed).
    placement = Placement(
        offload="stream",
        gpu_budget_bytes=args.gpu_budget,
        prefetch=args.prefetch,
        weights=args.weights,
        fp8_matmul=args.fp8_matmul,
        host_tier=args.host_tier,
    )
    workload = Workload.of(
        placement,
        mode=args.mode,
        frames=args.frames,
        height=height,
        width=width,
        batch=args.batch,
        guidance=not args.no_guidance,
        dtype_bytes=args.dtype_bytes,
        max_grad_norm=args.max_grad_norm,
        grad_accum=args.grad_accum,
        expert=args.expert,
        optimizer_state=args.optimizer_state or OptimizerSpec.state,
        optimizer_state_tier=args.optimizer_state_tier or OptimizerSpec.state_tier,
        loras=args.loras,
        lora_rank=args.lora_rank,
        fine_tunes=args.fine_tunes,
        **({"delta_ratio": args.delta_ratio} if args.delta_ratio is not None else {}),
        devices=args.devices,
    )
    result = plan(describe(model_source(args)), machine, workload)
    print_json(result) if args.json else print(format_plan(result))
    return 0


# ---------------------------------------------------------------------------------------------
# finetune


def register_finetune(sub) -> None:
    p = sub.add_parser(
        "finetune", help="full-parameter fine-tuning on a directory of captioned clips"
    )
    _add_finetune_data_args(p)
    _add_finetune_optimizer_args(p)
    _add_finetune_run_args(p)
    _add_finetune_placement_args(p)
    _add_finetune_validation_args(p)
    p.add_argument("--stats", help="write streaming stats of the run as JSON here")
    p.add_argument(
        "--trace", help="write a Chrome trace of the last step's block copies and computes"
    )
    p.add_argument(
        "--server", help="run the job on a MegaSlide server at this URL instead of locally"
    )
    p.add_argument("--api-key", help="API key for --server (default: $MEGASLIDE_API_KEY)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run_finetune)


def _add_finetune_data_args(p) -> None:
    """The model, the data set and how long the run trains, at which learning rates."""
    add_model_args(p)
    p.add_argument("--data", required=True, help="dataset directory with metadata.jsonl")
    p.add_argument("--output", help="run directory: metrics, checkpoints and the final model")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps")
    length.add_argument("--epochs", type=float, help="passes over the dataset (default: 1)")
    p.add_argument(
        "--lr", type=float, default=OptimizerSpec.lr, help=f"default: {OptimizerSpec.lr:g}"
    )
    p.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default=ScheduleSpec.lr_schedule,
        help="constant, or cosine decay to 0 at the last step (default: constant)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=ScheduleSpec.warmup_steps,
        help="linear learning-rate warm-up (default: 0)",
    )


def _add_finetune_optimizer_args(p) -> None:
    """Batches, the optimizer step and where its state lives."""
    p.add_argument("--batch-size", type=int, default=ClipSpec.batch_size)
    p.add_argument(
        "--grad-accum",
        type=int,
        default=OptimizerSpec.grad_accum,
        help="micro-batches per optimizer step",
    )
    p.add_argument("--weight-decay", type=float, default=OptimizerSpec.weight_decay)
    p.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm to this")
    _add_optimizer_state_arg(p)
    p.add_argument(
        "--optimizer-state-dir",
        metavar="DIR",
        help="with --optimizer-state-tier disk: where the state's files go, on a local disk "
        "(default: <output>/optimizer-state)",
    )


def _add_finetune_run_args(p) -> None:
    """Checkpoints, seeds, caption dropout, flow times, the clip cache, stopping and resuming."""
    p.add_argument(
        "--save-every",
        type=int,
        default=RunSpec.save_every,
        help=f"checkpoint every N steps (and at the end; default: {RunSpec.save_every})",
    )
    p.add_argument("--seed", type=int, default=RunSpec.seed)
    p.add_argument(
        "--caption-dropout",
        type=float,
        default=ClipSpec.caption_dropout,
        help="fraction of captions dropped, which classifier-free guidance needs "
        f"(default: {ClipSpec.caption_dropout})",
    )
    p.add_argument(
        "--time-sampling",
        choices=TIME_SAMPLING,
        default=ClipSpec.time_sampling,
        help=f"distribution of training flow times (default: {ClipSpec.time_sampling})",
    )
    p.add_argument(
        "--cache-mb",
        type=int,
        default=RuntimeSpec.cache_mb,
        help=f"decoded training clips kept in RAM, in MiB (default: {RuntimeSpec.cache_mb})",
    )
    p.add_argument(
        "--until",
        type=int,
        metavar="STEP",
        help="stop after this step of the schedule and checkpoint; --resume continues the run",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --output"
    )


def _add_finetune_placement_args(p) -> None:
    """The clips' shape, the attention trained with, the expert, and where the weights live."""
    p.add_argument(
        "--frames",
        type=int,
        help="training clip frames (default: the model's); in buckets, a clip's most",
    )
    p.add_argument(
        "--size",
        help="training clip WIDTHxHEIGHT (default: the model's): every clip resized and cropped "
        "to it, unless --buckets",
    )
    p.add_argument(
        "--buckets",
        action=argparse.BooleanOptionalAction,
        help="train clips as they come, each batch one aspect and length bucket (default: when "
        "the clips differ in size or length and no --size is given); --no-buckets: one size",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        metavar="TOKENS",
        help="in buckets, a clip's most tokens (default: those of one --frames x --size clip)",
    )
    p.add_argument(
        "--attention", choices=("dense", "dsa"), help="self-attention backend to train with"
    )
    p.add_argument(
        "--expert",
        choices=("high", "low", "both"),
        help="which expert of a two-expert model (Wan2.2-A14B) to train: high or low noise, or "
        "both in one run, each on its own noise levels (default: both)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--devices",
        metavar="DEV,DEV,...",
        help="data parallel over these devices, one process each: the batch split over them, one "
        "optimizer on one master in host RAM: cpu,cpu or cuda:0,cuda:1",
    )
    p.add_argument(
        "--offload",
        choices=("none", "stream"),
        help="stream block weights from host RAM (default: none; stream with --devices)",
    )


def _add_finetune_validation_args(p) -> None:
    """What every checkpoint is judged by: prompts sampled with its weights, a held-out loss."""
    p.add_argument(
        "--validation-prompt",
        action="append",
        default=[],
        metavar="PROMPT",
        help="sample this prompt with every checkpoint's weights (repeatable): an MP4 each, in "
        "<output>/validation/step-N/ (or listed with the server's checkpoints)",
    )
    p.add_argument("--validation-seed", type=int, default=0, help="their seed (default: 0)")
    p.add_argument("--validation-size", help="their WIDTHxHEIGHT (default: the model's)")
    p.add_argument("--validation-frames", type=int, help="their frames (default: the model's)")
    p.add_argument("--validation-steps", type=int, help="their steps (default: the model's)")
    p.add_argument("--validation-guidance", type=float, help="their guidance scale")
    p.add_argument(
        "--validation-split",
        type=float,
        default=ValidationSpec.split,
        metavar="N",
        help="clips held out of training for a validation loss at every checkpoint: a fraction "
        "below 1 or a number of clips (default: 0, none)",
    )


def validation_spec(args) -> ValidationSpec:
    """The validation flags as the spec's section."""
    from megaslide.engine.request import parse_size

    size = args.validation_size
    width, height = parse_size(size, "--validation-size") if size else (None, None)
    prompts = tuple(
        ValidationPrompt(
            prompt=text,
            seed=args.validation_seed,
            width=width,
            height=height,
            frames=args.validation_frames,
            steps=args.validation_steps,
            guidance=args.validation_guidance,
        )
        for text in args.validation_prompt
    )
    return ValidationSpec(prompts=prompts, split=args.validation_split)


def finetune_spec(args) -> FinetuneSpec:
    """`megaslide finetune`'s flags as a fine-tuning spec (the one place they map onto it)."""
    from megaslide.engine.request import parse_size

    width, height = parse_size(args.size, "--size") if args.size else (None, None)
    devices = None
    if args.devices:
        from megaslide.engine.parallel.ranks import parse_devices

        devices = tuple(parse_devices(args.devices))
    return FinetuneSpec(
        run=RunSpec(
            output=args.output,
            seed=args.seed,
            save_every=args.save_every,
            attention=args.attention,
            expert=args.expert,
        ),
        schedule=ScheduleSpec(
            steps=args.steps,
            epochs=args.epochs,
            lr_schedule=args.lr_schedule,
            warmup_steps=args.warmup_steps,
            until=args.until,
        ),
        optimizer=OptimizerSpec(
            lr=args.lr,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm,
            grad_accum=args.grad_accum,
            state=args.optimizer_state or OptimizerSpec.state,
            state_tier=args.optimizer_state_tier or OptimizerSpec.state_tier,
            state_dir=args.optimizer_state_dir,
        ),
        clips=ClipSpec(
            frames=args.frames,
            height=height,
            width=width,
            batch_size=args.batch_size,
            buckets=args.buckets,
            token_budget=args.token_budget,
            caption_dropout=args.caption_dropout,
            time_sampling=args.time_sampling,
        ),
        runtime=RuntimeSpec(
            Placement(
                device=None if devices else args.device,
                devices=devices,
                offload=args.offload or ("stream" if devices else "none"),
                timing=bool(args.stats or args.trace),
            ),
            cache_mb=args.cache_mb,
        ),
        validation=validation_spec(args),
    )


def run_finetune(args) -> int:
    if args.server:
        from .remote import finetune_remote

        return finetune_remote(args)
    from megaslide.engine.training.finetune import open_trainer

    if not args.output:
        raise UsageError("--output is required for a local run")
    if args.devices:
        return run_finetune_on_devices(args)
    spec = finetune_spec(args)
    with open_trainer(model_source(args), args.data, spec, resume=args.resume) as trainer:
        if trainer.plan is not None:
            print("\n".join(trainer.plan.lines()), file=sys.stderr)
        if trainer.done:
            print(f"already at step {trainer.step} of {trainer.total_steps}", file=sys.stderr)
        with progress_bar(trainer.total_steps, "fine-tuning", disable=args.no_progress) as bar:
            bar.update(trainer.step)

            def report(m):
                bar.update(1)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{m['loss']:.4f}", step_s=f"{m['step_time_s']:.2f}")

            last = trainer.run(report)
        if last is not None and trainer.step % args.save_every:
            # The end of the run is always a checkpoint, judged like the others.
            trainer.validate(trainer.save_checkpoint(), trainer.validation_loss())
        _write_stream_stats(trainer.blockwise.stream_handles, args.stats, args.trace)
        path = trainer.export()
        if trainer.step < trainer.total_steps:
            print(
                f"stopped at step {trainer.step} of {trainer.total_steps}; --resume continues",
                file=sys.stderr,
            )
    print(f"fine-tuned model written to {path}", file=sys.stderr)
    return 0


def _write_stream_stats(handles: dict, stats: str | None, trace: str | None) -> None:
    """`--stats` and `--trace` of a run's streamed blocks: the stats of each expert trained by
    its label ("high": {...}) and a trace each beside `--trace` (`trace-high.json`), or the one
    model's as they are."""
    if stats and handles:
        one = "" in handles
        out = handles[""].stats() if one else {k: h.stats() for k, h in handles.items()}
        Path(stats).write_text(json.dumps(out, indent=2) + "\n")
    if trace:
        path = Path(trace)
        for label, handle in handles.items():
            handle.write_trace(
                path.with_name(f"{path.stem}-{label}{path.suffix}") if label else path
            )


def run_finetune_on_devices(args) -> int:
    """`finetune --devices`: data parallel, one process per device (engine/parallel/data_parallel.py)."""
    from megaslide.engine.parallel.data_parallel import RankFailed, finetune_on_devices

    if args.stats or args.trace:
        raise UsageError("--devices takes neither --stats nor --trace")
    if args.device != "cpu":
        raise UsageError("--devices names the devices itself: leave out --device")
    try:
        spec = finetune_spec(args)
    except ValueError as e:
        raise UsageError(f"--devices: {e}") from None
    bar = None
    with contextlib.ExitStack() as stack:

        def plan(lines):
            print("\n".join(lines), file=sys.stderr)

        def start(step, total):
            nonlocal bar
            if step >= total:
                print(f"already at step {step} of {total}", file=sys.stderr)
            bar = stack.enter_context(progress_bar(total, "fine-tuning", disable=args.no_progress))
            bar.update(step)

        def report(m):
            bar.update(1)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{m['loss']:.4f}", step_s=f"{m['step_time_s']:.2f}")

        try:
            result = finetune_on_devices(
                model_source(args),
                args.data,
                spec,
                resume=args.resume,
                on_plan=plan,
                on_start=start,
                progress=report,
            )
        except RankFailed as e:  # every rank was stopped; complete checkpoints are kept
            print(f"megaslide finetune: error: {e}", file=sys.stderr)
            return 1
    if result["step"] < result["total_steps"]:
        print(
            f"stopped at step {result['step']} of {result['total_steps']}; --resume continues",
            file=sys.stderr,
        )
    print(
        f"fine-tuned model written to {result['model']} ({len(spec.runtime.devices)} devices)",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------------------------------
# delta


def register_delta(sub) -> None:
    p = sub.add_parser(
        "delta",
        help="keep a fine-tuned model as a lossless delta over its base",
        description="Write MODEL's weights as an entropy-coded delta over BASE's, in "
        "MODEL/delta/<dtype>/: a server holding BASE then serves MODEL for the delta's bytes. "
        "Refused, naming why, when MODEL is not a fine-tune of BASE.",
    )
    p.add_argument("model", help="the fine-tuned model directory")
    p.add_argument("--base", required=True, help="the base model directory or packaged name")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="the dtype the model is served in: a delta codes that dtype's words (default: "
        "bfloat16)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_delta)


def run_delta(args) -> int:
    import torch

    from megaslide.engine.deltas import DeltaError, write_delta
    from megaslide.engine.loader import held_nbytes
    from megaslide.engine.sources import describe, resolve_source

    tuned = describe(resolve_source(args.model))
    if tuned.source.kind != "directory":
        raise UsageError(f"{args.model}: a delta is written into a model directory")
    base = describe(resolve_source(args.base))
    start = time.perf_counter()
    try:
        path, delta = write_delta(tuned, base, getattr(torch, args.dtype))
    except DeltaError as exc:
        raise UsageError(str(exc)) from exc
    held = held_nbytes(tuned, getattr(torch, args.dtype))
    full = sum(held.values())
    changed = sum(held[c] for c in delta.deltas)
    out = {
        "path": str(path),
        "base": base.name,
        "dtype": args.dtype,
        "delta_bytes": delta.nbytes,
        "model_bytes": full,
        "ratio": delta.nbytes / full,
        # Against the components the fine-tune changed (the denoiser, say) alone.
        "changed_components": sorted(delta.deltas),
        "ratio_changed_components": delta.nbytes / changed if changed else 0.0,
        "changed_tensors": sum(len(d) for d in delta.deltas.values()),
        "seconds": time.perf_counter() - start,
    }
    if args.json:
        print_json(out)
    else:
        print(
            f"wrote {path}: {delta.nbytes / 1e6:.1f} MB, {out['ratio']:.3f}x the "
            f"{full / 1e6:.1f} MB of {tuned.name}'s weights in {args.dtype}, over {base.name}"
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the local commands: generate, info, plan, finetune and delta."""
    register_generate(sub)
    register_info(sub)
    register_plan(sub)
    register_finetune(sub)
    register_delta(sub)
