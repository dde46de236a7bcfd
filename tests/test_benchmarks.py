"""The benchmarks run in their CI-sized form and report what their JSON promises."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_streaming_benchmark_quick():
    r = run_json("benchmarks/streaming.py", "--quick", "--json")
    assert {"resident_s", "streamed_s", "ratio"} <= r.keys()
    assert r["resident_s"] > 0 and r["streamed_s"] > 0
    assert abs(r["ratio"] - r["streamed_s"] / r["resident_s"]) < 1e-9
    # One bus crossing per block per step: the CFG pair shares it.
    assert r["h2d_bytes_per_step"] == r["streamed_block_bytes"]
