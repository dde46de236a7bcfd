"""Kernel tests under Triton's interpreter, in a child process: TRITON_INTERPRET must be set
before Triton is imported, and the parent has imported it already."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def interpreted_results(test_file: str, triton_import_error: ImportError | None) -> dict:
    """Run `test_file --interpret-worker` with TRITON_INTERPRET=1; the JSON of its last
    `RESULTS ` line. Skips when Triton does not import here."""
    if triton_import_error is not None:
        pytest.skip(f"triton is not importable here: {triton_import_error}")
    # The child runs the test file as a script: it finds the helpers here on its path.
    support = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (support, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(test_file), "--interpret-worker"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads(lines[-1][len("RESULTS ") :])


def worker_main(worker) -> None:
    """A kernel test file's `__main__`: run `worker` (which prints its `RESULTS ` line) when
    started by `interpreted_results`, otherwise say how to start it."""
    if sys.argv[1:] == ["--interpret-worker"]:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        worker()
    else:
        sys.exit(f"usage: TRITON_INTERPRET=1 {sys.argv[0]} --interpret-worker")
