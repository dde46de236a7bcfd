"""MegaSlide's HTTP server: the OpenAI-shaped video and fine-tuning API over a durable job queue.

`build_app(settings, engine)` makes the FastAPI app; `megaslide serve` runs it under uvicorn.
Layout: `routers/` (one per resource) -> `store.py` (SQLite, WAL) -> `worker.py` (scheduler thread)
-> `runners.py` (the engine's pipeline and trainer). Routers reach the engine only through
`client.EngineClient`, so this package imports torch only when a real engine starts.
"""

from .app import build_app
from .settings import Settings

__all__ = ["Settings", "build_app"]
