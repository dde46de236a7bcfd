"""What every `megaslide` command shares: the usage error, argument parsers, the model flags."""

from __future__ import annotations

import argparse
import json
import re
import sys


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


# The flags that set each field of an engine `Placement` (engine/placement.py), to name its
# rules' reasons in the words the user typed.
PLACEMENT_FLAGS = {
    "device": "--device",
    "devices": "--devices",
    "offload": "--offload",
    "gpu_budget_bytes": "--gpu-budget",
    "gpu_budget": "--gpu-budget",
    "prefetch": "--prefetch",
    "weights": "--weights",
    "host_tier": "--host-tier",
    "disk_io": "--disk-io",
    "timing": "--stats/--trace",
    "compile": "--compile",
    "fp8_matmul": "--fp8-matmul",
}


def in_flag_words(reason: str) -> str:
    """A placement rule's reason with its fields spelled as flags: `weights='fp8'` becomes
    `--weights fp8`, `gpu_budget_bytes` `--gpu-budget` (names that read as plain words, such as
    "devices", are left alone unless they carry a value)."""

    def valued(m: re.Match) -> str:
        flag = PLACEMENT_FLAGS.get(m.group(1))
        return f"{flag} {m.group(2)}" if flag else m.group(0)

    reason = re.sub(r"\b(\w+)='([^']*)'", valued, reason)
    return re.sub(
        r"\b(gpu_budget_bytes|gpu_budget|host_tier|disk_io|fp8_matmul)\b",
        lambda m: PLACEMENT_FLAGS[m.group(1)],
        reason,
    )


def parse_bytes(text: str) -> int:
    """'20GB', '1.5TB', '512MiB' or a plain number of bytes -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    units |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        raise UsageError(f"cannot read a size from {text!r} (expected e.g. 20GB)") from None
    if unit not in units or value < 0:
        known = ", ".join(u for u in units if u)
        raise UsageError(f"cannot read a size from {text!r} (units: {known})")
    return int(value * units[unit])


def parse_cache(text: str | None) -> str | dict | None:
    """--cache as a request's `cache` field: a preset name ("fast", "off"),
    POLICY:THRESHOLD[:FORECAST], or a JSON object. Only the syntax is read here; the request's
    resolution checks the values."""
    if text is None:
        return None
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"--cache: not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise UsageError("--cache: expected a JSON object with policy and threshold")
        return value
    if ":" in text:
        policy, _, rest = text.partition(":")
        threshold, _, forecast = rest.partition(":")
        try:
            value = {"policy": policy.strip(), "threshold": float(threshold)}
        except ValueError:
            raise UsageError(f"--cache: threshold {threshold!r} is not a number") from None
        if forecast:
            value["forecast"] = forecast.strip()
        return value
    return text


def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", help="model directory or packaged model name (default: the packaged model)"
    )
    src.add_argument("--preset", help="random weights of a named preset (for tests and benchmarks)")


def model_source(args):
    """The `ModelSource` that --model/--preset name (the packaged default when neither)."""
    from megaslide.engine.sources import resolve_source

    return resolve_source(args.model, preset=args.preset)


def check_positive(**values: int | None) -> None:
    """UsageError naming the first flag (given by its dest name) below 1."""
    for dest, value in values.items():
        if value is not None and value < 1:
            raise UsageError(f"--{dest.replace('_', '-')} must be at least 1, got {value}")


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


class _NoBar:
    def update(self, n=1):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress_bar(total: int, desc: str, disable: bool = False):
    """A tqdm bar on stderr, or a no-op when disabled."""
    if disable:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
