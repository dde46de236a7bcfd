"""The benchmarks run in their CI-sized form and report what their JSON promises."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_json(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_streaming_benchmark_quick():
    r = run_json("benchmarks/streaming.py", "--quick", "--json")
    assert {"resident_s", "streamed_s", "ratio"} <= r.keys()
    assert r["resident_s"] > 0 and r["streamed_s"] > 0
    assert abs(r["ratio"] - r["streamed_s"] / r["resident_s"]) < 1e-9
    # One bus crossing per block per step: the CFG pair shares it.
    assert r["h2d_bytes_per_step"] == r["streamed_block_bytes"]


def test_prompt_adherence_benchmark_quick():
    r = run_json("benchmarks/prompt_adherence.py", "--count", "2", "--steps", "2", "--json")
    assert r["prompts"] == 2 and len(r["rows"]) == 2
    assert r["unseen_prompts"] == sum(row["unseen_combination"] for row in r["rows"])
    for attr in ("colour", "shape", "motion"):
        assert r["accuracy"][attr] == sum(row[attr] for row in r["rows"]) / 2
        assert r["goals_met"][attr] == (r["accuracy"][attr] >= r["goals"][attr])
    assert r["seconds_per_clip"] > 0


def test_motion_prior_benchmark_quick():
    r = run_json(
        "benchmarks/motion_prior.py",
        "--colours",
        "1",
        "--shapes",
        "1",
        "--samples",
        "8",
        "--noises",
        "1",
        "--times",
        "1.0",
        "--json",
    )
    scores = r["times"]["1.0"]["score_by_direction"]
    assert set(scores) == {"left", "right", "up", "down"}
    assert abs(r["times"]["1.0"]["score"] - sum(scores.values()) / 4) < 1e-9
