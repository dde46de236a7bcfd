"""Remote mode of the CLI: `generate` and `finetune` run on a MegaSlide server through the SDK.

`megaslide generate PROMPT -o OUT.mp4 --server URL` queues the video, shows its progress and
downloads the MP4; `megaslide finetune --data DIR --server URL` packs DIR into a .tar.gz, uploads
it, starts the job and follows its events until it ends. Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile
from pathlib import Path

from megaslide.engine.training.finetune_spec import OptimizerSpec, RunSpec

from .args import UsageError

# Options of local generation that mean nothing to a server, with their defaults: giving one
# together with --server is a mistake we name rather than silently ignore.
LOCAL_ONLY_GENERATE = {
    "device": "cpu",
    "attention": None,
    "offload": None,  # no default: a local run picks none, or stream with --devices
    "gpu_budget": None,
    "stats": None,
    "trace": None,
    "transformer": [],
}
# The same for `finetune`: the server decides the schedule, checkpoints and where the model lives.
LOCAL_ONLY_FINETUNE = {
    "output": None,
    "steps": None,
    "grad_accum": OptimizerSpec.grad_accum,
    "weight_decay": OptimizerSpec.weight_decay,
    "max_grad_norm": None,
    "save_every": RunSpec.save_every,
    "resume": False,
    **LOCAL_ONLY_GENERATE,
    "devices": None,
}
# `finetune --lr` defaults to the spec's rate; the server's rate at learning_rate_multiplier=1 is
# its own setting (MEGASLIDE_FINETUNE_LR, the same unless changed), so --lr travels as a ratio.
DEFAULT_LR = OptimizerSpec.lr


def _sdk():
    try:
        import megaslide_client
    except ImportError:
        raise UsageError(
            "--server needs the megaslide-client package: pip install ./clients/python"
        ) from None
    return megaslide_client


def _say(text: str) -> None:
    """A line on stderr that does not tear a tqdm bar in progress."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(text, file=sys.stderr)
    else:
        tqdm.write(text, file=sys.stderr)


def _api_failure(command: str, error, base_url: str) -> int:
    """Print a server or connection error in one line; 2 for a request the server judged invalid."""
    sdk = _sdk()
    if isinstance(error, sdk.APIConnectionError):
        print(
            f"megaslide {command}: error: cannot reach the server at {base_url}: {error.message}",
            file=sys.stderr,
        )
        return 1
    print(
        f"megaslide {command}: error: the server answered {error.status_code}: {error.message}",
        file=sys.stderr,
    )
    return 2 if error.status_code in (400, 404, 413, 422) else 1


def _check_local_only(args, options: dict) -> None:
    for name, default in options.items():
        if getattr(args, name, default) != default:
            raise UsageError(
                f"--{name.replace('_', '-')} is an option of a local run; it does not go with --server"
            )


def generate_remote(args, request) -> int:
    """Generate `request` (a `VideoRequest`) on the server at `args.server` and write the MP4 to
    `args.output`; the server resolves the request against its model.

    Reads from `args`: output, model / preset (the server's model name), server, api_key,
    no_reuse, no_progress. Ctrl-C cancels the job on the server, since nobody is left to fetch its result.
    """
    _check_local_only(args, LOCAL_ONLY_GENERATE)
    files = ("--image", request.image), ("--last-image", request.last_image)
    videos = ("--video", request.video), ("--control-video", request.control_video)
    references = [("--reference-image", path) for path in request.reference_images]
    animate = {
        name: getattr(request, name)
        for name in ("pose_video", "face_video", "background_video", "background_mask")
    }
    animated = [("--" + name.replace("_", "-"), path) for name, path in animate.items()]
    for flag, path in (*files, *videos, ("--mask", request.mask), *references, *animated):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flag}: {path} not found")
    sdk = _sdk()
    client = sdk.Client(base_url=args.server, api_key=args.api_key)
    with client:
        try:
            video = client.videos.create(
                prompt=request.prompt,
                model=args.model or args.preset,
                size=f"{request.width}x{request.height}" if request.width else None,
                num_frames=request.frames,
                fps=request.fps,
                num_inference_steps=request.steps,
                guidance_scale=request.guidance,
                negative_prompt=request.negative_prompt or None,
                seed=request.seed,
                cache=request.cache,
                loras=[
                    {"name": c.name, "scale": c.scale, "expert": c.expert} for c in request.loras
                ]
                or None,
                sampler=request.sampler,
                timesteps=request.timesteps,
                shift=request.shift,
                guidance_interval=request.guidance_interval,
                # Uploaded; the server checks the model takes them.
                input_reference=request.image,
                last_frame=request.last_image,
                input_video=request.video,
                strength=request.strength,
                reference_images=list(request.reference_images) or None,
                control_video=request.control_video,
                mask=request.mask,
                conditioning_scale=request.conditioning_scale,
                **animate,
                segment_frame_length=request.segment_frame_length,
                prev_segment_conditioning_frames=request.prev_segment_conditioning_frames,
                reuse=False if args.no_reuse else None,
            )
            done = f", the MP4 of {video.cached_from}" if video.cached_from else ""
            print(
                f"video {video.id} {video.status} on {client.base_url} (model {video.model}, "
                f"{video.size}, seed {video.seed}{done})",
                file=sys.stderr,
            )
            try:
                video = client.videos.poll(video.id, progress=not args.no_progress)
            except KeyboardInterrupt:
                _cancel_video(client, video.id)
                raise
            if video.status != "completed":
                reason = video.error.message if video.error else "no reason given"
                print(
                    f"megaslide generate: error: video {video.id} {video.status}: {reason}",
                    file=sys.stderr,
                )
                return 1
            client.videos.download_content(video.id, variant="video", path=args.output)
        except sdk.APIError as e:
            return _api_failure("generate", e, client.base_url)
    size = Path(args.output).stat().st_size
    cached = f", {video.passes} passes for {video.num_inference_steps} steps" if video.cache else ""
    print(
        f"wrote {args.output} ({size:,} bytes, {video.size}, model {video.model}, video {video.id}"
        f"{cached})",
        file=sys.stderr,
    )
    return 0


