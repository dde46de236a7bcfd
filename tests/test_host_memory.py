"""A model larger than the host is refused up front, with the planner's verdict, by every front
door (generate, serve, worker: `open_model` and the server's backend), before any weights are
allocated; a model that fits opens as before."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from megaslide.engine import planner
from megaslide.engine.loader import open_pipeline
from megaslide.engine.planner import GB, HostMemoryError, Machine, Workload, plan
from megaslide.engine.sources import describe, resolve_source

# Address space for the child: far below the 105b's weights, enough to import torch and plan, and
# below any test machine's MemAvailable, so that the cap is the bound the refusal names.
CAP = 4 * 2**30
GENERATE = "import sys; from megaslide.cli.main import main; sys.exit(main(sys.argv[1:]))"


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


@pytest.mark.slow
def test_generate_refuses_the_105b_preset_under_an_address_space_cap_before_allocating():
    """The real preset, in a child whose RLIMIT_AS would make any large allocation fail: the
    refusal is the planner's one line (exit 2), not the allocator's traceback."""
    argv = ["generate", "a ball", "--preset", "megaslide-105b", "--no-progress", "-o", "x.mp4"]
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, *argv],
        preexec_fn=_cap_address_space,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = done.stderr
    assert done.returncode == 2, err[-2000:]
    assert err.startswith("megaslide generate: error: megaslide-105b does not fit in host memory")
    assert "need 419.6 GB" in err and "(bounded by RLIMIT_AS)" in err, err
    assert "Traceback" not in err


@pytest.fixture
def host_of(monkeypatch):
    """Pretend the host has `n` bytes available (what a 24 GB machine reports, say)."""

    def set_available(n: float) -> None:
        monkeypatch.setattr(planner, "host_memory_available", lambda: (int(n), "MemAvailable"))

    return set_available


def test_the_verdict_names_need_available_and_the_options_that_fit(host_of):
    info = describe(resolve_source(preset="tiny"))
    need = {
        weights: plan(info, Machine(), Workload(dtype_bytes=4, weights=weights))["host"]["total"]
        for weights in ("raw", "fp8")
    }
    host_of((need["raw"] + need["fp8"]) / 2)  # fp8 fits, raw does not
    with pytest.raises(HostMemoryError) as e:
        open_pipeline(info, dtype="float32")
    message = str(e.value)
    assert f"need {need['raw'] / GB:.1f} GB" in message and "(bounded by MemAvailable)" in message
    assert "options that fit: --offload stream --weights fp8" in message
    open_pipeline(info, dtype="float32", offload="stream", weights="fp8")  # the option opens


def test_a_model_that_fits_opens_and_the_check_can_be_turned_off(host_of, monkeypatch):
    info = describe(resolve_source(preset="tiny"))
    host_of(24 * GB)
    open_pipeline(info)
    host_of(1)
    with pytest.raises(HostMemoryError):
        open_pipeline(info)
    monkeypatch.setenv(planner.HOST_MEMORY_CHECK_ENV, "off")
    open_pipeline(info)


@pytest.mark.parametrize("devices", [[], ["cpu", "cpu"]], ids=["one-device", "two-devices"])
def test_serve_and_worker_refuse_the_105b_preset_when_their_backend_is_built(
    tmp_path, host_of, devices
):
    """`megaslide serve` and `megaslide worker` (and a worker process) build their backend before
    anything starts: a 24 GB host refuses the preset there, in one line."""
    pytest.importorskip("fastapi")
    from megaslide.server import Settings
    from megaslide.server.torch_backend import TorchBackend

    host_of(24 * GB)
    settings = Settings(data_dir=tmp_path, preset="megaslide-105b", devices=devices)
    with pytest.raises(HostMemoryError, match="megaslide-105b does not fit in host memory"):
        TorchBackend(settings)
