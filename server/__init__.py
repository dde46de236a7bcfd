"""MegaSlide's HTTP server: the OpenAI-shaped video and fine-tuning API over a durable job queue.

`build_app(settings, workers)` makes the FastAPI app; `megaslide serve` runs it under uvicorn.
Data flows one way: `routers/` (one per resource) -> `store/` (SQLite or PostgreSQL) -> `worker/`
(the scheduler thread) -> `backend.py`'s interfaces, implemented on the engine by `torch_backend.py`.
Routers reach the workers only through `protocol.WorkerClient`, so this package imports torch only
when `megaslide serve` builds the torch backend.
"""

from .app import build_app
from .settings import Settings

__all__ = ["Settings", "build_app"]
