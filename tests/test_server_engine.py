"""The server's torch backend in process: streamed serving equals resident, real OOM is isolated."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("fastapi")

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from megaslide.engine.loader import open_pipeline
from megaslide.engine.native.family import DiTPipeline
from megaslide.engine.request import VideoRequest
from megaslide.engine.sources import resolve_source
from megaslide.engine.video import read_video
from megaslide.server import Settings

from api_helpers import wait_status
from server_fakes import torch_app

CLIP = {"num_frames": 4, "size": "32x32", "num_inference_steps": 2}


def serve(tmp_path, frames: dict | None = None, **overrides):
    settings = Settings(
        data_dir=tmp_path / "data", preset="tiny", device="cpu", poll_after_ms=50, **overrides
    )
    return TestClient(torch_app(settings, frames))


def test_streamed_serving_equals_resident_and_counts_h2d_bytes(tmp_path):
    sampled = {}  # video id -> frames as the worker sampled them (compared, not the MP4s)
    with serve(tmp_path, sampled, offload="stream") as c:
        v = c.post("/v1/videos", json={"prompt": "streamed", "seed": 3, **CLIP}).json()
        assert wait_status(c, v["id"], timeout=120)["status"] == "completed"
        (tmp_path / "served.mp4").write_bytes(c.get(f"/v1/videos/{v['id']}/content").content)
        metrics = c.get("/metrics").text
    h2d = float(
        next(
            line.split()[1]
            for line in metrics.splitlines()
            if line.startswith("megaslide_h2d_bytes_total")
        )
    )
    pipe = open_pipeline(resolve_source(preset="tiny"))
    block_bytes = sum(p.numel() * p.element_size() for p in pipe.dit.blocks.parameters())
    # Two steps, each moving every block once (no budget: nothing stays resident).
    assert h2d >= 2 * block_bytes, (h2d, block_bytes)
    local = pipe.generate(
        VideoRequest(prompt="streamed", frames=4, height=32, width=32, steps=2, seed=3)
    )
    assert np.array_equal(sampled[v["id"]], local)
    assert read_video(tmp_path / "served.mp4").shape == local.shape


def test_cuda_out_of_memory_fails_only_its_job(tmp_path, monkeypatch):
    real_step = DiTPipeline._step

    def step(self, states):
        # A 64x64 clip stands for a request too big for the device.
        if any(s.latents.shape[-1] == 64 for s in states):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB")
        return real_step(self, states)

    monkeypatch.setattr(DiTPipeline, "_step", step)
    with serve(tmp_path) as c:
        big = c.post("/v1/videos", json={"prompt": "big", **CLIP, "size": "64x64"}).json()
        small = c.post("/v1/videos", json={"prompt": "small", **CLIP}).json()
        failed = wait_status(c, big["id"], timeout=120)
        assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory"
        assert "CUDA out of memory" in failed["error"]["message"]
        assert wait_status(c, small["id"], timeout=120)["status"] == "completed"
        assert c.get("/healthz").status_code == 200


def test_engine_threads_caps_the_engines_cpu_threads(tmp_path):
    from megaslide.server.torch_backend import TorchBackend

    asked = torch.get_num_threads() + 1  # not what conftest set, which it sets again after
    TorchBackend(Settings(data_dir=tmp_path, preset="tiny", device="cpu", engine_threads=asked))
    assert torch.get_num_threads() == asked
