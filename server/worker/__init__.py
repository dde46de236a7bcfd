"""The workers: the threads that own a device's models, claim jobs from the store and run them.

`megaslide serve` runs one inside the API's process (`Fleet.embedded`); `megaslide worker` runs
one per device (or per group of devices each video is split over) on any host that reaches the
store (`serve_jobs`). The models sit behind the `Backend` a worker is given (backend.py) and the
engine's contracts (engine/interfaces.py), so this package, like the routers, never imports torch
(only `serve_jobs` builds the torch backend).

  loop.py       `Worker`: the scheduling loop at denoising-step boundaries
  context.py    what a worker's parts share; the rules for a failing store or a lost device
  models.py     the models served: cards, loaded weights, fine-tunes, uploaded LoRA adapters
  videos.py     the running batch of videos: claims, batched steps, decoding, MP4 writing
  finetunes.py  the fine-tune a worker drives between videos
  heartbeat.py  the registry: a worker's name, its heartbeat and the watchdog
  fleet.py      `Fleet`: the workers as an API host sees them, and the one it runs itself
  process.py    `serve_jobs`, a worker process's life; `WorkerProcess`, one as a child
"""

from .fleet import Fleet
from .heartbeat import default_name
from .loop import Worker
from .process import REFUSED_EXIT, WorkerProcess, serve_jobs, serve_jobs_in_child

__all__ = [
    "REFUSED_EXIT",
    "Fleet",
    "Worker",
    "WorkerProcess",
    "default_name",
    "serve_jobs",
    "serve_jobs_in_child",
]
