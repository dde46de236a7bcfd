"""The service routes: health, readiness and metrics, the models list; routers never import torch."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")


from api_helpers import SMALL, assert_error, create, scrape, wait_status
from server_fakes import FakeBackend, until


def test_health_readiness_and_metrics(make_client):
    backend = FakeBackend(load_s=0.5)
    c = make_client(backend, wait_ready=False)
    assert c.get("/healthz").status_code == 200
    assert_error(c.get("/readyz"), 503, fragment="loading")
    queued = create(c)  # accepted while loading; runs once ready
    until(lambda: c.get("/readyz").status_code == 200, what="ready")
    wait_status(c, queued["id"])
    response = c.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = scrape(response.text)
    assert samples["megaslide_queue_depth"] == 0
    assert samples['megaslide_jobs{kind="video",state="completed"}'] == 1
    assert samples["megaslide_denoise_step_seconds_count"] == 2
    assert samples["megaslide_denoise_steps_total"] == 2
    assert samples["megaslide_h2d_bytes_total"] == 2000
    assert samples['megaslide_denoise_step_seconds_bucket{le="+Inf"}'] == 2
    assert samples['megaslide_jobs_finished_total{kind="video",status="completed"}'] == 1
    # A scraper asking for OpenMetrics gets it.
    openmetrics = c.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def test_a_dead_engine_is_reported(make_client):
    c = make_client(FakeBackend(fail_load=True), wait_ready=False)
    until(lambda: c.get("/healthz").status_code == 503, what="healthz to report the dead worker")
    assert_error(c.get("/healthz"), 503, fragment="weights are corrupt")
    assert_error(c.post("/v1/videos", json={"prompt": "p", **SMALL}), 503, fragment="restart")


def test_models_list(make_client):
    c = make_client()
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake"]
    m = c.get("/v1/models/fake").json()
    assert (
        m["object"] == "model"
        and m["defaults"]["size"] == "32x32"
        and m["limits"]["max_frames"] == 32
    )
    assert_error(c.get("/v1/models/none"), 404, "model")


@pytest.mark.slow
def test_routers_never_import_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from megaslide.server import build_app, Settings\n"
        "from megaslide.server.worker import Fleet\n"
        "from server_fakes import FakeBackend\n"
        "import megaslide.server.routers.videos, megaslide.server.routers.files\n"
        "build_app(Settings(data_dir='unused'), Fleet.embedded(Settings(), FakeBackend()))\n"
        "assert 'megaslide.server.torch_backend' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent / "support"))  # server_fakes
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=60, env=env)
