"""The tree's shape: ruff-formatted and lint-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args", [("format", "--check", "."), ("check", ".")], ids=["format", "lint"]
)
def test_ruff(args):
    done = ruff(*args)
    assert done.returncode == 0, done.stdout + done.stderr
