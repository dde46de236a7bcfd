"""`megaslide serve` (the HTTP API, with a worker in its process unless `--no-worker`) and
`megaslide worker` (a worker alone, one per device, on any host that reaches the job store).

Both need the server extras (fastapi, uvicorn, SQLAlchemy, ...).
"""

from __future__ import annotations

import functools
import signal
import sys

from megaslide.engine.placement import DISK_IO

from .args import UsageError, in_flag_words, parse_bytes

SETTINGS_HELP = (
    "Settings also come from MEGASLIDE_* variables (MEGASLIDE_API_KEYS=key1,key2, "
    "MEGASLIDE_MODELS, MEGASLIDE_DATABASE, MEGASLIDE_STORAGE, MEGASLIDE_PORT, ...); flags win."
)


def register(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible video and fine-tuning API over HTTP",
        description=f"Serve models over HTTP. {SETTINGS_HELP}",
    )
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: 8000)")
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this Bearer key (repeatable; added to MEGASLIDE_API_KEYS)",
    )
    serve.add_argument(
        "--api-keys-file",
        metavar="PATH",
        help="named keys, stored as SHA-256 digests (see `megaslide keys`): each name a tenant",
    )
    serve.add_argument(
        "--max-queue", type=int, help="queued jobs before new ones get 429 (default: 64)"
    )
    serve.add_argument(
        "--no-worker",
        dest="worker",
        action="store_false",
        default=None,
        help="serve the API only: jobs run on `megaslide worker` processes of the same database",
    )
    serve.add_argument(
        "--worker-process",
        action="store_true",
        help="run the worker in a child process instead of a thread of the API's, so the engine "
        "and the API share no interpreter lock (restarted if it dies)",
    )
    _store_args(serve)
    _worker_args(serve)
    serve.set_defaults(run=run_serve)

    worker = sub.add_parser(
        "worker",
        help="run jobs from a job store on one device, or several (many hosts, one PostgreSQL)",
        description="Run the jobs of a job store on this host's device: load the models, claim "
        "queued jobs for them, run them, repeat. One per device, or one per group of devices "
        f"each video is split over (--devices). {SETTINGS_HELP}",
    )
    _store_args(worker)
    _worker_args(worker)
    worker.set_defaults(run=run_worker)

    keys = sub.add_parser(
        "keys",
        help="make an API key for a keys file (MEGASLIDE_API_KEYS_FILE)",
        description="Print a new random API key for NAME, and the line that grants it in a keys "
        "file (which stores only the key's SHA-256). Add the line, give the key to its user; "
        "a second line for the same NAME rotates keys without orphaning what NAME made.",
    )
    keys.add_argument("name", metavar="NAME", help="the principal the key stands for")
    keys.add_argument("--admin", action="store_true", help="a key that sees every principal's")
    keys.set_defaults(run=run_keys)


def _store_args(p) -> None:
    p.add_argument(
        "--data-dir", help="where the job database and outputs live (default: ./megaslide-data)"
    )
    p.add_argument(
        "--database",
        metavar="URL",
        help="the job store: sqlite:///PATH (default: in --data-dir) or postgresql://USER@HOST/DB",
    )
    p.add_argument(
        "--storage",
        metavar="DIR",
        help="where videos, uploads and fine-tunes live (default: --data-dir); with several "
        "hosts, a directory all of them mount",
    )


