"""The `megaslide` command line: generate, info, plan, finetune, finetune-videos and serve.

Every command validates its input before doing any work. A bad input prints one line naming the
problem and exits with status 2, without a traceback and without leaving a partial output file.
"""

from __future__ import annotations

import argparse
import sys

from megaslide.engine import __version__

from . import commands, remote, serve_cmd
from .args import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaslide", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"megaslide {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register(sub)
    remote.register(sub)
    serve_cmd.register(sub)
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


if __name__ == "__main__":
    sys.exit(main())
