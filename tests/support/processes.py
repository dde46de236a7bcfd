"""`megaslide` commands as child processes of a test: servers driven over HTTP on loopback, and
workers, each logging to a file that a failing assertion shows."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import numpy as np

LAUNCH = "import sys; from megaslide.cli.main import main; sys.exit(main(sys.argv[1:]))"
TERMINAL = ("completed", "failed", "cancelled")
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 120
# Settings the tests' environment must not leak into a child.
CLEARED = ("MEGASLIDE_API_KEYS", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET", "MEGASLIDE_DATABASE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """One `megaslide ARGS...` process."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        full_env = {k: v for k, v in os.environ.items() if k not in CLEARED}
        # Two intra-op threads unless told otherwise, as the test process uses (conftest), so
        # both compute in the same order.
        full_env |= {"OMP_NUM_THREADS": "2", **(env or {})}
        # -P: the working directory stays off sys.path (the repository root's kernels/ folder
        # would hide the kernels package that transformers imports).
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-c", LAUNCH, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
            )

    def output(self, tail: int = 3000) -> str:
        return self.log.read_text()[-tail:]

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"exited with {self.proc.returncode}:\n{self.output()}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Server(Child):
    """A `megaslide serve` process on a free loopback port and an HTTP client for it, returned
    once `ready_path` answers 200 (`/healthz` for an API whose workers are elsewhere)."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        ready_path: str = "/readyz",
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        listen = ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        super().__init__(["serve", *listen, *args], log, env)
        self.http = httpx.Client(base_url=self.base, timeout=30)
        self.wait_ready(ready_path)

    def wait_ready(self, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_running()
            try:
                if self.http.get(path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {START_TIMEOUT_S}s:\n{self.output()}")

    def kill9(self) -> None:
        super().kill9()
        self.http.close()

    def stop(self) -> None:
        super().stop()
        self.http.close()

    def video(self, video_id: str) -> dict:
        return self.http.get(f"/v1/videos/{video_id}").json()

    def wait(self, video_id: str, statuses=TERMINAL, timeout: float = JOB_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.video(video_id)
            if v["status"] in statuses:
                return v
            time.sleep(0.1)
        raise AssertionError(f"{video_id} still {v['status']} after {timeout}s:\n{self.output()}")

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def noise_dataset_archive(tmp_path: Path, clips: int, frames: int = 4) -> bytes:
    """A .tar.gz fine-tuning dataset of `clips` random `frames`-frame 32x32 clips, for `POST
    /v1/files`."""
    from megaslide.engine.video import write_mp4

    root = tmp_path / "dataset"
    (root / "clips").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(clips):
        clip = rng.integers(0, 256, (frames, 32, 32, 3), dtype=np.uint8)
        write_mp4(root / "clips" / f"{i}.mp4", clip, fps=8)
        lines.append(json.dumps({"file": f"clips/{i}.mp4", "text": f"noise clip {i}"}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(root, arcname="dataset")
    return buf.getvalue()


ROOT = Path(__file__).resolve().parents[2]


def run_json(*args: str) -> dict:
    """Run a script of the repository (a benchmark with `--json`) and parse what it prints."""
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)
