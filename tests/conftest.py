import multiprocessing.process
import os
import subprocess
import sys
import sysconfig
import threading
import warnings
import weakref
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from megaslide.server import Settings, build_app
from megaslide.server.worker import Fleet

from server_fakes import FakeBackend, until

# The `slow` tier: tests that start child processes (servers, workers, ranks, benchmarks, Triton's
# interpreter, ruff), drive a browser or use PostgreSQL, and the few that train or sample for tens
# of seconds. `pytest -m "not slow"` is the developer's loop; CI runs every test. Tests that take these fixtures are marked here; the rest carry the marker.
SLOW_FIXTURES = {"postgres_server", "interpret_results"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if SLOW_FIXTURES & set(item.fixturenames) or params.get("database_url") == "postgresql":
            item.add_marker(pytest.mark.slow)


# Each child process this repository's code starts (a test, its helpers, the engine's ranks and
# worker processes) is noted, so that a test outside the slow tier that starts one fails and the
# tier stays exact as tests are added. Children that libraries start on their own are not the
# test's doing and come and go with caches: the platform probes of an SDK (once per session),
# Triton compiling its launcher on a GPU (once per machine).
ROOT = Path(__file__).resolve().parents[1]
STDLIB = sysconfig.get_paths()["stdlib"]
_started: list[str] = []
_ours: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # the test's thread and its offspring


def _caller_here() -> str | None:
    """Where in this repository the innermost caller outside the standard library (and this
    hook) is, as `file:line`, or None when it is not ours."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(STDLIB):
        frame = frame.f_back
    path = Path(frame.f_code.co_filename) if frame is not None else None
    if path is None or not path.is_relative_to(ROOT) or "site-packages" in path.parts:
        return None
    return f"{path.relative_to(ROOT)}:{frame.f_lineno}"


def _noted(name, start):
    def noting(*args, **kwargs):
        # A thread an earlier test left running (a fleet restarting its worker, say), or one such
        # a thread started, is not this test's doing: only the test's thread and its offspring count.
        if threading.current_thread() in _ours and (where := _caller_here()):
            _started.append(f"{name} ({where}, thread {threading.current_thread().name})")
        return start(*args, **kwargs)

    return noting


def _adopting(start):
    def adopting(thread):
        if threading.current_thread() in _ours:
            _ours.add(thread)
        return start(thread)

    return adopting


def pytest_configure(config):
    # CPUAdamW's compact formats build their fused kernel on first use, and CPU deltas and
    # DFloat their decoder (a compiler run, or nothing when it is cached): do it once here,
    # before any test, so that the tests find them built whatever their order and no test
    # starts the compiler.
    from megaslide.engine.training import compact_kernel
    from megaslide.kernels import lane_native

    compact_kernel.load()
    lane_native.load()
    threading.Thread.start = _adopting(threading.Thread.start)
    subprocess.Popen._execute_child = _noted("a subprocess", subprocess.Popen._execute_child)
    process = multiprocessing.process.BaseProcess
    process.start = _noted("a multiprocessing process", process.start)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started.clear()
    _ours.clear()
    _ours.add(threading.current_thread())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    # What the test's setup and call started; teardown stops things (the last test's teardown
    # also ends the session's fixtures: PostgreSQL's `pg_ctl stop`).
    started, _started[:] = sorted(set(_started)), []
    yield
    if started and item.get_closest_marker("slow") is None:
        pytest.fail(f"started {', '.join(started)}: mark the test @pytest.mark.slow")


# Two threads everywhere: CI has two cores, and a fixed count keeps CPU reductions in one order.
# Under pytest-xdist (the README's `pytest -n 2`) each of the two workers takes one, so together
# they use the two cores without oversubscribing them.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the session, started on first use."""
    from postgres import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A fresh, empty job-store database: a SQLite file, or a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'megaslide.db'}"
    return request.getfixturevalue("postgres_server").database()


@pytest.fixture
def make_client(tmp_path, monkeypatch):
    """Builds in-process API clients on the real worker and store with fake models; `**overrides`
    are settings. Every client is closed (its worker stopped) at the end of the test."""
    for var in ("MEGASLIDE_API_KEYS", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET"):
        monkeypatch.delenv(var, raising=False)
    opened = []

    def make(
        backend: FakeBackend | None = None, wait_ready: bool = True, **overrides
    ) -> TestClient:
        backend = backend or FakeBackend()
        options = dict(
            data_dir=tmp_path / "data", poll_after_ms=50, cancel_wait_s=5.0, sse_interval_s=0.02
        )
        settings = Settings(**{**options, **overrides})
        client = TestClient(build_app(settings, Fleet.embedded(settings, backend)))
        client.__enter__()
        opened.append(client)
        client.backend = backend
        if wait_ready:
            until(lambda: client.get("/readyz").status_code == 200, what="readyz")
        return client

    yield make
    for client in reversed(opened):
        client.backend.gate.set()
        client.backend.decode_gate.set()
        client.__exit__(None, None, None)
