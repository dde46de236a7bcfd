"""A torch-free stand-in for the model side of the server, so API and scheduler tests run in milliseconds.

`FakeBackend` plugs into the real worker (`Fleet.embedded`: thread, scheduler, store): only the models
are fake. It records every batched step as the list of job seeds it advanced, so tests can see which
jobs shared a pass, in which order they ran, and that a cancelled job got no further steps; and
every call to prepare or decode as the seeds it took (`prepared`, `decoded`). Its decoder hands
the clips out a frame at a time, as a causal one does (`finish_batch_chunks`).

Prompts steer failures: "explode" raises in the denoising step, "nomem" raises an error with the type
name CUDA uses, "badprep" raises while preparing, "baddecode" while decoding, and "poison" raises
an error that leaves the (pretend) device unusable. "kill9" kills the process the step runs in
with SIGKILL: only for a worker in a child process (`serve_fake_jobs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from megaslide.engine.interfaces import TrainingRun, VideoModel
from megaslide.engine.native.config import SamplingDefaults
from megaslide.engine.request import ModelLimits, ResolvedVideo
from megaslide.server import Settings
from megaslide.server.backend import Backend, FinetuneJob
from megaslide.server.protocol import ModelCard


def _no_three_frames(frames, height, width):
    """The fake model's own shape rule beyond its limits, so tests can see it applied."""
    if frames == 3:
        raise ValueError("frames (3): this model's autoencoder needs another count")


FAKE_LIMITS = ModelLimits(
    max_frames=32,
    max_size=256,
    size_multiple=(4, 4),
    frames_multiple=1,
    max_prompt_tokens=62,
    check_shape=_no_three_frames,
)
FAKE_DEFAULTS = SamplingDefaults(frames=4, height=32, width=32, fps=8, steps=2, guidance=1.0)
FAKE_CARD = ModelCard(
    name="fake",
    kind="preset",
    created=1_700_000_000,
    source="fake",
    limits=FAKE_LIMITS,
    defaults=FAKE_DEFAULTS,
)


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError, raised by the 'nomem' prompt."""


class DeviceError(RuntimeError):
    """What a poisoned CUDA context raises, by the 'poison' prompt: fatal to the worker."""


class FakeState:
    def __init__(self, spec: ResolvedVideo):
        self.spec, self.step, self.num_steps = spec, 0, spec.steps

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    @property
    def passes(self) -> int:
        return self.step


class FakeModel(VideoModel):
    def __init__(self, backend: FakeBackend, name: str):
        self.backend, self.name = backend, name

    def prepare_batch(self, specs):
        with self.backend.lock:
            self.backend.prepared.append([s.seed for s in specs])
        if any("badprep" in s.prompt for s in specs):
            raise ValueError("cannot prepare this prompt")
        return [FakeState(s) for s in specs]

    def denoise_step(self, states):
        b = self.backend
        b.gate.wait(30)  # tests close the gate to hold the worker inside a step
        time.sleep(b.step_s)
        prompts = [s.spec.prompt for s in states]
        if any("nomem" in p for p in prompts):
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        if any("explode" in p for p in prompts):
            raise RuntimeError("the denoiser exploded")
        if any("poison" in p for p in prompts):
            raise DeviceError("CUDA error: an illegal memory access was encountered")
        if any("kill9" in p for p in prompts):
            os.kill(os.getpid(), signal.SIGKILL)  # a crash no handler sees: the process is gone
        with b.lock:
            b.passes.append((self.name, [s.spec.seed for s in states]))
            b.timeline.append(("video", [s.spec.seed for s in states]))
        for s in states:
            s.step += 1
        return {"h2d_bytes": 1000 * len(states)}

    def preview_batch(self, states):
        """A small frame of each clip, its colour its step; "badpreview" prompts raise."""
        if any("badpreview" in s.spec.prompt for s in states):
            raise ValueError("the preview decoder met a NaN")
        return [np.full((s.spec.height, s.spec.width, 3), 40 * s.step, np.uint8) for s in states]

    def finish_batch(self, states):
        specs = [state.spec for state in states]
        with self.backend.lock:
            self.backend.decoded.append([s.seed for s in specs])
        if any("baddecode" in s.prompt for s in specs):
            raise ValueError("the decoder met a NaN")
        return [fake_clip(s.seed, s.frames, s.height, s.width) for s in specs]

    def finish_batch_chunks(self, states):
        """`finish_batch` a frame at a time, the clips' frames in turn (a causal decoder's
        order); "baddecode" raises once every clip has had its first frame, and a "holddecode"
        clip's frames each wait for `decode_gate`."""
        b, specs = self.backend, [state.spec for state in states]
        with b.lock:
            b.decoded.append([s.seed for s in specs])
        b.decoding.set()
        clips = [fake_clip(s.seed, s.frames, s.height, s.width) for s in specs]
        for f in range(max(len(clip) for clip in clips)):
            if f == 1 and any("baddecode" in s.prompt for s in specs):
                raise ValueError("the decoder met a NaN")
            for i, clip in enumerate(clips):
                if f < len(clip):
                    if "holddecode" in specs[i].prompt:
                        b.decode_gate.wait(30)
                    with b.lock:
                        b.chunks_drawn += 1
                    yield i, clip[f : f + 1]

    def close(self):
        pass  # holds nothing beyond its memory


