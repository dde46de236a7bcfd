"""The `megaslide` command line: generate, info, plan, finetune and serve.

Every command validates its input before doing any work. A bad input prints one line naming the
problem and exits with status 2, without a traceback and without leaving a partial output file.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size must look like WIDTHxHEIGHT (e.g. 64x64), got {text!r}") from None
    if w < 2 or h < 2:
        raise UsageError(f"--size {text}: width and height must be positive")
    if w % 2 or h % 2:
        raise UsageError(f"--size {text}: width and height must be even (H.264 yuv420p needs it)")
    return w, h


def parse_bytes(text: str) -> int:
    """'20GB', '1.5TB', '512MiB' or a plain number of bytes -> bytes."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        raise UsageError(f"cannot read a size from {text!r} (expected e.g. 20GB)") from None
    if unit not in units or value < 0:
        raise UsageError(
            f"cannot read a size from {text!r} (units: {', '.join(u for u in units if u)})"
        )
    return int(value * units[unit])


def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", help="model directory or packaged model name (default: the packaged model)"
    )
    src.add_argument("--preset", help="random weights of a named preset (for tests and benchmarks)")


def build_parser() -> argparse.ArgumentParser:
    from .commands import register_all

    parser = argparse.ArgumentParser(prog="megaslide", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"megaslide {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_all(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except (UsageError, ValueError, FileNotFoundError) as e:
        print(f"megaslide {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megaslide {args.command}: interrupted", file=sys.stderr)
        return 130


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


if __name__ == "__main__":
    sys.exit(main())
