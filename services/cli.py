"""The `slora` console script: one subcommand per module under `services.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `register(subparsers)`, which adds its subcommand(s) and sets
# `func(args) -> int` as the parser default. Imported lazily so `slora --help` stays fast.
COMMAND_MODULES: tuple[str, ...] = (
    "services.commands.demo_assets",
    "services.commands.batch",
    "services.commands.control_plane",
    "services.commands.admin",
    "services.commands.worker",
    "services.commands.gateway",
    "services.commands.up",
    "services.commands.generate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora", description="Multi-LoRA serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
