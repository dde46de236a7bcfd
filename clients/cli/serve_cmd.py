"""`megaslide serve`: the HTTP API under uvicorn (the server extras: fastapi, uvicorn, ...)."""

from __future__ import annotations

import sys

from .args import UsageError, parse_bytes


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible video and fine-tuning API over HTTP",
        description="Serve models over HTTP. Settings also come from MEGASLIDE_* variables "
        "(MEGASLIDE_API_KEYS=key1,key2, MEGASLIDE_MODELS, MEGASLIDE_PRESET, "
        "MEGASLIDE_DATA_DIR, MEGASLIDE_PORT, ...); flags win.",
    )
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: 8000)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="DIR|NAME",
        help="model directory or packaged model name to serve (repeatable)",
    )
    p.add_argument(
        "--preset", help="serve random weights of a named preset (for tests and benchmarks)"
    )
    p.add_argument(
        "--data-dir", help="where the job database and outputs live (default: ./megaslide-data)"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this Bearer key (repeatable; added to MEGASLIDE_API_KEYS)",
    )
    p.add_argument(
        "--max-queue", type=int, help="queued jobs before new ones get 429 (default: 64)"
    )
    p.add_argument(
        "--max-batch", type=int, help="video jobs sharing one denoising pass (default: 8)"
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: cuda when available")
    p.add_argument(
        "--offload",
        choices=("none", "stream"),
        help="stream DiT blocks from host RAM each step (models larger than the device)",
    )
    p.add_argument(
        "--gpu-budget",
        type=parse_bytes,
        help="with --offload stream: device bytes for weights, e.g. 20GB",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(run=run_serve)


def run_serve(args) -> int:
    try:
        import uvicorn
        from pydantic import ValidationError

        from megaslide.server import Settings, build_app
        from megaslide.server.torch_backend import TorchBackend
        from megaslide.server.worker import EmbeddedWorker
    except ImportError as e:
        raise UsageError(
            f"serve needs the server extras ({e.name} is missing): pip install 'megaslide[server]'"
        ) from None

    for flag, value in (
        ("--port", args.port),
        ("--max-queue", args.max_queue),
        ("--max-batch", args.max_batch),
    ):
        if value is not None and value < (0 if flag == "--port" else 1):
            raise UsageError(
                f"{flag} must be {'non-negative' if flag == '--port' else 'at least 1'}, got {value}"
            )
    overrides = {
        "host": args.host,
        "port": args.port,
        "preset": args.preset,
        "data_dir": args.data_dir,
        "max_queue": args.max_queue,
        "max_batch": args.max_batch,
        "device": args.device,
        "offload": args.offload,
        "gpu_budget": args.gpu_budget,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.model:
        overrides["models"] = args.model
    try:
        if args.api_key:
            overrides["api_keys"] = [*Settings().api_keys, *args.api_key]
        settings = Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        raise UsageError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    if settings.gpu_budget is not None and settings.offload != "stream":
        raise UsageError("--gpu-budget needs --offload stream")

    # Built once, here: a bad --model/--preset or --device is named now, in one line, rather than
    # as a traceback from the app's start-up.
    backend = TorchBackend(settings)
    names = [card.name for card in backend.cards()]
    auth = f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no authentication"
    print(
        f"megaslide serve: {', '.join(names)} on http://{settings.host}:{settings.port} "
        f"(data in {settings.data_dir}, {auth})",
        file=sys.stderr,
    )
    uvicorn.run(
        build_app(settings, EmbeddedWorker(settings, backend)),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
    )
    return 0
