"""The `megaslide` command line: generate, info, plan, and its handling of bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest

from megaslide.cli.main import main
from megaslide.engine import __version__
from megaslide.engine.training.state_format import state_bytes_per_param

GEN = [
    "generate",
    "a red circle moving right",
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--frames",
    "4",
    "--size",
    "32x32",
    "--no-progress",
]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_writes_a_deterministic_mp4(tmp_path, capsys):
    from megaslide.engine.video import read_video

    paths = [tmp_path / f"{name}.mp4" for name in ("a", "b", "c")]
    for path, seed in zip(paths, ("1", "1", "2")):
        code, _, err = run([*GEN, "-o", str(path), "--seed", seed], capsys)
        assert code == 0, err
    a, b, c = (read_video(p) for p in paths)
    assert a.shape == (4, 32, 32, 3)
    assert paths[0].read_bytes() == paths[1].read_bytes()  # the same file, byte for byte
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--size", "33x32"], "even"),
        (["--frames", "999"], "takes 1 to 32 frames"),
        (["--preset", "nope"], "unknown preset"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--size", "big"], "WIDTHxHEIGHT"),
        (["--weights", "lossless"], "needs --offload stream"),
        (["--stats", "s.json"], "needs --offload stream or --compile"),
        (["--compile", "--devices", "cpu,cpu"], "compile is checked on one device"),
        (["--timesteps", "1000,500"], "need the euler or consistency sampler"),
        (["--sampler", "euler", "--timesteps", "1000,x"], "--timesteps must be comma-separated"),
        (["--guidance-interval", "0.5,0.1"], "start < end"),
    ],
)
def test_bad_generate_input_is_one_line_exit_2_and_no_file(tmp_path, capsys, extra, message):
    out = tmp_path / "out.mp4"
    code, _, err = run([*GEN, "-o", str(out), *extra], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_generate_stats_count_the_rows_a_guidance_interval_saves(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    code, _, err = run(
        [*GEN, "-o", str(tmp_path / "a.mp4"), "--steps", "4", "--guidance", "4"]
        + ["--guidance-interval", "0,0.5", "--sampler", "euler", "--offload", "stream"]
        + ["--stats", str(stats)],
        capsys,
    )
    assert code == 0, err
    got = json.loads(stats.read_text())
    assert (got["passes"], got["row_passes"], got["sampler"]) == (4, 6, "euler")
    assert got["timesteps"] == [1000, 750, 500, 250] and got["guidance_interval"] == [0, 0.5]


def test_empty_prompt_and_missing_model_are_rejected(tmp_path, capsys):
    out = tmp_path / "out.mp4"
    code, _, err = run(["generate", "  ", "-o", str(out)], capsys)
    assert code == 2 and "prompt must not be empty" in err
    code, _, err = run(
        ["generate", "p", "-o", str(out), "--model", str(tmp_path / "missing")], capsys
    )
    assert code == 2 and "not found" in err
    assert not out.exists()


def test_info_reports_exact_parameter_counts(capsys):
    code, out, _ = run(["info", "--preset", "megaslide-105b", "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and 1.0e11 <= info["parameters"] <= 1.1e11
    assert info["config"]["depth"] * info["parameter_counts"]["per_block"] < info["parameters"]


def test_plan_105b(capsys):
    code, out, _ = run(
        ["plan", "--preset", "megaslide-105b", "--mode", "finetune", "--json"], capsys
    )
    p = json.loads(out)
    assert code == 0 and p["fits"], p["problems"]
    assert p["optimizer_state"]["format"] == "fp32"
    assert p["host"]["master"] + p["host"]["adam_moments"] == 12 * p["parameters"]
    code, out, _ = run(["plan", "--preset", "megaslide-105b", "--json"], capsys)
    p = json.loads(out)
    assert abs(p["time_s"]["transfer"] / (210e9 / 55e9) - 1) < 0.05


def test_plan_a_compact_optimizer_state_fits_wan_14b_in_128_gb(capsys):
    flags = ["plan", "--preset", "wan-14b", "--mode", "finetune", "--gpu-mem", "80GB"]
    flags += ["--host-mem", "128GB"]
    code, out, _ = run(flags, capsys)
    assert code == 0 and "optimizer state fp32: 12.00 B per trained parameter" in out
    assert "does not fit: host memory: needs 178.2 GB of 128.0 GB" in out
    hosts = {}
    for state in ("fp32", "fp32/8bit", "bf16-split/8bit", "bf16-sr/8bit"):
        code, out, _ = run([*flags, "--optimizer-state", state, "--json"], capsys)
        p = json.loads(out)
        trained = p["trainable_parameters"]
        assert p["optimizer_state"]["bytes_per_param"] == state_bytes_per_param(state) - (
            2 if state.startswith("fp32") else 0  # an fp32 master streams: no bf16 copy kept
        )
        assert p["host"]["master"] + p["host"]["adam_moments"] == pytest.approx(
            p["optimizer_state"]["bytes_per_param"] * trained, abs=2
        )
        hosts[state] = p["host"]["total"]
        assert p["fits"] == (state != "fp32"), p["problems"]
    # bf16-sr/8bit: 2 + 2.03 B/param where fp32 takes 12, a third (gradient buffers apart).
    assert (
        hosts["bf16-sr/8bit"] < hosts["bf16-split/8bit"] == hosts["fp32/8bit"] < hosts["fp32"] / 1.9
    )
    assert hosts["bf16-sr/8bit"] < 0.35 * hosts["fp32"]
    code, out, err = run([*flags, "--optimizer-state", "bf16/8bit"], capsys)
    assert code == 2 and "a 'bf16' master rounds every update to nearest" in err


def test_plan_shows_the_optimizer_update_of_the_state_format(capsys):
    flags = ["plan", "--preset", "wan-14b", "--mode", "finetune", "--gpu-mem", "80GB"]
    flags += ["--host-mem", "128GB", "--optimizer-state", "bf16-sr/8bit"]
    code, out, _ = run(flags, capsys)
    assert code == 0 and "optimizer update: 12.06 B per trained parameter" in out
    assert "memory-bound" in out
    # On 4 threads the 8-bit codecs bound the update, and the step's optimizer time is theirs.
    code, out, _ = run([*flags, "--cpu-threads", "4", "--json"], capsys)
    p = json.loads(out)
    assert code == 0 and p["machine"]["cpu_threads"] == 4
    assert p["optimizer_state"]["update_bound"] == "compute"
    assert p["time_s"]["optimizer"] == p["optimizer_state"]["update_compute_s"]
    code, _, err = run([*flags, "--cpu-threads", "0"], capsys)
    assert code == 2 and "--cpu-threads must be at least 1" in err


@pytest.mark.slow
def test_console_script_version():
    out = subprocess.run(
        [sys.executable, "-P", "-m", "megaslide.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"megaslide {__version__}"
