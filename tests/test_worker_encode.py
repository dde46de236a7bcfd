"""The worker encodes each finished clip's MP4 chunk by chunk while the model decodes the next
(server/worker/videos.py `_finish`): the frames are the whole-clip path's and the CLI's, bitwise;
a clip cancelled mid-decode, or whose encoder fails, leaves no file behind, whole or partial;
clips that finish together decode together and each is published alone."""

from __future__ import annotations

import errno
import threading
import warnings

import numpy as np
import pytest

from megaslide.server import Settings

from api_helpers import create, wait_status
from server_fakes import FakeBackend, fake_clip, keep_frames, until
from wan_fixtures import build_tiny_wan

pytest.importorskip("av")
pytest.importorskip("diffusers")
with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

PROMPT = "a red circle moving left"
CLIP = {"num_frames": 9, "size": "32x32", "num_inference_steps": 2, "guidance_scale": 4.0}


def files_of(data_dir, video_id: str) -> list[str]:
    """Every file under the data directory named after `video_id`: its MP4 and thumbnail, and
    any temporary file an encoder left (`.{name}.*.tmp`)."""
    return sorted(p.name for p in data_dir.rglob(f"*{video_id}*") if p.is_file())


def cancel(client, video_id: str) -> None:
    """Ask for a running video's cancellation as `POST /cancel` does, without its wait for the
    worker (held in the decode here until the test lets it go)."""
    assert client.app.state.store.sync.videos.cancel(video_id) == "in_progress"


# ---------------------------------------------------------------------- the worker, fake models


@pytest.fixture
def poll_each_chunk(monkeypatch):
    """The worker asks the store about cancellations after every chunk it decodes."""
    monkeypatch.setattr("megaslide.server.worker.videos.CANCEL_POLL_S", 0.0)


def test_clips_decoded_together_are_published_apart_and_one_cancelled_leaves_nothing(
    make_client, tmp_path, poll_each_chunk
):
    """Two clips finishing at one step decode in one call, their frames interleaved; one is
    cancelled after its first frame: it ends cancelled with no file, the other completes with
    its whole clip. A clip decoding alone stops decoding once it is cancelled."""
    backend = FakeBackend()
    c = make_client(backend)
    backend.decode_gate.clear()
    backend.gate.clear()  # hold the worker on another shape while two jobs of one shape queue
    first = create(c, seed=0)
    until(lambda: c.get(f"/v1/videos/{first['id']}").json()["status"] == "in_progress")
    dropped = create(c, prompt="holddecode", seed=11, num_frames=8)
    kept = create(c, seed=12, num_frames=8)
    backend.gate.set()
    assert wait_status(c, first["id"])["status"] == "completed"
    until(lambda: [11, 12] in backend.decoded, what="the two clips decoding")
    cancel(c, dropped["id"])
    backend.decode_gate.set()
    assert wait_status(c, dropped["id"])["status"] == "cancelled"
    assert wait_status(c, kept["id"])["status"] == "completed"
    assert backend.decoded == [[0], [11, 12]]  # together, once: no retry
    data = tmp_path / "data"
    assert files_of(data, dropped["id"]) == []
    assert files_of(data, kept["id"]) == [f"{kept['id']}.mp4", f"{kept['id']}.png"]
    content = c.get(f"/v1/videos/{kept['id']}/content").content
    assert content == b"FAKEMP4" + fake_clip(12, 8, 32, 32).tobytes()  # every frame, in order

    drawn = backend.chunks_drawn
    backend.decode_gate.clear()
    alone = create(c, prompt="holddecode", seed=13, num_frames=8)
    until(lambda: [13] in backend.decoded, what="the clip decoding")
    cancel(c, alone["id"])
    backend.decode_gate.set()
    assert wait_status(c, alone["id"])["status"] == "cancelled"
    assert backend.chunks_drawn - drawn == 1  # its decode stopped at the first poll
    assert files_of(data, alone["id"]) == []


class StreamFullDisk(FakeBackend):
    """A backend whose writers encode as the chunks come, and whose disk is full (the writer's
    `add` fails, as an encoder thread that could not write does) while `full` is set."""

    def __init__(self):
        super().__init__()
        self.full, self.refused = threading.Event(), 0

    def open_video(self, fps, mp4_path, thumbnail_path):
        backend, writer = self, super().open_video(fps, mp4_path, thumbnail_path)
        add, taken = writer.add, []

        def add_or_refuse(chunk):  # the first chunk fits: the disk fills mid-stream
            if backend.full.is_set() and taken:
                backend.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device", str(mp4_path))
            taken.append(len(chunk))
            add(chunk)

        writer.add = add_or_refuse
        return writer


def test_a_disk_that_fills_mid_stream_has_the_clip_written_whole_once_there_is_room(
    make_client, monkeypatch
):
    """The streamed encoder fails for want of space while the clip decodes: the video waits
    (its chunks kept), and once there is room its every frame is written, in order."""
    monkeypatch.setattr("megaslide.server.worker.context.STORE_RETRY_S", (0.05, 0.2))
    backend = StreamFullDisk()
    c = make_client(backend)
    backend.full.set()
    v = create(c, seed=21, num_frames=6)
    until(lambda: backend.refused >= 3, what="writes refused for want of space")
    assert c.get(f"/v1/videos/{v['id']}").json()["status"] == "in_progress"
    backend.full.clear()
    assert wait_status(c, v["id"])["status"] == "completed"
    content = c.get(f"/v1/videos/{v['id']}/content").content
    assert content == b"FAKEMP4" + fake_clip(21, 6, 32, 32).tobytes()