def fake_clip(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """The fake model's clip: bytes that depend on the seed, so content tests can tell videos
    apart."""
    shape = (frames, height, width, 3)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


class FakeTrainer(TrainingRun):
    """Counts steps, checkpoints every `save_every`, resumes from the newest checkpoint file.
    Each checkpoint "samples" the validation prompts into small files (a prompt with "fail" in
    it fails) and, with a validation split, has a held-out loss."""

    def __init__(self, backend: FakeBackend, job: FinetuneJob):
        self.backend, self.job, self.spec = backend, job, job.spec
        self.output = Path(job.spec.run.output)
        clips = len(
            [
                line
                for line in (job.data_dir / "metadata.jsonl").read_text().splitlines()
                if line.strip()
            ]
        )
        self.total_steps = job.spec.schedule.epochs * -(-clips // job.spec.clips.batch_size)
        self.step = 0
        self.output.mkdir(parents=True, exist_ok=True)
        if job.resume:
            saved = sorted(int(p.stem.split("-")[1]) for p in self.output.glob("step-*.ckpt"))
            self.step = saved[-1] if saved else 0
        self.closed = False
        self.fence = None

    def train_step(self):
        b = self.backend
        time.sleep(b.train_step_s)
        b.gate.wait(30)
        if b.hold_from is not None and self.step + 1 >= b.hold_from:
            b.held.set()  # the step before has been recorded whole: the worker waits here
            b.train_gate.wait(30)
        self.step += 1
        with self.backend.lock:
            self.backend.timeline.append(("train", self.step))
        metrics = {
            "step": self.step,
            "loss": 1.0 / self.step,
            "lr": self.spec.optimizer.lr,
            "grad_norm": 0.5,
            "step_time_s": self.backend.train_step_s,
            "h2d_bytes": 0,
            "d2h_bytes": 0,
        }
        if self.step % self.spec.run.save_every == 0:
            if self.spec.validation.split:
                metrics["validation_loss"] = 2.0 / self.step
            self.save_checkpoint()
            self._validate(metrics.get("validation_loss"))
        return metrics

    def _validate(self, loss):
        validation = self.spec.validation
        if not validation.prompts and loss is None:
            return
        folder = self.output / "validation" / f"step-{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        videos = []
        for i, p in enumerate(validation.prompts):
            video = {**dataclasses.asdict(p), "index": i}
            if "fail" in p.prompt:
                video.update(status="failed", error="sampling failed", file=None)
            else:
                (folder / f"{i}.mp4").write_bytes(b"FAKEMP4" + f"{self.step}:{i}".encode())
                video.update(status="succeeded", error=None, file=f"{i}.mp4")
            videos.append(video)
        record = {"step": self.step, "validation_loss": loss, "videos": videos}
        (folder / "videos.json").write_text(json.dumps(record))

    def clip_plan(self):
        if not self.spec.clips.buckets:
            return None
        return f"1 bucket(s) of at most {self.spec.clips.token_budget} tokens"

    def save_checkpoint(self):
        path = self.output / f"step-{self.step}.ckpt"
        with self.fence() if self.fence is not None else contextlib.nullcontext():
            path.write_text(json.dumps({"step": self.step}))
        return path

    def checkpoints(self):
        found = sorted(self.output.glob("step-*.ckpt"), key=lambda p: int(p.stem.split("-")[1]))
        checkpoints = []
        for p in found:
            step = int(p.stem.split("-")[1])
            checkpoint = {"step": step, "path": p, "created_at": 0}
            folder = self.output / "validation" / f"step-{step}"
            if (folder / "videos.json").is_file():
                record = json.loads((folder / "videos.json").read_text())
                for video in record["videos"]:
                    if video["file"]:
                        video["path"] = str(folder / video["file"])
                checkpoint.update(
                    validation=record["videos"], validation_loss=record["validation_loss"]
                )
            checkpoints.append(checkpoint)
        return checkpoints

    def export(self, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"fake": True, "step": self.step}))
        return path

    def close(self):
        self.closed = True