def _cancel_video(client, video_id: str) -> None:
    try:
        client.videos.cancel(video_id)
        print(f"\ncancelled video {video_id} on the server", file=sys.stderr)
    except Exception as e:  # the interrupt matters more than a failed cleanup
        print(f"\ncould not cancel video {video_id} on the server: {e}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# finetune


def pack_dataset(root: Path, dest: Path) -> int:
    """Write every regular file under `root` into the gzipped tar `dest`; return the file count.

    Members are named relative to `root` (no leading folder, no absolute paths, no `..`), in sorted
    order so the same folder always packs the same way. Links are followed: the server refuses
    link members, and a dataset often links to clips stored elsewhere.
    """
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise UsageError(f"--data: {root} holds no files")
    with tarfile.open(dest, "w:gz") as tar:
        for path in files:
            tar.add(path.resolve(), arcname=path.relative_to(root).as_posix(), recursive=False)
    return len(files)


def _hyperparameters(args) -> dict:
    """The job's hyperparameters from the command's flags; what is not given stays "auto"."""
    epochs = getattr(args, "epochs", None)
    if epochs is not None and (epochs != int(epochs) or epochs < 1):
        raise UsageError(
            f"--epochs with --server must be a whole number of at least 1, got {epochs:g}"
        )
    lr = getattr(args, "lr", None)
    hp = {
        "n_epochs": None if epochs is None else int(epochs),
        "batch_size": getattr(args, "batch_size", None),
        "learning_rate_multiplier": None if lr is None or lr == DEFAULT_LR else lr / DEFAULT_LR,
        "num_frames": getattr(args, "frames", None),
        "size": getattr(args, "size", None),
        "buckets": getattr(args, "buckets", None),
        "token_budget": getattr(args, "token_budget", None),
        "optimizer_state": getattr(args, "optimizer_state", None),
        "expert": getattr(args, "expert", None),
        "validation_split": getattr(args, "validation_split", None) or None,
    }
    return {k: v for k, v in hp.items() if v is not None}


def _validation(args) -> list[dict] | None:
    """The job's validation prompts from --validation-prompt and its companions (API names)."""
    texts = getattr(args, "validation_prompt", None) or []
    shared = {
        "seed": getattr(args, "validation_seed", None),
        "size": getattr(args, "validation_size", None),
        "num_frames": getattr(args, "validation_frames", None),
        "num_inference_steps": getattr(args, "validation_steps", None),
        "guidance_scale": getattr(args, "validation_guidance", None),
    }
    shared = {k: v for k, v in shared.items() if v is not None}
    return [{"prompt": text, **shared} for text in texts] or None


def _base_model(client, args) -> str:
    """The model named by --model/--preset, else the server's first base model."""
    name = getattr(args, "model", None) or getattr(args, "preset", None)
    if name:
        return name
    bases = [m.id for m in client.models.list() if not str(m.id).startswith("ft:")]
    if not bases:
        raise UsageError(f"the server at {client.base_url} serves no base model to fine-tune")
    return bases[0]


def _print_event(event) -> None:
    """One line per job event: the server's message, plus the learning rate of a metrics event."""
    data = event.data or {}
    lr = (
        f" (lr {data['lr']:.3g})"
        if event.type == "metrics" and isinstance(data.get("lr"), (int, float))
        else ""
    )
    _say(f"  {event.message}{lr}")


def finetune_remote(args) -> int:
    """Fine-tune on the server at `args.server` with the dataset folder `args.data`.

    Reads from `args`: data, server, api_key, and when present model / preset (the base model;
    default: the server's first), epochs (whole), batch_size, lr (sent as a multiple of 1e-4),
    frames, size, expert, seed, suffix, no_progress. Options of a local run (--output, --steps,
    --resume, ...) are refused by name. Prints the fine-tuned model's name on stdout when the
    job succeeds. Ctrl-C detaches: the job keeps running on the server.
    """
    _check_local_only(args, LOCAL_ONLY_FINETUNE)
    root = Path(args.data)
    if not root.is_dir():
        raise UsageError(f"--data: {root} is not a directory")
    hyperparameters = _hyperparameters(args)
    sdk = _sdk()
    client = sdk.Client(base_url=args.server, api_key=getattr(args, "api_key", None))
    fd, archive = tempfile.mkstemp(prefix=f"{root.resolve().name}-", suffix=".tar.gz")
    os.close(fd)
    with client:
        try:
            count = pack_dataset(root, Path(archive))
            model = _base_model(client, args)
            uploaded = client.files.create(file=archive, purpose="fine-tune")
            print(
                f"uploaded {root} ({count} files, {uploaded.bytes:,} bytes) as {uploaded.id}",
                file=sys.stderr,
            )
            checked = client.files.wait_for_processing(uploaded.id)
            if checked.status == "error":
                raise UsageError(f"the server refused the dataset: {checked.status_details}")
            job = client.fine_tuning.jobs.create(
                model=model,
                training_file=uploaded.id,
                hyperparameters=hyperparameters or None,
                seed=getattr(args, "seed", None),
                suffix=getattr(args, "suffix", None),
                validation=_validation(args),
            )
            print(f"fine-tuning job {job.id} on {model}: {job.status}", file=sys.stderr)
            try:
                job = client.fine_tuning.jobs.wait(
                    job.id, progress=not getattr(args, "no_progress", False), on_event=_print_event
                )
            except KeyboardInterrupt:
                print(
                    f"\ndetached from job {job.id}; it keeps running on the server", file=sys.stderr
                )
                raise
        except sdk.APIError as e:
            return _api_failure("finetune", e, client.base_url)
        finally:
            Path(archive).unlink(missing_ok=True)
    if job.status != "succeeded":
        reason = job.error.message if job.error else "no reason given"
        print(f"megaslide finetune: error: job {job.id} {job.status}: {reason}", file=sys.stderr)
        return 1
    print(job.fine_tuned_model)
    print(
        f"generate with it: megaslide generate PROMPT --server {args.server} --model {job.fine_tuned_model}",
        file=sys.stderr,
    )
    if job.validation:
        print(
            f"its validation videos: megaslide finetune-videos {job.id} --server {args.server}",
            file=sys.stderr,
        )
    return 0


def register(sub) -> None:
    """Add the commands that only talk to a server: finetune-videos."""
    p = sub.add_parser(
        "finetune-videos",
        help="download a fine-tuning job's validation videos, every checkpoint's",
    )
    p.add_argument("job", help="the fine-tuning job's id (ftjob-...)")
    p.add_argument("--server", required=True, help="the MegaSlide server's URL")
    p.add_argument("--api-key", help="API key (default: $MEGASLIDE_API_KEY)")
    p.add_argument(
        "-o", "--output", default=".", help="folder: step-N/<prompt index>.mp4 go under it"
    )
    p.set_defaults(run=fetch_validation_videos)


def fetch_validation_videos(args) -> int:
    """Download every checkpoint's validation videos of job `args.job` into `args.output`, as
    step-N/<index>.mp4; print each path on stdout, and each failed one's reason on stderr."""
    sdk = _sdk()
    out = Path(args.output)
    with sdk.Client(base_url=args.server, api_key=args.api_key) as client:
        try:
            checkpoints = list(client.fine_tuning.jobs.checkpoints(args.job, limit=100))
            for checkpoint in reversed(checkpoints):  # oldest first
                for video in checkpoint.validation or []:
                    step = checkpoint.step_number
                    if video.status != "succeeded":
                        _say(f"step {step}, prompt {video.index}: failed: {video.error}")
                        continue
                    folder = out / f"step-{step}"
                    folder.mkdir(parents=True, exist_ok=True)
                    path = client.fine_tuning.jobs.download_validation_video(
                        args.job, checkpoint.id, video.index, path=folder / f"{video.index}.mp4"
                    )
                    print(path)
        except sdk.APIError as e:
            return _api_failure("finetune-videos", e, client.base_url)
    return 0