# ---------------------------------------------------------------------- the torch backend, tiny Wan


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-encode")
    model = build_tiny_wan(root / "t2v")
    settings = Settings(
        data_dir=root / "data", models=[f"wan={model}"], device="cpu", poll_after_ms=50
    )
    from megaslide.server import build_app
    from megaslide.server.torch_backend import TorchBackend
    from megaslide.server.worker import Fleet

    backend = TorchBackend(settings)
    frames: dict = {}  # video id -> the frames handed to its encoder, concatenated
    keep_frames(backend, frames)
    chunks: dict = {}  # video id -> the frame count of each chunk handed to its encoder
    open_video = backend.open_video

    def counting(fps, mp4_path, thumbnail_path):
        writer = open_video(fps, mp4_path, thumbnail_path)
        add, sizes = writer.add, chunks.setdefault(mp4_path.stem, [])
        writer.add = lambda chunk: sizes.append(len(chunk)) or add(chunk)
        return writer

    backend.open_video = counting
    app = build_app(settings, Fleet.embedded(settings, backend))
    with TestClient(app) as client:
        until(lambda: client.get("/readyz").status_code == 200, timeout=60, what="readyz")
        yield dict(client=client, model=model, data=root / "data", frames=frames, chunks=chunks)


def test_served_frames_are_the_pipelines_and_the_clis(wan, tmp_path):
    """Decoded a latent frame at a time (1 frame, then 4) and encoded meanwhile, the served
    clip's frames are `Pipeline.generate`'s (the whole-clip decode) bitwise, and its MP4 decodes
    to the frames of the CLI's MP4 for the same seed. A repeat of the request is answered from
    that MP4."""
    from megaslide.cli.main import main
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.request import VideoRequest
    from megaslide.engine.video import read_video

    c = wan["client"]
    v = c.post("/v1/videos", json={"prompt": PROMPT, "seed": 5, **CLIP}).json()
    assert wait_status(c, v["id"], timeout=60)["status"] == "completed"
    assert wan["chunks"][v["id"]] == [1, 4, 4]
    request = VideoRequest(
        prompt=PROMPT, frames=9, height=32, width=32, steps=2, guidance=4.0, seed=5
    )
    whole = open_pipeline(wan["model"]).generate(request)
    assert np.array_equal(wan["frames"][v["id"]], whole)
    served = tmp_path / "served.mp4"
    served.write_bytes(c.get(f"/v1/videos/{v['id']}/content").content)
    cli = tmp_path / "cli.mp4"
    args = ["--size", "32x32", "--frames", "9", "--steps", "2", "--guidance", "4.0"]
    assert main(["generate", PROMPT, "--model", str(wan["model"]), *args, "--seed", "5",
                 "--no-progress", "-o", str(cli)]) == 0  # fmt: skip
    assert np.array_equal(read_video(served), read_video(cli))
    again = c.post("/v1/videos", json={"prompt": PROMPT, "seed": 5, **CLIP}).json()
    assert wait_status(c, again["id"])["cached_from"] == v["id"]
    assert c.get(f"/v1/videos/{again['id']}/content").content == served.read_bytes()


def test_an_encoder_that_fails_midway_fails_the_video_and_leaves_no_file(wan, monkeypatch):
    """The MP4 encoder raises after the clip's first frame (an I/O error, not a full disk):
    the video fails with that error, and neither its MP4, nor its thumbnail, nor a temporary
    file is left."""
    import megaslide.engine.video as video

    encode = video._encode

    def failing(tmp, chunks, *args):
        def first_then_fail():
            yield next(chunks)
            raise OSError(errno.EIO, "Input/output error", str(tmp))

        encode(tmp, first_then_fail(), *args)

    monkeypatch.setattr(video, "_encode", failing)
    c = wan["client"]
    v = c.post("/v1/videos", json={"prompt": PROMPT, "seed": 6, **CLIP}).json()
    done = wait_status(c, v["id"], timeout=60)
    assert done["status"] == "failed" and "Input/output error" in done["error"]["message"]
    assert files_of(wan["data"], v["id"]) == []


def test_a_clip_cancelled_mid_decode_stops_decoding_and_leaves_no_file(
    wan, monkeypatch, poll_each_chunk
):
    """Cancelled after two of its three latent frames have decoded (and gone to the encoder):
    the decode stops there, the video ends cancelled, and no file of it is left."""
    from megaslide.engine.wan.encoders import WanEncoders

    frames, reached, go, drawn = WanEncoders.frames, threading.Event(), threading.Event(), []

    def held(self, latents):
        for k, chunk in enumerate(frames(self, latents)):
            if k == 1:
                reached.set()
                go.wait(30)
            drawn.append(k)
            yield chunk

    monkeypatch.setattr(WanEncoders, "frames", held)
    c = wan["client"]
    v = c.post("/v1/videos", json={"prompt": PROMPT, "seed": 7, **CLIP}).json()
    assert reached.wait(60), "the decode did not reach its second latent frame"
    cancel(c, v["id"])
    go.set()
    assert wait_status(c, v["id"], timeout=60)["status"] == "cancelled"
    assert drawn == [0, 1]  # the third latent frame was never decoded
    assert wan["chunks"][v["id"]] == [1, 4]  # both reached the encoder before it was aborted
    assert files_of(wan["data"], v["id"]) == []