class FakeBackend(Backend):
    def __init__(
        self,
        step_s: float = 0.01,
        train_step_s: float = 0.01,
        load_s: float = 0.0,
        encode_s: float = 0.0,
        fail_load: bool = False,
    ):
        self.step_s, self.train_step_s, self.load_s, self.encode_s = (
            step_s,
            train_step_s,
            load_s,
            encode_s,
        )
        self.fail_load = fail_load
        self.gate = threading.Event()
        self.gate.set()
        # Fine-tune steps from `hold_from` on wait for `train_gate` (a test sets both).
        self.hold_from: int | None = None
        self.train_gate = threading.Event()
        self.held = threading.Event()  # set once a step waits for `train_gate`
        self.encode_gate = threading.Event()  # a test clears it to hold MP4s unwritten
        self.encode_gate.set()
        self.decode_gate = threading.Event()  # a test clears it to hold "holddecode" decodes
        self.decode_gate.set()
        self.decoding = threading.Event()  # set once a decode has begun
        self.chunks_drawn = 0  # frames the decoder has handed out
        self.lock = threading.Lock()
        self.passes: list[tuple[str, list[int]]] = []
        self.timeline: list[tuple] = []
        self.prepared: list[list[int]] = []  # the seeds of each call to prepare_batch
        self.decoded: list[list[int]] = []  # the seeds of each call to finish_batch
        self.released = 0

    # helpers for tests
    def seeds_run(self) -> list[int]:
        with self.lock:
            return [seed for _, seeds in self.passes for seed in seeds]

    def first_pass_of(self, seed: int) -> int:
        with self.lock:
            return next(i for i, (_, seeds) in enumerate(self.passes) if seed in seeds)

    # Backend
    def cards(self):
        return [FAKE_CARD]

    def fine_tuned_card(self, name, parent, path):
        return parent.replace(name=name, kind="fine-tune", parent=parent.name, source=str(path))

    def load(self, card):
        time.sleep(self.load_s)
        if self.fail_load:
            raise RuntimeError("weights are corrupt")
        return FakeModel(self, card.name)

    def check_dataset(self, root):
        meta = Path(root) / "metadata.jsonl"
        if not meta.is_file():
            raise ValueError(f"{meta.name}: missing")
        n = 0
        for i, line in enumerate(meta.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not (Path(root) / row["file"]).exists():
                raise ValueError(f"metadata.jsonl line {i} ({row['file']}): file not found")
            n += 1
        return n

    def trainer(self, job):
        return FakeTrainer(self, job)

    def save_video(self, frames, fps, mp4_path, thumbnail_path):
        from PIL import Image

        time.sleep(self.encode_s)
        self.encode_gate.wait(30)
        Image.fromarray(frames[0]).save(thumbnail_path, format="PNG")
        tmp = mp4_path.with_name(mp4_path.name + ".part")
        tmp.write_bytes(b"FAKEMP4" + frames.tobytes())
        tmp.replace(mp4_path)

    def error_code(self, exc):
        return "out_of_memory" if type(exc).__name__ == "OutOfMemoryError" else None

    def release_memory(self):
        self.released += 1

    def is_fatal(self, exc):
        return isinstance(exc, DeviceError)


def until(predicate, timeout=10.0, what="condition", interval=0.01):
    """Poll `predicate()` until it returns something true, and return that; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def torch_app(settings, frames: dict | None = None):
    """The app as `megaslide serve` builds it: the embedded worker on the torch backend. With
    `frames`, each video's frames as sampled (before the MP4 encoder) are kept there by video id:
    tests compare those, since an encoding says nothing more about the sampling."""
    from megaslide.server import build_app
    from megaslide.server.torch_backend import TorchBackend
    from megaslide.server.worker import Fleet

    backend = TorchBackend(settings)
    if frames is not None:
        keep_frames(backend, frames)
    return build_app(settings, Fleet.embedded(settings, backend))


def keep_frames(backend, frames: dict) -> None:
    """Have `backend` keep each video's frames as the worker hands them to its MP4 encoder, by
    video id in `frames`: whole (`save_video`), or chunk by chunk (`open_video`), concatenated
    there once the clip is published."""
    save_video, open_video = backend.save_video, backend.open_video

    def keep(sampled, fps, mp4_path, thumbnail_path):
        frames[mp4_path.stem] = np.array(sampled)
        save_video(sampled, fps, mp4_path, thumbnail_path)

    class Keeping:
        def __init__(self, fps, mp4_path, thumbnail_path):
            self.writer, self.chunks = open_video(fps, mp4_path, thumbnail_path), []
            self.video_id = mp4_path.stem

        def add(self, chunk):
            self.chunks.append(np.array(chunk))
            self.writer.add(chunk)

        def close(self):
            self.writer.close()
            frames[self.video_id] = np.concatenate(self.chunks)

        def abort(self):
            self.writer.abort()

    backend.save_video, backend.open_video = keep, Keeping


@contextlib.contextmanager
def live_server(app, settings=None):
    """Serve `app` with uvicorn on a free loopback port in a thread, with the HTTP guards of
    `settings` (connections.py) as `megaslide serve` runs it; yields its base URL."""
    import uvicorn

    from megaslide.server.connections import uvicorn_options

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    options = uvicorn_options(settings or Settings())
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while True:  # /readyz: 503 while the model loads, 200 once it can run jobs
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def serve_fake_jobs(settings: Settings, name: str, go: Path) -> None:
    """A worker process on fake models (a `WorkerProcess` main, as `serve_jobs` is one): it
    registers, publishing its cards, then waits for the file `go` before it runs jobs, so a test
    can queue several to be claimed together."""
    from megaslide.server.store import JobStore
    from megaslide.server.worker import Worker

    store = JobStore(settings.database_url, crash_limit=settings.crash_limit)
    worker = Worker(settings, FakeBackend(), store, name)
    worker.register()
    until(go.exists, timeout=60, what="the go file")
    worker.run()