def _worker_args(p) -> None:
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="DIR|NAME|NAME=DIR",
        help="model directory or packaged model name to serve (repeatable)",
    )
    p.add_argument(
        "--preset", help="serve random weights of a named preset (for tests and benchmarks)"
    )
    p.add_argument(
        "--transformer",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="serve model NAME's transformer from a single-file checkpoint (original Wan, ComfyUI "
        "or diffusers keys) over its --model directory; twice for Wan2.2-A14B (high, then low)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="[MODEL:]NAME=FILE",
        help="register a LoRA adapter on every served model, or on MODEL (repeatable); a video "
        "request applies it by name in `loras`",
    )
    p.add_argument(
        "--max-batch", type=int, help="video jobs sharing one denoising pass (default: 8)"
    )
    p.add_argument("--device", help="auto (default: cuda when available), cpu, cuda or cuda:N")
    p.add_argument(
        "--devices",
        metavar="DEV,DEV,...",
        help="split each video's tokens over these devices (cuda:0,cuda:1 or cpu,cpu): one "
        "process per device, started once and kept with the model loaded, streaming from one "
        "host copy (--weights, --host-tier and --gpu-budget apply to each); implies --offload "
        "stream; fine-tunes run on the first",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        help="CPU threads for the engine's tensor maths (default: torch's, one per core)",
    )
    p.add_argument(
        "--offload",
        choices=("none", "stream"),
        help="stream DiT blocks from host RAM each step (models larger than the device)",
    )
    p.add_argument(
        "--gpu-budget",
        type=parse_bytes,
        help="with --offload stream: device bytes for weights, e.g. 20GB (each device's, with "
        "--devices)",
    )
    p.add_argument(
        "--weights",
        choices=("raw", "lossless", "fp8"),
        help="with --offload stream: host format of the streamed blocks (lossless: bitwise the "
        "same video, about 0.68x the bytes; fp8: about half, lossy; default: raw)",
    )
    p.add_argument(
        "--host-tier",
        choices=("ram", "disk", "auto"),
        help="with --offload stream: keep streamed blocks in host RAM, or read them from the "
        "model's safetensors files each step (host RAM smaller than the model); auto picks disk "
        "when they would not fit in the available RAM (default: auto)",
    )
    p.add_argument(
        "--disk-io",
        choices=DISK_IO,
        help="with --host-tier disk: read blocks through the page cache (buffered) or around it "
        "(direct, O_DIRECT where the filesystem takes it) (default: buffered)",
    )
    p.add_argument(
        "--name",
        dest="worker_name",
        help="this worker's name in the registry, one per device slot (default: HOST/DEVICE); "
        "a restart under the same name takes back the jobs the last run held",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def _server_modules():
    try:
        import uvicorn  # noqa: F401 - checked here, used by serve

        from megaslide.server import Settings
    except ImportError as e:
        raise UsageError(
            f"{e.name} is missing: pip install 'megaslide[server]' for serve and worker"
        ) from None
    return Settings


def _settings(args):
    """The Settings the flags ask for, on top of the environment; UsageError naming a bad one."""
    from pydantic import ValidationError

    Settings = _server_modules()
    names = (
        "host",
        "port",
        "api_keys_file",
        "preset",
        "data_dir",
        "database",
        "storage",
        "worker",
        "worker_name",
        "max_queue",
        "max_batch",
        "device",
        "devices",
        "offload",
        "gpu_budget",
        "weights",
        "host_tier",
        "disk_io",
        "engine_threads",
    )
    overrides = {k: getattr(args, k, None) for k in names}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    for flag in ("max_queue", "max_batch", "engine_threads"):
        if overrides.get(flag, 1) < 1:
            raise UsageError(
                f"--{flag.replace('_', '-')} must be at least 1, got {overrides[flag]}"
            )
    if overrides.get("port", 0) < 0:
        raise UsageError(f"--port must be non-negative, got {overrides['port']}")
    if args.model:
        overrides["models"] = args.model
    if getattr(args, "lora", None):
        overrides["loras"] = args.lora
    if getattr(args, "transformer", None):
        overrides["transformers"] = args.transformer
    try:
        if getattr(args, "api_key", None):
            overrides["api_keys"] = [*Settings().api_keys, *args.api_key]
        settings = Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        if not where:  # a rule across fields: the placement's (engine/placement.py), in flags
            raise UsageError(
                in_flag_words(str(err.get("ctx", {}).get("error", err["msg"])))
            ) from None
        raise UsageError(f"{where}: {err['msg']}") from None
    return settings


def _backend(settings):
    # Built once, here: a bad --model/--preset or --device is named now, in one line, rather than
    # as a traceback from a start-up.
    from megaslide.server.torch_backend import TorchBackend

    return TorchBackend(settings)


def run_serve(args) -> int:
    import uvicorn

    from megaslide.server import build_app
    from megaslide.server.connections import uvicorn_options
    from megaslide.server.torch_backend import check_dataset
    from megaslide.server.worker import REFUSED_EXIT, Fleet, WorkerProcess, serve_jobs_in_child

    settings = _settings(args)
    if not settings.worker and (args.model or args.preset):
        raise UsageError("--model and --preset say what a worker serves; --no-worker runs none")
    if not settings.worker and args.worker_process:
        raise UsageError("--worker-process runs the worker that --no-worker leaves out")
    check = functools.partial(check_dataset, settings=settings)
    if args.worker_process:
        # Built here only to name a bad flag, and the models, before anything starts; the child
        # builds its own.
        names = ", ".join(card.name for card in _backend(settings).cards())
        main = functools.partial(serve_jobs_in_child, settings, args.log_level)
        workers = Fleet(settings, check, WorkerProcess(main, keep_down=(0, REFUSED_EXIT)))
        what = f"{names} (its worker in a child process)"
    elif settings.worker:
        backend = _backend(settings)
        workers = Fleet.embedded(settings, backend)
        what = ", ".join(card.name for card in backend.cards())
    else:
        workers = Fleet(settings, check)
        what = "the API for the workers of the job store"
    keyed = settings.api_keys or settings.api_keys_file
    auth = "API keys required" if keyed else "no authentication"
    print(
        f"megaslide serve: {what} on http://{settings.host}:{settings.port} "
        f"(store {settings.database_url_shown}, storage {settings.storage_dir}, {auth})",
        file=sys.stderr,
    )
    # uvicorn stops cleanly on SIGTERM, then raises the signal again under the handler it found
    # at start, which by default ends the process "killed by SIGTERM" (-15): a clean stop is
    # status 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(
        build_app(settings, workers),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        **uvicorn_options(settings),
    )
    return 0


def _exit_cleanly(_signum, _frame) -> None:
    sys.exit(0)


def run_worker(args) -> int:
    settings = _settings(args)  # first: it names missing server extras in one line
    from megaslide.server.store import WorkerNameInUse
    from megaslide.server.worker import serve_jobs

    try:
        return serve_jobs(settings, args.log_level)
    except WorkerNameInUse as e:
        raise UsageError(str(e)) from None


def run_keys(args) -> int:
    from megaslide.server.auth import NAME, digest, new_key

    if not NAME.fullmatch(args.name):
        raise UsageError(f"{args.name!r} is not a name (letters, digits, _.@-; up to 64)")
    key = new_key()
    role = "  admin" if args.admin else ""
    print(f"key (give it to {args.name}; it is not stored anywhere): {key}", file=sys.stderr)
    print(f"{args.name}  {digest(key)}{role}")
    return 0
